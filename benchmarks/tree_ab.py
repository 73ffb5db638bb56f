"""One tree's decode speed and prefill time, for before/after comparisons across checkouts: output tokens/s at each
batch (5-shot GSM8K test prompts, greedy, --max-tokens each, EOS ignored, prefix caching off, best of --repeats
after a warm-up) and the seconds of one ~2k-token prompt's prefill.

    python benchmarks/tree_ab.py [--spec '{"method": "mtp", "num_speculative_tokens": 3}'] [--batches 1 32]

Run it from two checkouts in alternation, each with its own TORCH_EXTENSIONS_DIR (the native kernels' build folder
is keyed by name, so two trees sharing one rebuild it in turns), e.g.
    cd OLD && PYTHONPATH=OLD TORCH_EXTENSIONS_DIR=/tmp/old_ext python NEW/benchmarks/tree_ab.py
    cd NEW && python benchmarks/tree_ab.py
It prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from tandem import LLM, SamplingParams
from tandem.assets import DEFAULT_MODEL
from tandem.data.gsm8k import SHARED_GSM8K
from tandem.eval.gsm8k import build_prompts, load_eval_data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--spec", default=None, help="speculative_config as JSON (default: none)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    llm = LLM(args.model, max_model_len=4096, speculative_config=json.loads(args.spec) if args.spec else None,
              enable_prefix_caching=False)
    questions, shots = load_eval_data(str(SHARED_GSM8K / "test.jsonl"), None, max(args.batches), 5, seed=42)[:2]
    prompts = build_prompts(questions, shots)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    out: dict[str, float] = {}
    for batch in args.batches:
        llm.generate(prompts[:batch], params, use_tqdm=False)
        best = 0.0
        for _ in range(args.repeats):
            start = time.perf_counter()
            outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
            wall = time.perf_counter() - start
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outputs) / wall)
        out[f"batch_{batch}_tok_s"] = round(best, 1)
    long_prompt = " ".join(prompts)[:9000]  # ~2k tokens of the bundled model's tokenizer
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([long_prompt], one, use_tqdm=False)
    start = time.perf_counter()
    llm.generate([long_prompt + " x"], one, use_tqdm=False)
    out["prefill_2k_s"] = round(time.perf_counter() - start, 3)
    print(json.dumps(out))
    llm.shutdown()


if __name__ == "__main__":
    main()
