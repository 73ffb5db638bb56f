"""`tandem bench prefill`: time to first token of ONE long prompt at each prompt length and PCP size, with the same
threads per rank; the PCP speedup and efficiency, the bytes all-gathered, the share of the float32 GEMM rate and, with
`--vs hf`, Hugging Face's forward of the same ids. Scope: the timed runs, the rows, the report and the plot (the
per-rank CPU and memory readings are bench/rank_usage.py's, the FLOP count bench/model_work.py's).

TTFT is the wall time of `generate(prompt, max_tokens=1)`: greedy, prefix caching off (each repeat re-prefills),
after a warm-up on a short prompt; the best of `repeats`. All lengths run on one engine per PCP size, shortest first.
At PCP = 1 the engine runs in this process on `threads_per_rank` torch threads; at PCP = P the multi-rank executor
hands each of its P ranks `torch.get_num_threads() // P`, so this process is set to `threads_per_rank * P` threads
while the engine is built. HF (`--vs hf`) runs one forward of the prompt in a spawned process on `threads_per_rank`
threads (its own peak RSS), skipped where its float32 [heads, S, S] scores would not fit in 70% of free memory.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.bench.machine import describe, gemm_flops_per_s, load_line, machine_info
from tandem.bench.model_work import kv_bytes_per_token, prefill_flops
from tandem.bench.prompts import random_token_ids
from tandem.bench.rank_usage import cpu_seconds, peak_rss_mib, rank_pids
from tandem.entrypoints.engine_args import EngineArgs

WARMUP_LEN = 32
GATHER_FORMULA = (
    "per step: K/V all-gather per layer = P * max_local_tokens * kv_bytes_per_token, where every rank pads its "
    "local tokens to max_local_tokens = max over ranks of (its DualChunkSwap chunks of ceil(L / 2P) tokens) and "
    "kv_bytes_per_token = 2 * num_kv_heads * head_dim * dtype_bytes (GQA: K and V concatenated) or "
    "(kv_lora_rank + qk_rope_head_dim) * dtype_bytes (MLA latent); after the last layer only the rows whose "
    "logits are computed are gathered: P * 1 * hidden_size * dtype_bytes on the prompt's last step. Summed over "
    "the prompt's prefill steps."
)


@dataclass(frozen=True)
class PrefillBench:
    input_lens: list[int]  # prompt lengths, timed shortest first
    pcp_sizes: list[int]  # one engine each; speedups are over PCP = 1 when it is among them
    repeats: int
    threads_per_rank: int
    vs: str | None = None  # "hf"


@dataclass(frozen=True)
class PrefillRun:
    system: str  # "tandem" | "hf"
    input_len: int
    pcp_size: int
    wall_s: float  # best of the repeats
    all_wall_s: list[float]
    rank_cpu_s: list[float]  # CPU seconds of each rank in the best repeat (contention-robust at 1 thread/rank)
    peak_rss_mib: list[float]  # each rank's process high-water mark so far
    first_token: int
    kv_layout: str = "replicated"  # the engine's pcp_kv_layout (the gather-bytes formula is the replicated one's)


@dataclass(frozen=True)
class GatherBytes:
    chunk_lens: list[int]  # prompt tokens prefilled per step
    max_local_tokens: list[int]  # per step, the padded rows each rank contributes to every all-gather
    kv_per_layer: int  # K/V all-gather bytes of one layer, summed over steps
    restore_total: int  # logits-row all-gather bytes (once, on the last step)
    total: int  # kv_per_layer * num_layers + restore_total


def gather_bytes(config: dict[str, Any], input_len: int, budget: int, pcp_size: int, elem: int) -> GatherBytes:
    """Bytes all-gathered over the PCP group to prefill one prompt, from tandem's own partition math."""
    from tandem.worker.pcp import partition

    # The scheduler prefills min(remaining, budget) tokens per step when this is the only request.
    chunks = [min(budget, input_len - start) for start in range(0, input_len, budget)]
    max_local = [partition(np.array([0, n]), np.array([True]), pcp_size).max_local_tokens for n in chunks]
    kv_per_layer = sum(pcp_size * m * kv_bytes_per_token(config, elem) for m in max_local)
    restore = pcp_size * config["hidden_size"] * elem  # the last step's one sampled row
    return GatherBytes(chunks, max_local, kv_per_layer, restore, kv_per_layer * config["num_hidden_layers"] + restore)


