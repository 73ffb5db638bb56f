"""lm-eval 0.4.13's `local-completions` against `tandem serve` with its default tokenizer backend: `auto` asks
/tokenizer_info, picks `remote`, and tokenizes through /tokenize and /detokenize (issue 13, part 5).

Runs in lm-eval's own environment (it pulls its own torch and datasets), beside a running server:

    python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 'lm-eval[api]==0.4.13'
    .venv/bin/tandem serve --port 8731 &
    /tmp/lmeval/bin/python benchmarks/lm_eval_remote_tokenizer.py http://127.0.0.1:8731

Checks: the backend chosen is `remote`; loglikelihood and generate_until requests go through; the remote
tokenizer's ids equal the server's /tokenize (no special tokens) and decode back to the text.
"""
import json
import math
import sys
import urllib.request

from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

url = sys.argv[1]
lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model="tandem-dsv3-tiny", max_length=4096)
print("tokenizer backend:", lm.tokenizer_backend, type(lm.tokenizer).__name__)
ctx = "Question: Omar had 35 coins and gave 12 of them to Rosa. How many coins does Omar have left?\nAnswer:"
ll = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, " 23"), 0), Instance("loglikelihood", {}, (ctx, " 47"), 1)])
print("loglikelihood ' 23', ' 47':", ll)
gen = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": ["\n\n"], "max_gen_toks": 32}), 0)])
print("generate_until:", repr(gen[0]))
ids = lm.tok_encode(ctx)
body = json.dumps({"model": "tandem-dsv3-tiny", "prompt": ctx, "add_special_tokens": False}).encode()
request = urllib.request.Request(f"{url}/tokenize", body, {"Content-Type": "application/json"})
ref = json.load(urllib.request.urlopen(request))
assert ids == ref["tokens"], (ids[:8], ref["tokens"][:8])
assert lm.tokenizer.decode(ids) == ctx
assert all(math.isfinite(x) for x, _ in ll) and ll[0][0] > ll[1][0]
print("OK: remote tokenizer ids == /tokenize, decode round-trips,", len(ids), "tokens")
