"""Speculative decoding benchmark: output tokens/s and mean acceptance length of no-spec vs MTP K=1..3
vs n-gram (and DSpark on the bundled model), at batch 1 and batch 32, in one run on one model.

    python benchmarks/spec_decode.py [--model PATH] [--max-tokens 128] [--batches 1 32] [--compilation-mode 0|3]
        [--json out.json] [--plot acceptance.png]

Default model: the bundled tandem-dsv3-tiny, with its trained MTP head and DSpark drafter. MTP rows need a
checkpoint with MTP layers (num_nextn_predict_layers > 0); they are skipped otherwise. Prompts: 5-shot GSM8K
test questions (`tandem eval gsm8k`'s layout) from ../shared/data/gsm8k when present, else the synthetic split;
generation stops at the answer's end (a blank line), as in the eval. Per-position acceptance (vLLM's definition):
drafts accepted at position i / drafts verified, i = 1..K, over every step of the runs on one engine (the warm-up
included); `--plot` draws it per drafter, one panel per batch size.
Every config's engine is built first and the timed runs go round-robin, so machine noise falls on all of them
alike; each point is the best of --repeats runs, and "paired" the median over rounds of its tok/s over no-spec's
in the same round (robust to one lucky round; use --repeats 5 or more).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tandem import LLM, SamplingParams
from tandem.assets import DEFAULT_DSPARK, DEFAULT_MODEL
from tandem.bench.machine import machine_info
from tandem.data.gsm8k import SHARED_GSM8K, STOP_STRINGS
from tandem.eval.gsm8k import build_prompts, load_eval_data

GSM8K = SHARED_GSM8K / "test.jsonl"


def prompts(n: int) -> list[str]:
    data = str(GSM8K) if GSM8K.is_file() else "synthetic"
    questions, shots = load_eval_data(data, None, n, 5, seed=42)[:2]  # (a third item in this tree: the pool name)
    return build_prompts(questions, shots)


def build(model: str, spec: dict | None, args: argparse.Namespace) -> LLM:
    compilation = {"mode": args.compilation_mode} if args.compilation_mode else None
    # prefix caching on (the engine's default): the shared 5-shot prefix, and from the second timed run on the
    # whole prompts, are cached, so the best run measures decoding, which is what speculation changes
    llm = LLM(model, dtype=args.dtype, max_model_len=args.max_model_len, speculative_config=spec,
              compilation_config=compilation, num_gpu_blocks_override=args.num_blocks)
    llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    return llm


def run_batch(engines: dict[str, LLM], batch: int, max_tokens: int, repeats: int) -> dict[str, dict]:
    """Every config's engine is built first and the timed runs go round-robin (the order rotating each round),
    so a slow patch of a shared machine falls on every config alike; each config reports its best run, and its
    paired ratio to the first config (no-spec): the median over rounds of its tok/s over the first's in the same
    round. Best against best can pair one config's luckiest round with another's slow one; the paired median
    cannot (a best-of-3 batch-1 MTP K=2 read 1.45x where its parts allow at most ~1.34x)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=STOP_STRINGS)
    batch_prompts = prompts(batch)
    names = list(engines)
    walls: dict[str, list[float]] = {name: [] for name in names}  # [repeats] each, in round order
    outs: dict[str, list] = {}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            outs[name] = engines[name].generate(batch_prompts, params, use_tqdm=False)
            walls[name].append(time.perf_counter() - start)
    tokens_of = {name: sum(len(o.outputs[0].token_ids) for o in outs[name]) for name in names}
    base = names[0]
    results = {}
    for name, llm in engines.items():
        metrics = {m.name: m.values if hasattr(m, "values") else m.value for m in llm.get_metrics()}
        tokens = tokens_of[name]
        paired = statistics.median(tokens / w / (tokens_of[base] / b) for w, b in zip(walls[name], walls[base],
                                                                                      strict=True))
        elapsed = min(walls[name])
        drafts = metrics.get("tandem:spec_decode_num_drafts") or 0
        per_pos = metrics.get("tandem:spec_decode_num_accepted_tokens_per_pos") or []
        results[name] = {
            "batch": batch, "tokens_per_s": tokens / elapsed, "wall_s": elapsed, "paired_vs_no_spec": paired,
            "mean_acceptance_length": metrics.get("tandem:spec_decode_mean_acceptance_length", 1.0),
            "acceptance_rate": metrics.get("tandem:spec_decode_acceptance_rate"),
            "acceptance_per_pos": [n / drafts for n in per_pos] if drafts else []}
    return results