def time_tandem(engine_args: EngineArgs, prompts: list[list[int]], pcp_size: int, bench: PrefillBench) -> list[
        PrefillRun]:
    """One PrefillRun per prompt, all on one engine (start-up is paid once per PCP size)."""
    from tandem import LLM, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(bench.threads_per_rank * pcp_size)  # what MultiprocExecutor divides among the ranks
    longest = max(map(len, prompts))
    args = replace(engine_args, prefill_context_parallel_size=pcp_size, enable_prefix_caching=False,
                   max_model_len=engine_args.max_model_len or longest + 1)
    params = SamplingParams(temperature=0, max_tokens=1)
    runs = []
    llm = LLM(**vars(args))
    layout = llm.engine.config.parallel_config.pcp_kv_layout
    try:
        llm.generate([{"prompt_token_ids": prompts[0][:WARMUP_LEN]}], params, use_tqdm=False)  # lazy init
        pids = rank_pids(llm)
        for ids in prompts:
            walls, cpus, tokens = [], [], []
            for _ in range(bench.repeats):
                cpu_before = [cpu_seconds(pid) for pid in pids]
                start = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                walls.append(time.perf_counter() - start)
                cpus.append([cpu_seconds(pid) - b for pid, b in zip(pids, cpu_before, strict=True)])
                tokens.append(out[0].outputs[0].token_ids[0])
            if len(set(tokens)) != 1:
                raise RuntimeError(f"PCP={pcp_size}, {len(ids)} tokens: the repeats disagree on the first token: "
                                   f"{tokens}")
            best = walls.index(min(walls))
            runs.append(PrefillRun("tandem", len(ids), pcp_size, walls[best], walls, cpus[best],
                                   [peak_rss_mib(pid) for pid in pids], tokens[0], layout))
            print(f"  {len(ids)} tokens, PCP={pcp_size} ({layout} KV): " + ", ".join(f"{w:.2f}" for w in walls)
                  + " s", flush=True)
    finally:
        llm.shutdown()
        torch.set_num_threads(threads)
    return runs


def hf_forward(folder: str, dtype: str, ids: list[int], threads: int) -> dict[str, Any]:
    """In a spawned process: one HF forward of the prompt after a short one; its wall, first token and peak RSS."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    prompt = torch.tensor([ids])  # [1, S]
    with torch.inference_mode():
        model(prompt[:, :WARMUP_LEN])
        start = time.perf_counter()
        logits = model(prompt).logits[0, -1]  # [V]
        wall = time.perf_counter() - start
    return {"wall_s": wall, "first_token": int(logits.argmax()), "peak_rss_mib": peak_rss_mib(os.getpid())}


def hf_fits(config: dict[str, Any], input_len: int) -> bool:
    available = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    return 3 * config["num_attention_heads"] * input_len * input_len * 4 < 0.7 * available


def time_hf(folder: str, dtype: str, prompts: list[list[int]], config: dict[str, Any],
            bench: PrefillBench) -> list[PrefillRun]:
    runs = []
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        for ids in prompts:
            if not hf_fits(config, len(ids)):
                print(f"  {len(ids)} tokens, HF: skipped, its attention scores would not fit in memory")
                continue
            walls, out = [], {}
            for _ in range(bench.repeats):
                out = pool.submit(hf_forward, folder, dtype, ids, bench.threads_per_rank).result()
                walls.append(out["wall_s"])
            runs.append(PrefillRun("hf", len(ids), 1, min(walls), walls, [], [out["peak_rss_mib"]],
                                   out["first_token"]))
            print(f"  {len(ids)} tokens, HF forward: " + ", ".join(f"{w:.2f}" for w in walls) + " s", flush=True)
    return runs


def run_prefill(engine_args: EngineArgs, bench: PrefillBench) -> dict[str, Any]:
    from tandem.config import ModelConfig

    info = machine_info()
    mc = ModelConfig.from_path(engine_args.model or _bundled(), engine_args.dtype, None, engine_args.seed)
    config, dtype = json.loads((Path(mc.model) / "config.json").read_text()), str(mc.dtype).removeprefix("torch.")
    prompts = [random_token_ids(config["vocab_size"], n, engine_args.seed) for n in bench.input_lens]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gemm = gemm_flops_per_s()  # one thread: the rate each rank's thread can reach
    torch.set_num_threads(threads)
    print(describe(info))
    print(f"model {mc.model} ({mc.architecture}, {dtype}): one prompt of {', '.join(map(str, bench.input_lens))} "
          f"tokens, {engine_args.max_num_batched_tokens} tokens a step; {bench.threads_per_rank} thread(s) per rank; "
          f"fp32 GEMM {gemm / 1e9:.1f} GFLOP/s a thread", flush=True)
    runs = [run for pcp in bench.pcp_sizes for run in time_tandem(engine_args, prompts, pcp, bench)]
    if bench.vs == "hf":
        runs += time_hf(mc.model, dtype, prompts, config, bench)
    info["load_avg_1m_at_end"] = os.getloadavg()[0]
    rows = [_row(run, runs, config, engine_args.max_num_batched_tokens, mc.dtype.itemsize, gemm, bench)
            for run in runs]
    cfg = {"model": mc.model, "architecture": mc.architecture, "dtype": dtype, **asdict(bench),
           "max_num_batched_tokens": engine_args.max_num_batched_tokens, "seed": engine_args.seed}
    return {"machine": info, "config": cfg, "gemm_flops_per_s": gemm, "gather_formula": GATHER_FORMULA,
            "results": rows}


def _bundled() -> str:
    from tandem.assets import DEFAULT_MODEL

    return str(DEFAULT_MODEL)


def _row(run: PrefillRun, runs: list[PrefillRun], config: dict[str, Any], budget: int, elem: int, gemm: float,
         bench: PrefillBench) -> dict[str, Any]:
    """A run with its ratios: over tandem PCP = 1 at its length (when measured) and tandem over HF."""
    base = next((r for r in runs if r.system == "tandem" and r.pcp_size == 1 and r.input_len == run.input_len), None)
    hf = next((r for r in runs if r.system == "hf" and r.input_len == run.input_len), None)
    threads = run.pcp_size * bench.threads_per_rank  # HF runs as one rank
    row: dict[str, Any] = asdict(run) | {
        "gemm_fraction": prefill_flops(config, run.input_len) / (run.wall_s * threads) / gemm,
        "gather": asdict(gather_bytes(config, run.input_len, budget, run.pcp_size, elem))
        if run.system == "tandem" and run.pcp_size > 1 and run.kv_layout == "replicated" else None}
    if base is not None:
        speedup = base.wall_s / run.wall_s
        row |= {"speedup": speedup, "efficiency": speedup / run.pcp_size,
                "same_first_token": run.first_token == base.first_token}
        if run.rank_cpu_s and max(run.rank_cpu_s) > 0:  # /proc counts in clock ticks: a short run may read 0
            row["cpu_speedup"] = max(base.rank_cpu_s) / max(run.rank_cpu_s)
    if hf is not None and run.system == "tandem":
        row["vs_hf"] = hf.wall_s / run.wall_s
    return row


def mismatched_first_tokens(result: dict[str, Any]) -> list[str]:
    """tandem rows whose first token differs from PCP = 1's at that length (PCP must not change the output)."""
    return [f"{r['input_len']} tokens, PCP={r['pcp_size']}" for r in result["results"]
            if r["system"] == "tandem" and r.get("same_first_token") is False]


