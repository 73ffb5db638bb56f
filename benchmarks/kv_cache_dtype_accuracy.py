"""What a narrower KV cache costs in accuracy, against `auto` (the compute dtype) on the same prompts, greedy:

    .venv/bin/python benchmarks/kv_cache_dtype_accuracy.py [--model .cache/smollm2-135m-instruct]

`auto` answers 64 everyday instructions and GSM8K questions (chat format), 64 greedy tokens each; then
every kv_cache_dtype reads each prompt + that answer back with prompt_logprobs (teacher-forced: the same tokens for
every dtype, so no divergence compounds) and is compared with `auto`'s own read at the answer's positions: top-1
agreement (argmax equal) and mean |Δ logprob| of the answer's token. New keys are stored in the cache's dtype
before a step attends to them, so a prefill reads the narrow cache exactly as decodes do.
(GSM8K accuracy and acceptance per dtype: `tandem eval gsm8k --kv-cache-dtype DTYPE`.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")


def logprob_agreement(model: str, num_prompts: int, max_tokens: int) -> list[dict]:
    from tandem import LLM, SamplingParams
    from tandem.bench.prompts import prompt_ids, prompt_texts

    half = num_prompts // 2
    texts = prompt_texts("everyday", half) + prompt_texts("gsm8k", num_prompts - half)
    reads: dict[str, list[list[dict[int, float]]]] = {}
    answers: list[list[int]] = []
    prompts: list[list[int]] = []
    for dtype in DTYPES:
        llm = LLM(model, dtype="float32", kv_cache_dtype=dtype, enable_prefix_caching=False)
        try:
            if not answers:
                prompts, _ = prompt_ids(model, llm.get_tokenizer(), texts)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                    use_tqdm=False)
                answers = [list(o.outputs[0].token_ids) for o in outs]
            outs = llm.generate([{"prompt_token_ids": p + a} for p, a in zip(prompts, answers, strict=True)],
                                SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
            # the answer's positions: prompt_logprobs[i] is the distribution that predicted token i
            reads[dtype] = [o.prompt_logprobs[len(p):] for o, p in zip(outs, prompts, strict=True)]
        finally:
            llm.shutdown()
    rows = []
    for dtype in DTYPES:
        agree = total = 0
        delta = 0.0
        for ref_seq, seq, answer in zip(reads["auto"], reads[dtype], answers, strict=True):
            for ref, got, token in zip(ref_seq, seq, answer, strict=True):
                agree += max(ref, key=ref.__getitem__) == max(got, key=got.__getitem__)
                delta += abs(ref[token] - got[token])
                total += 1
        rows.append({"kv_cache_dtype": dtype, "positions": total, "top1_agreement": agree / total,
                     "mean_abs_delta_logprob": delta / total})
        print(f"{dtype:>10}: top-1 agreement {agree / total:.4f}, mean |Δ logprob| {delta / total:.5f} "
              f"over {total} positions", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=".cache/smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--output-json", type=Path)
    args = p.parse_args()
    for name in ("num_prompts", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    rows = logprob_agreement(args.model, args.num_prompts, args.max_tokens)
    if args.output_json:
        args.output_json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
