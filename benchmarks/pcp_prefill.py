"""Prefill context parallelism speed: time-to-first-token of ONE long prompt at PCP = 1 and PCP = P with the
same threads per rank; prints the speedup, the parallel efficiency and the bytes all-gathered per layer.

    .venv/bin/python benchmarks/pcp_prefill.py --threads-per-rank 1 --max-num-batched-tokens 8192 2048
    .venv/bin/python benchmarks/pcp_prefill.py --prompt-len 1024 2048 4096 8000 --plot docs/plots/pcp_prefill.png

Prefill time is the wall time of `generate(prompt, max_tokens=1)`: one long prompt, greedy, prefix caching off
(each repeat re-prefills), after a warm-up on a short prompt; the best of `--repeats` is reported. At PCP = 1
the engine runs in this process with `threads_per_rank` torch threads; at PCP = P it spawns P ranks, and the
multi-rank executor gives each rank `torch.get_num_threads() // world` threads, so this process is set to
`threads_per_rank * P` threads before the engine is built. Several `--prompt-len`s are timed on one engine per
(PCP size, budget), shortest first; `--plot` draws prefill time and speedup against prompt length per PCP size.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.bench.machine import machine_info
from tandem.bench.prompts import random_token_ids

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / ".cache" / "smollm2-135m-instruct"
GATHER_FORMULA = (
    "per step: K/V all-gather per layer = P * max_local_tokens * kv_bytes_per_token, where every rank pads its "
    "local tokens to max_local_tokens = max over ranks of (its DualChunkSwap chunks of ceil(L / 2P) tokens) and "
    "kv_bytes_per_token = 2 * num_kv_heads * head_dim * dtype_bytes (GQA: K and V concatenated) or "
    "(kv_lora_rank + qk_rope_head_dim) * dtype_bytes (MLA latent); after the last layer only the rows whose "
    "logits are computed are gathered: P * 1 * hidden_size * dtype_bytes on the prompt's last step (its one "
    "sampled row; each rank pads to the most rows any rank sends), nothing on the earlier steps. Each rank sends "
    "1/P of the gathered tensor and receives (P - 1)/P of it. Summed over the prompt's prefill steps."
)


@dataclass(frozen=True)
class GatherBytes:
    chunk_lens: list[int]  # prompt tokens prefilled per step
    max_local_tokens: list[int]  # per step, the padded rows each rank contributes to every all-gather
    kv_bytes_per_token: int
    hidden_bytes_per_token: int
    kv_per_layer: int  # K/V all-gather bytes of one layer, summed over steps
    restore_total: int  # logits-row all-gather bytes, summed over steps (once per step, not per layer)
    total: int  # kv_per_layer * num_layers + restore_total


def gather_bytes(config: dict, prompt_len: int, batched_tokens: int, pcp_size: int, dtype: str) -> GatherBytes:
    """Bytes all-gathered over the PCP group to prefill one prompt, from tandem's own partition math."""
    from tandem.config import resolve_dtype
    from tandem.worker.pcp import partition

    elem = resolve_dtype(dtype, config.get("torch_dtype") or config.get("dtype")).itemsize  # the compute dtype
    if "kv_lora_rank" in config:
        kv_per_token = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * elem
    else:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        kv_per_token = 2 * num_kv_heads * head_dim * elem
    hidden_per_token = config["hidden_size"] * elem
    # The scheduler prefills min(remaining, budget) tokens per step when this is the only request.
    chunks = [min(batched_tokens, prompt_len - start) for start in range(0, prompt_len, batched_tokens)]
    max_local = [partition(np.array([0, n]), np.array([True]), pcp_size).max_local_tokens for n in chunks]
    kv_per_layer = sum(pcp_size * m * kv_per_token for m in max_local)
    restore_total = pcp_size * hidden_per_token  # the last step's one sampled row; earlier steps sample nothing
    return GatherBytes(chunk_lens=chunks, max_local_tokens=max_local, kv_bytes_per_token=kv_per_token,
                       hidden_bytes_per_token=hidden_per_token, kv_per_layer=kv_per_layer,
                       restore_total=restore_total,
                       total=kv_per_layer * config["num_hidden_layers"] + restore_total)