def plot_acceptance(results: list[dict], model: str, info: dict, args: argparse.Namespace) -> Path:
    """Acceptance rate at each draft position, one line per drafter, one panel per batch size."""
    from tandem.bench.plot import Panel, lines_by, machine_caption, plot_lines

    points = [{"config": r["config"], "batch": r["batch"], "position": i + 1, "rate": rate}
              for r in results for i, rate in enumerate(r["acceptance_per_pos"])]
    panels = [Panel(f"acceptance rate, batch {b}", lines_by([q for q in points if q["batch"] == b], "position",
                                                           "rate", lambda q: q["config"]), y_min=0)
              for b in args.batches]
    return plot_lines(args.plot, panels, title=f"Per-position draft acceptance (greedy, GSM8K 5-shot, "
                      f"<= {args.max_tokens} tokens)", x_label="draft position",
                      subtitle=machine_caption(info, model), share_y=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--compilation-mode", type=int, default=0, help="3: compiled pieces (VLLM_COMPILE)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point; the best is reported")
    p.add_argument("--num-blocks", type=int, default=2048,
                   help="KV blocks per engine (every config's engine is alive at once)")
    p.add_argument("--json")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="draw the per-position acceptance rate of each drafter (needs the `plot` extra)")
    args = p.parse_args()
    if args.plot is not None:
        from tandem.bench.plot import PlotUnavailable, require_matplotlib

        try:
            require_matplotlib()
        except PlotUnavailable as e:
            p.error(str(e))
    info = machine_info()
    has_mtp = bool(json.loads((Path(args.model) / "config.json").read_text()).get("num_nextn_predict_layers"))
    configs: list[tuple[str, dict | None]] = [("no-spec", None)]
    if has_mtp:
        configs += [(f"mtp K={k}", {"method": "mtp", "num_speculative_tokens": k}) for k in (1, 2, 3)]
    configs.append(("ngram K=3", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}))
    if Path(args.model) == DEFAULT_MODEL:
        configs.append(("dspark K=3", {"method": "dspark", "model": str(DEFAULT_DSPARK), "num_speculative_tokens": 3}))
    results = []
    # a checkout without ../shared beside it (a git worktree elsewhere) times synthetic prompts: shorter contexts and
    # near-total acceptance, numbers that compare with nothing measured on GSM8K; say which prompts ran
    print(f"prompts: 5-shot GSM8K test from {GSM8K}" if GSM8K.is_file()
          else f"prompts: SYNTHETIC ({GSM8K} not found): not comparable with GSM8K runs")
    print(f"{'config':<12} {'batch':>5} {'tok/s':>9} {'vs no-spec':>10} {'paired':>7} {'accept len':>10} "
          f"{'accept rate':>11}  per position")
    engines = {name: build(args.model, spec, args) for name, spec in configs}
    for batch in args.batches:
        batch_results = run_batch(engines, batch, args.max_tokens, args.repeats)
        base = batch_results["no-spec"]["tokens_per_s"]
        for name, r in batch_results.items():
            r["config"] = name
            rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
            per_pos = " ".join(f"{x:.3f}" for x in r["acceptance_per_pos"]) or "-"
            print(f"{name:<12} {batch:>5} {r['tokens_per_s']:>9.1f} {r['tokens_per_s'] / base:>9.2f}x "
                  f"{r['paired_vs_no_spec']:>6.2f}x {r['mean_acceptance_length']:>10.3f} {rate:>11}  {per_pos}")
            results.append(r)
    for llm in engines.values():
        llm.shutdown()
    if not has_mtp:
        print("(MTP rows skipped: the checkpoint has no MTP layers)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot is not None:
        print(f"plot: {plot_acceptance(results, Path(args.model).name, info, args)}")


if __name__ == "__main__":
    main()
