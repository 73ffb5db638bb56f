"""Decode at long context: TPOT (time per output token) at 1k / 8k / 32k tokens of context, batch 1 and 8, on the
DeepSeek-V3-shaped checkpoint of benchmarks/long_prefill.py, and the same decode attention alone per layer.

    .venv/bin/python benchmarks/long_decode.py --contexts 1024 8192 32768 --batches 1 8
    PYTHONPATH=/work/before .venv/bin/python benchmarks/long_decode.py ...   # the same on an older checkout

Prefilling 8 x 32k tokens would take most of an hour on one CPU thread, and decode cost does not depend on
what the cached keys hold, so each request's context is planted in the prefix cache instead: its prompt's full
blocks are registered as cached (hash chain and token ids, as if an earlier request had computed them) with
whatever the KV pool holds, and the request then prefills only its last partial block and decodes. `--layout`
chooses how the planted blocks lie in the pool: `contiguous` (each request's blocks back to back, what a fresh
engine allocates for a prompt) or `interleaved` (the requests' blocks alternate, one block each: the most
fragmented a pool gets, as when decodes of a batch grow block by block).

TPOT = (wall of generating 1 + N tokens - wall of generating 1 token) / N, greedy, 1 thread, best of
`--repeats`. The bound a step cannot beat is its weight reads at the measured memory bandwidth plus its
attention FLOPs at the measured GEMM rate (absorbed MLA decode: 2 x heads x context x (2 L + rope) per layer per
row); `model ratio` is that bound at a context over the bound at the shortest one, to set beside the measured
TPOT ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_prefill import model_folder  # noqa: E402


def plant_prefix(engine: object, prompts: list[list[int]], layout: str) -> None:
    """Register every full block of each prompt as cached (tandem/engine/block_manager.py's hash chain)."""
    from tandem.engine.block_manager import chain_hash

    bm = engine.scheduler.block_manager  # type: ignore[attr-defined]
    bs = bm.block_size
    num_blocks = [(len(p) - 1) // bs for p in prompts]
    if sum(num_blocks) > bm.num_free_blocks:
        raise SystemExit(f"the KV pool has {bm.num_free_blocks} free blocks, the contexts need {sum(num_blocks)}")
    # a request's j-th block comes from pool j % P, as the allocator places it (one pool unless the KV is sharded)
    pools = bm.free_ids
    order: list[list[int]] = [[] for _ in prompts]
    if layout == "contiguous":
        for r, n in enumerate(num_blocks):
            order[r] = [pools[j % len(pools)].popleft() for j in range(n)]
    else:  # round robin: the requests' blocks alternate
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
            block.hash, block.token_ids = parent, chunk
            bm.hash_to_block[parent] = block_id
    for ids in order:  # free but cached: the prompts' requests revive them
        for block_id in ids:
            pools[block_id % len(pools)].append(block_id)


def tpot(folder: Path, context: int, batch: int, new_tokens: int, repeats: int, layout: str) -> dict:
    from tandem import LLM, SamplingParams
    from tandem.bench.prompts import random_token_ids

    config = json.loads((folder / "config.json").read_text())
    per_token = config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4
    llm = LLM(str(folder), dtype="float32", max_model_len=context + new_tokens + 32, max_num_seqs=batch,
              kv_cache_memory_bytes=int(1.2 * batch * (context + new_tokens + 64) * per_token) + (64 << 20))
    try:
        walls: dict[int, float] = {}
        for r in range(repeats):
            prompts = [random_token_ids(config["vocab_size"], context, 1000 * r + b) for b in range(batch)]
            plant_prefix(llm.engine, prompts, layout)
            for n in (1, 1 + new_tokens):
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                walls[n] = min(walls.get(n, float("inf")), time.perf_counter() - start)
    finally:
        llm.shutdown()
    return {"context": context, "batch": batch, "layout": layout,
            "tpot_ms": (walls[1 + new_tokens] - walls[1]) / new_tokens * 1e3, "ttft_s": walls[1]}


def machine_rates() -> tuple[float, float]:
    """(bytes/s of streaming a 256 MiB tensor, FLOP/s of a float32 2048^3 GEMM), one thread, best of 4."""
    x, a, b = torch.randn(64 << 20), torch.randn(2048, 2048), torch.randn(2048, 2048)
    stream = gemm = float("inf")
    for _ in range(4):
        t = time.perf_counter()
        x.sum()
        stream = min(stream, time.perf_counter() - t)
        t = time.perf_counter()
        a @ b
        gemm = min(gemm, time.perf_counter() - t)
    return x.numel() * 4 / stream, 2 * 2048**3 / gemm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--layout", choices=["contiguous", "interleaved"], nargs="+", default=["contiguous"])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    from tandem.bench.machine import machine_info

    info = machine_info()
    folder = model_folder("dsv3", 32768)
    config = json.loads((folder / "config.json").read_text())
    print(f"{info['cpu']}, {info['num_cores']} cores, torch {info['torch']}, 1 thread; {folder.name}", flush=True)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    bandwidth, gemm = machine_rates()
    print(f"stream {bandwidth / 1e9:.1f} GB/s, fp32 GEMM {gemm / 1e9:.1f} GFLOP/s", flush=True)
    lora, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    attn_flops = 2 * config["num_attention_heads"] * (2 * lora + rope) * config["num_hidden_layers"]  # per key
    rows = []
    for layout in a.layout:
        for batch in a.batches:
            for context in sorted(a.contexts):
                row = tpot(folder, context, batch, a.new_tokens, a.repeats, layout)
                row["bound_ms"] = (weights / bandwidth + batch * context * attn_flops / gemm) * 1e3
                rows.append(row)
                print(f"  {layout:>11} batch {batch:>2} context {context:>6}: TPOT {row['tpot_ms']:.2f} ms", flush=True)
    print("\n| layout | batch | context | TPOT ms | bound ms | TPOT / TPOT(shortest) | model ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["batch"] == r["batch"] and b["layout"] == r["layout"])
        print(f"| {r['layout']} | {r['batch']} | {r['context']} | {r['tpot_ms']:.2f} | {r['bound_ms']:.2f} | "
              f"{r['tpot_ms'] / base['tpot_ms']:.2f} | {r['bound_ms'] / base['bound_ms']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