def child_cpu_seconds() -> dict[int, float]:
    """User + system CPU seconds of each live child process of this one (the spawned ranks), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = set()
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        pids.update(int(pid) for pid in children.read_text().split())
    cpu = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of stat(5))
    return cpu


def rank_cpu_seconds(pcp_size: int, before: dict[int, float], before_self: float) -> list[float]:
    """CPU seconds each rank spent since `before`: this process at PCP = 1, else each spawned rank."""
    if pcp_size == 1:
        return [time.process_time() - before_self]
    after = child_cpu_seconds()
    # The spawn resource tracker is a child too; it idles, so the busiest `pcp_size` children are the ranks.
    return sorted((after[pid] - before.get(pid, 0.0) for pid in after), reverse=True)[:pcp_size]


@dataclass(frozen=True)
class Run:
    prompt_len: int
    pcp_size: int
    max_num_batched_tokens: int
    threads_per_rank: int
    wall_s: float  # best of the repeats
    all_wall_s: list[float]
    rank_cpu_s: list[float]  # CPU seconds of each rank in the best repeat (contention-robust at 1 thread/rank)
    first_token: int


def time_prefill(model: Path, prompts: list[list[int]], pcp_size: int, batched_tokens: int, threads_per_rank: int,
                 repeats: int, dtype: str) -> list[Run]:
    """One Run per prompt, all on one engine (start-up is paid once per PCP size and budget)."""
    from tandem import LLM, SamplingParams

    # Multi-rank: the executor hands each of the `world` ranks get_num_threads() // world threads.
    # Single rank: the engine runs here, on exactly these threads.
    torch.set_num_threads(threads_per_rank * pcp_size)
    rank_threads = max(1, torch.get_num_threads() // pcp_size)  # what MultiprocExecutor hands each rank
    llm = LLM(str(model), dtype=dtype, prefill_context_parallel_size=pcp_size,
              max_num_batched_tokens=batched_tokens, max_model_len=max(8192, max(map(len, prompts)) + 1),
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    runs = []
    try:
        llm.generate([{"prompt_token_ids": prompts[0][:32]}], params, use_tqdm=False)  # warm-up: lazy init
        for ids in prompts:
            walls, cpus, tokens = [], [], set()
            for _ in range(repeats):
                cpu_children, cpu_self = child_cpu_seconds(), time.process_time()
                start = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                walls.append(time.perf_counter() - start)
                cpus.append(rank_cpu_seconds(pcp_size, cpu_children, cpu_self))
                tokens.add(out[0].outputs[0].token_ids[0])
            if len(tokens) != 1:
                raise SystemExit(f"PCP={pcp_size}, {len(ids)} tokens: repeats disagree on the first token: "
                                 f"{sorted(tokens)}")
            best = walls.index(min(walls))
            runs.append(Run(len(ids), pcp_size, batched_tokens, rank_threads, walls[best], walls, cpus[best],
                            tokens.pop()))
    finally:
        llm.shutdown()
    return runs


def print_table(rows: list[dict[str, object]]) -> None:
    print(f"\n{'prompt':>7}{'budget':>7}{'P':>3}{'thr/rank':>9}{'wall s':>9}{'speedup':>9}{'effic.':>8}{'cpu s':>8}"
          f"{'cpu spd':>8}{'K/V B/layer':>13}{'restore B':>11}{'load':>6}{'token':>7}")
    for r in rows:
        print(f"{r['prompt_len']:>7}{r['max_num_batched_tokens']:>7}{r['pcp_size']:>3}{r['threads_per_rank']:>9}{r['wall_s']:>9.2f}"
              f"{r['speedup']:>9.2f}{r['efficiency']:>8.2f}{max(r['rank_cpu_s']):>8.2f}{r['cpu_speedup']:>8.2f}"
              f"{r['kv_gather_bytes_per_layer']:>13}{r['restore_gather_bytes']:>11}{r['load_avg_1m']:>6.2f}"
              f"{r['first_token']:>7}")


def measure(model: Path, prompts: list[list[int]], config: dict, args: argparse.Namespace) -> list[dict]:
    """Rows for every (budget, prompt length, PCP size), each with its speedup over PCP = 1 at that length."""
    rows: list[dict[str, object]] = []
    for budget in args.max_num_batched_tokens:
        runs: dict[int, list[Run]] = {}
        loads: dict[int, float] = {}
        for pcp in (1, *args.pcp_size):
            runs[pcp] = time_prefill(model, prompts, pcp, budget, args.threads_per_rank, args.repeats, args.dtype)
            # Load from other processes inflates wall time (P ranks share the cores with it); read it per run.
            loads[pcp] = os.getloadavg()[0]
            for run in runs[pcp]:
                print(f"  budget {budget}, {run.prompt_len} tokens, PCP={pcp}: wall "
                      + ", ".join(f"{w:.2f}" for w in run.all_wall_s) + " s; rank CPU "
                      + ", ".join(f"{c:.2f}" for c in run.rank_cpu_s)
                      + f" s; load {loads[pcp]:.2f}; first token {run.first_token}")
        for i, base in enumerate(runs[1]):
            for pcp, pcp_runs in runs.items():
                run = pcp_runs[i]
                if run.first_token != base.first_token:
                    raise SystemExit(f"budget {budget}, {run.prompt_len} tokens: PCP=1 gives first token "
                                     f"{base.first_token}, PCP={pcp} gives {run.first_token}")
                speedup = base.wall_s / run.wall_s
                gathered = gather_bytes(config, run.prompt_len, budget, pcp, args.dtype) if pcp > 1 else None
                rows.append({**asdict(run), "speedup": speedup, "efficiency": speedup / pcp,
                             "cpu_speedup": max(base.rank_cpu_s) / max(run.rank_cpu_s), "load_avg_1m": loads[pcp],
                             "kv_gather_bytes_per_layer": gathered.kv_per_layer if gathered else 0,
                             "restore_gather_bytes": gathered.restore_total if gathered else 0,
                             "gather": asdict(gathered) if gathered else None})
    return rows


def plot_rows(rows: list[dict], info: dict, model: str, args: argparse.Namespace) -> Path:
    """Prefill time and speedup over PCP = 1 against prompt length, one line per (PCP size, budget)."""
    from tandem.bench.plot import Panel, lines_by, machine_caption, plot_lines

    many_budgets = len(args.max_num_batched_tokens) > 1

    def label(r: dict) -> str:
        return f"PCP={r['pcp_size']}" + (f", budget {r['max_num_batched_tokens']}" if many_budgets else "")

    def speedup(r: dict) -> float | None:
        return r["speedup"] if r["pcp_size"] > 1 else None

    ideal = {f"ideal {p}x": float(p) for p in args.pcp_size}
    panels = [Panel(f"prefill time (s, best of {args.repeats})", lines_by(rows, "prompt_len", "wall_s", label),
                    log_y=True),
              Panel("speedup over PCP=1", lines_by(rows, "prompt_len", speedup, label), references=ideal, y_min=0)]
    return plot_lines(args.plot, panels, title=f"PCP prefill (TTFT of one prompt), {args.threads_per_rank} "
                      "thread(s) per rank", x_label="prompt tokens", subtitle=machine_caption(info, model),
                      log2_x=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--prompt-len", type=int, nargs="+", default=[8000],
                   help="one or more prompt lengths in tokens (default fits max_model_len 8192)")
    p.add_argument("--pcp-size", type=int, nargs="+", default=[2], help="the PCP sizes compared against PCP = 1")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[8192],
                   help="one or more token budgets; 8192 prefills the prompt in one step, 2048 in chunks")
    p.add_argument("--repeats", type=int, default=2, help="timed prefills per configuration; best is reported")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompt token ids")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="draw prefill time and speedup against prompt length (needs the `plot` extra)")
    args = p.parse_args()
    for name in ("threads_per_rank", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.prompt_len) < 1:
        p.error(f"--prompt-len must be at least 1, got {args.prompt_len}")
    if min(args.pcp_size) < 2:
        p.error(f"--pcp-size must be at least 2, got {args.pcp_size}")
    if args.plot is not None:
        from tandem.bench.plot import PlotUnavailable, require_matplotlib

        try:
            require_matplotlib()
        except PlotUnavailable as e:
            p.error(str(e))
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there (make setup converts SmolLM2)")

    config = json.loads((args.model / "config.json").read_text())
    args.prompt_len = sorted(set(args.prompt_len))
    args.pcp_size = sorted(set(args.pcp_size))
    prompts = [random_token_ids(config["vocab_size"], n, args.seed) for n in args.prompt_len]
    info = machine_info()
    print(f"{info['cpu']}, {info['num_cores']} cores, torch {info['torch']}, load {info['load_avg_1m_at_start']:.2f}")
    print(f"model {args.model.name}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}; "
          f"one prompt of {', '.join(map(str, args.prompt_len))} tokens; {args.threads_per_rank} thread(s) per rank")
    if info["num_cores"] is not None and args.threads_per_rank * max(args.pcp_size) > info["num_cores"]:
        print(f"warning: {max(args.pcp_size)} ranks x {args.threads_per_rank} threads oversubscribe "
              f"{info['num_cores']} cores")

    rows = measure(args.model, prompts, config, args)
    print_table(rows)
    sizes = "/".join(map(str, args.pcp_size))
    print(f"\nfirst tokens agree across PCP sizes; speedup = T_pcp1 / T_pcp{sizes} (wall, best of "
          f"{args.repeats}), efficiency = speedup / P; cpu s = CPU seconds of the busiest rank in that "
          "run and cpu spd its ratio, which other processes' load barely moves at 1 thread per rank; load = 1-min "
          "load average after the run")
    print("bytes all-gathered, " + GATHER_FORMULA)
    for r in rows:
        if r["gather"] is not None:
            g = r["gather"]
            print(f"  {r['prompt_len']} tokens, budget {r['max_num_batched_tokens']}, P={r['pcp_size']}: steps "
                  f"{g['chunk_lens']}, max_local_tokens {g['max_local_tokens']}, {g['kv_bytes_per_token']} B K/V "
                  f"and {g['hidden_bytes_per_token']} B hidden per token -> {g['kv_per_layer']} B K/V per layer, "
                  f"{g['restore_total']} B restore, {g['total'] / 2**20:.1f} MiB in all")
    if args.json is not None:
        cfg = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"machine": info, "config": cfg, "gather_formula": GATHER_FORMULA,
                                         "runs": rows}, indent=2) + "\n")
    if args.plot is not None:
        print(f"plot: {plot_rows(rows, info, args.model.name, args)}")


if __name__ == "__main__":
    main()