def report(result: dict[str, Any]) -> str:
    lines = ["| prompt | system | PCP | TTFT s | speedup | efficiency | busiest rank CPU s | CPU speedup | "
             "of GEMM rate | K/V gathered B/layer | peak RSS/rank MiB | first token | vs HF |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        gathered = r["gather"]["kv_per_layer"] if r["gather"] else ""
        same = {True: "=", False: "DIFFERS", None: ""}[r.get("same_first_token")]
        pcp = f"{r['pcp_size']} {r['kv_layout']}" if r["system"] == "tandem" and r["pcp_size"] > 1 else r["pcp_size"]
        lines.append(f"| {r['input_len']} | {r['system']} | {pcp} | {r['wall_s']:.2f} | "
                     f"{_fmt(r.get('speedup'), '{:.2f}x')} | {_fmt(r.get('efficiency'), '{:.2f}')} | "
                     f"{_fmt(max(r['rank_cpu_s'], default=None), '{:.2f}')} | "
                     f"{_fmt(r.get('cpu_speedup'), '{:.2f}x')} | {r['gemm_fraction']:.0%} | {gathered} | "
                     + "/".join(f"{m:.0f}" for m in r["peak_rss_mib"])
                     + f" | {r['first_token']} {same} | {_fmt(r.get('vs_hf'), '{:.2f}x')} |")
    cfg = result["config"]
    lines.append(f"TTFT: best of {cfg['repeats']}; speedup and efficiency against tandem PCP=1 at that length; "
                 "CPU s: the busiest rank's CPU seconds in the best run (load from other processes barely moves it); "
                 "of GEMM rate: necessary FLOPs / (TTFT x threads) / the one-thread fp32 GEMM rate; "
                 "first token '=': the same as PCP=1's")
    lines.append("bytes all-gathered (replicated KV), " + result["gather_formula"])
    lines.append(load_line(result["machine"]))
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else spec.format(value)


def plot(result: dict[str, Any], path: str) -> Path:
    """TTFT and speedup over PCP = 1 against prompt length, one line per system and PCP size."""
    from tandem.bench.plot import Panel, lines_by, machine_caption, plot_lines

    rows, cfg = result["results"], result["config"]

    def label(r: dict[str, Any]) -> str:
        return "HF forward" if r["system"] == "hf" else f"tandem PCP={r['pcp_size']}"

    def speedup(r: dict[str, Any]) -> float | None:
        return r.get("speedup") if r["system"] == "tandem" and r["pcp_size"] > 1 else None

    ideal = {f"ideal {p}x": float(p) for p in cfg["pcp_sizes"] if p > 1}
    panels = [Panel(f"TTFT (s, best of {cfg['repeats']})", lines_by(rows, "input_len", "wall_s", label), log_y=True),
              Panel("speedup over PCP=1", lines_by(rows, "input_len", speedup, label), references=ideal, y_min=0)]
    return plot_lines(path, panels, title=f"prefill of one prompt, {cfg['threads_per_rank']} thread(s) per rank",
                      x_label="prompt tokens", subtitle=machine_caption(result["machine"], Path(cfg["model"]).name),
                      log2_x=True)
