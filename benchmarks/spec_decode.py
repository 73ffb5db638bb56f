"""Speculative decoding benchmark: output tokens/s and mean acceptance length of no-spec vs MTP K=1..3
vs n-gram, at batch 1 and batch 32, in one run on one model.

    python benchmarks/spec_decode.py --model PATH [--max-tokens 64] [--json out.json]

MTP rows need a checkpoint with MTP layers (num_nextn_predict_layers > 0); they are skipped otherwise.
Prompts: GSM8K test questions from ../shared/data/gsm8k when present, else a built-in list.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tandem import LLM, SamplingParams

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
FALLBACK = ["Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
            "Question: A train travels 60 km per hour for 3 hours. How far does it go?\nAnswer:",
            "Question: Sara reads 12 pages a day. How many pages does she read in a week?\nAnswer:"]


def prompts(n: int) -> list[str]:
    if GSM8K.is_file():
        rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:n]]
        return [f"Question: {r['question']}\nAnswer:" for r in rows]
    return [FALLBACK[i % len(FALLBACK)] for i in range(n)]


def run(model: str, spec: dict | None, batch: int, max_tokens: int, args: argparse.Namespace) -> dict:
    llm = LLM(model, dtype=args.dtype, max_model_len=args.max_model_len, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts(batch), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"batch": batch, "tokens_per_s": tokens / elapsed, "wall_s": elapsed,
            "mean_acceptance_length": metrics.get("tandem:spec_decode_mean_acceptance_length", 1.0),
            "acceptance_rate": metrics.get("tandem:spec_decode_acceptance_rate")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--json")
    args = p.parse_args()
    has_mtp = bool(json.loads((Path(args.model) / "config.json").read_text()).get("num_nextn_predict_layers"))
    configs: list[tuple[str, dict | None]] = [("no-spec", None)]
    if has_mtp:
        configs += [(f"mtp K={k}", {"method": "mtp", "num_speculative_tokens": k}) for k in (1, 2, 3)]
    configs.append(("ngram K=3", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}))
    results = []
    print(f"{'config':<12} {'batch':>5} {'tok/s':>9} {'vs no-spec':>10} {'accept len':>10} {'accept rate':>11}")
    for batch in args.batches:
        base = None
        for name, spec in configs:
            r = run(args.model, spec, batch, args.max_tokens, args) | {"config": name}
            base = base or r["tokens_per_s"]
            rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
            print(f"{name:<12} {batch:>5} {r['tokens_per_s']:>9.1f} {r['tokens_per_s'] / base:>9.2f}x "
                  f"{r['mean_acceptance_length']:>10.3f} {rate:>11}")
            results.append(r)
    if not has_mtp:
        print("(MTP rows skipped: the checkpoint has no MTP layers)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
