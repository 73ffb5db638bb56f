"""`tandem bench decode`: time per output token (TPOT) at long contexts, per batch size and KV layout in the pool,
beside the bound a step cannot beat. Scope: planting the contexts, the timed runs, the rows, the report and the plot.

Prefilling 8 x 32k tokens would take most of an hour on one CPU thread, and decode cost does not depend on what the
cached keys hold, so each request's context is planted in the prefix cache: its prompt's full blocks are registered
as cached (hash chain and token ids, as if an earlier request had computed them) over whatever the KV pool holds, and
the request then prefills only its last partial block and decodes. `layout` is how the planted blocks lie in the
pool: `contiguous` (each request's blocks back to back, what a fresh engine allocates for a prompt) or `interleaved`
(the requests' blocks alternate one by one: the most fragmented a pool gets).

TPOT = (wall of generating 1 + N tokens - wall of generating 1 token) / N, greedy, EOS ignored, best of `repeats`,
after a warm-up request.
The bound is the weight bytes at the measured memory-stream rate plus the attention FLOPs at the measured GEMM rate
(bench/model_work.py), both on the run's threads; "bound ratio" is the bound at a context over the bound at the
shortest, to set beside the measured TPOT ratio.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tandem.bench.machine import describe, gemm_flops_per_s, load_line, machine_info, stream_bytes_per_s
from tandem.bench.model_work import decode_attention_flops_per_key, kv_bytes_per_token
from tandem.bench.prompts import random_token_ids
from tandem.entrypoints.engine_args import EngineArgs

LAYOUTS = ("contiguous", "interleaved")
POOL_HEADROOM = 1.2  # the KV pool holds the batch's contexts with this much to spare
WARMUP_LEN, WARMUP_SEED = 16, 999_999  # not a timed prompt's seed (those are 1000 x repeat + row)


@dataclass(frozen=True)
class DecodeBench:
    input_lens: list[int]  # context lengths, planted
    batch_sizes: list[int]
    layouts: list[str]
    max_tokens: int  # N decode tokens timed beyond the first
    repeats: int
    threads_per_rank: int


def plant_prefix(engine: Any, prompts: list[list[int]], layout: str) -> None:
    """Register every full block of each prompt as cached (tandem/engine/block_manager.py's hash chain), free but
    revivable, so the prompts' requests find them as prefix hits."""
    from tandem.engine.block_manager import chain_hash

    bm = engine.scheduler.block_manager
    bs = bm.block_size
    num_blocks = [(len(p) - 1) // bs for p in prompts]  # the last token is always computed
    if sum(num_blocks) > bm.num_free_blocks:
        raise RuntimeError(f"the KV pool has {bm.num_free_blocks} free blocks, the contexts need {sum(num_blocks)}")
    # a request's j-th block comes from pool j % P, as the allocator places it (one pool unless the KV is sharded)
    pools = bm.free_ids
    order: list[list[int]] = [[] for _ in prompts]
    if layout == "contiguous":
        for r, n in enumerate(num_blocks):
            order[r] = [pools[j % len(pools)].popleft() for j in range(n)]
    else:  # the requests' blocks alternate
        for j in range(max(num_blocks)):
            for r, n in enumerate(num_blocks):
                if j < n:
                    order[r].append(pools[j % len(pools)].popleft())
    for prompt, ids in zip(prompts, order, strict=True):
        parent = None
        for i, block_id in enumerate(ids):
            chunk = tuple(prompt[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, chunk)
            block = bm.blocks[block_id]
            if block.hash is not None and bm.hash_to_block.get(block.hash) == block_id:
                del bm.hash_to_block[block.hash]  # what the block cached before: its keys are overwritten now
            block.hash, block.token_ids = parent, chunk
            bm.hash_to_block[parent] = block_id
    for ids in order:
        for block_id in ids:
            pools[block_id % len(pools)].append(block_id)


def time_tpot(engine_args: EngineArgs, config: dict[str, Any], context: int, batch: int, layout: str,
              bench: DecodeBench) -> dict[str, Any]:
    from tandem import LLM, SamplingParams

    pcp = engine_args.prefill_context_parallel_size
    per_token = kv_bytes_per_token(config, _compute_dtype(engine_args, config).itemsize) * config["num_hidden_layers"]
    total_len = context + bench.max_tokens + 1
    kv_bytes = int(POOL_HEADROOM * batch * (total_len + engine_args.block_size) * per_token / pcp) + (64 << 20)
    args = replace(engine_args, max_model_len=total_len, max_num_seqs=batch, kv_cache_memory_bytes=kv_bytes)
    walls: dict[int, float] = {}
    llm = LLM(**vars(args))
    planted = hits = 0
    try:
        warmup = [random_token_ids(config["vocab_size"], WARMUP_LEN, WARMUP_SEED)]  # allocator, kernels, lazy init
        llm.generate([{"prompt_token_ids": p} for p in warmup], SamplingParams(temperature=0, max_tokens=2),
                     use_tqdm=False)
        for r in range(bench.repeats):  # fresh prompts each repeat: no request hits another's decoded blocks
            prompts = [random_token_ids(config["vocab_size"], context, 1000 * r + b) for b in range(batch)]
            plant_prefix(llm.engine, prompts, layout)
            planted += 2 * batch * ((context - 1) // args.block_size) * args.block_size  # both generates hit them
            for n in (1, 1 + bench.max_tokens):
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                start = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                walls[n] = min(walls.get(n, float("inf")), time.perf_counter() - start)
                lengths = {len(o.outputs[0].token_ids) for o in outs}
                if lengths != {n}:
                    raise RuntimeError(f"context {context}, batch {batch}: expected {n} tokens a request, got "
                                       f"{sorted(lengths)}")
        hits = int(_metric(llm, "tandem:prefix_cache_hits"))
    finally:
        llm.shutdown()
    if hits < planted:  # else the timed runs prefilled the contexts and the TPOT is not a decode's
        raise RuntimeError(f"context {context}, batch {batch}: {hits} prompt tokens came from the prefix cache, "
                           f"{planted} were planted")
    return {"input_len": context, "batch_size": batch, "layout": layout, "ttft_s": walls[1], "cached_tokens": hits,
            "tpot_ms": (walls[1 + bench.max_tokens] - walls[1]) / bench.max_tokens * 1e3}


def _metric(llm: Any, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


def _compute_dtype(engine_args: EngineArgs, config: dict[str, Any]) -> torch.dtype:
    from tandem.config import resolve_dtype

    return resolve_dtype(engine_args.dtype, config.get("torch_dtype") or config.get("dtype"))


def run_decode(engine_args: EngineArgs, bench: DecodeBench) -> dict[str, Any]:
    from tandem.assets import DEFAULT_MODEL

    if not engine_args.enable_prefix_caching:
        raise ValueError("--no-enable-prefix-caching is not allowed: the contexts are planted in the prefix cache")
    folder = Path(engine_args.model or DEFAULT_MODEL)
    config = json.loads((folder / "config.json").read_text())
    info = machine_info()
    pcp = engine_args.prefill_context_parallel_size
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    attn = decode_attention_flops_per_key(config)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(bench.threads_per_rank)  # the rates one rank can reach
        bandwidth, gemm = stream_bytes_per_s(), gemm_flops_per_s()
        torch.set_num_threads(bench.threads_per_rank * pcp)  # what MultiprocExecutor divides among the ranks
        print(describe(info))
        print(f"model {folder} ({_compute_dtype(engine_args, config)}); {bench.threads_per_rank} thread(s) a rank; "
              f"stream {bandwidth / 1e9:.1f} GB/s, fp32 GEMM {gemm / 1e9:.1f} GFLOP/s", flush=True)
        rows = []
        for layout in bench.layouts:
            for batch in bench.batch_sizes:
                for context in bench.input_lens:
                    row = time_tpot(engine_args, config, context, batch, layout, bench)
                    row["bound_ms"] = (weights / bandwidth + batch * context * attn / gemm) * 1e3
                    rows.append(row)
                    print(f"  {layout} batch {batch} context {context}: TPOT {row['tpot_ms']:.2f} ms", flush=True)
    finally:
        torch.set_num_threads(threads)
    info["load_avg_1m_at_end"] = os.getloadavg()[0]
    cfg = {"model": str(folder), **asdict(bench), "engine_args": {k: v for k, v in vars(engine_args).items()
                                                                    if k != "extra"}}
    return {"machine": info, "config": cfg, "stream_bytes_per_s": bandwidth, "gemm_flops_per_s": gemm,
            "weight_bytes": weights, "results": rows}


def report(result: dict[str, Any]) -> str:
    lines = ["| layout | batch | context | TPOT ms | bound ms | TPOT / TPOT(shortest) | bound ratio |",
             "|---|---|---|---|---|---|---|"]
    rows = result["results"]
    for r in rows:
        base = next(b for b in rows if b["batch_size"] == r["batch_size"] and b["layout"] == r["layout"])
        lines.append(f"| {r['layout']} | {r['batch_size']} | {r['input_len']} | {r['tpot_ms']:.2f} | "
                     f"{r['bound_ms']:.2f} | {r['tpot_ms'] / base['tpot_ms']:.2f} | "
                     f"{r['bound_ms'] / base['bound_ms']:.2f} |")
    n, repeats = result["config"]["max_tokens"], result["config"]["repeats"]
    lines.append(f"TPOT = (wall of 1 + {n} tokens - wall of 1) / {n}, best of {repeats}; bound = weight bytes at the "
                 "stream rate + attention FLOPs at the GEMM rate")
    lines.append(load_line(result["machine"]))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> Path:
    """TPOT against context length, one line per (batch size, layout), with the bounds dashed beside them."""
    from tandem.bench.plot import Panel, lines_by, machine_caption, plot_lines

    rows = result["results"]

    def label(r: dict[str, Any]) -> str:
        return f"batch {r['batch_size']}" + (f", {r['layout']}" if len(result["config"]["layouts"]) > 1 else "")

    panels = [Panel("TPOT (ms)", lines_by(rows, "input_len", "tpot_ms", label), log_y=True),
              Panel("TPOT / bound", lines_by(rows, "input_len", lambda r: r["tpot_ms"] / r["bound_ms"], label),
                    y_min=0)]
    return plot_lines(path, panels, title="decode at long context", x_label="context tokens",
                      subtitle=machine_caption(result["machine"], Path(result["config"]["model"]).name), log2_x=True)
