"""Script run under `torchrun` by test_multirank: PCP=2 greedy generation; rank 0 writes the tokens."""

from __future__ import annotations

import json
import sys

from tandem import LLM, SamplingParams

if __name__ == "__main__":
    model, prompts_file, out_file = sys.argv[1:4]
    prompts = json.loads(open(prompts_file).read())
    llm = LLM(model, dtype="float32", prefill_context_parallel_size=2, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    with open(out_file, "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
    llm.shutdown()
