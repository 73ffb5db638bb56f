"""PCP KV layouts side by side (issue 17): TTFT and TPOT at long context, PCP=2, `pcp_kv_layout` replicated vs
sharded, with the bytes each rank receives from PCP all-gathers per step (measured, and from the formula in
tandem/attention/sharded_kv.py); and the longest context a fixed per-rank KV budget serves at P = 1, 2, 4.

    .venv/bin/python benchmarks/kv_layout.py --contexts 8192 32768            # TTFT / TPOT / bytes
    .venv/bin/python benchmarks/kv_layout.py --capacity                       # max context per layout and P
    .venv/bin/python benchmarks/kv_layout.py --capacity --per-rank-tokens 512 --kv-cache-dtypes auto bfloat16 fp8

Model: the DeepSeek-V3-shaped checkpoint of `tandem bench prefill --random-model dsv3` (MLA, kv_lora 512, rope 64,
16 heads, 2 layers), float32, 2 ranks x 1 thread, 2,048-token chunks. TTFT: one fresh prompt of the context's length.
TPOT: the context planted in the prefix cache (`tandem bench decode`: decode cost does not depend on what
the cached keys hold), then (wall of 1 + N tokens - wall of 1 token) / N, best of `--repeats`. Capacity: the
bundled model with a per-rank KV budget of C float32 tokens' bytes, per kv_cache_dtype (docs/kv_cache_dtype.md);
the longest prompt that runs (prompt + 4 generated tokens), and one token more refused.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tandem.bench.decode import plant_prefix
from tandem.bench.random_model import random_model_folder

PCP = 2
CHUNK = 2048


def _gathered(llm: object) -> float:
    return {m.name: m.value for m in llm.get_metrics()}["tandem:pcp_gathered_bytes"]  # type: ignore[attr-defined]


def formula_bytes(config: dict, layout: str, local: int, prefill: bool) -> int:
    """Bytes a rank receives per layer per step (tandem/attention/sharded_kv.py's formula): P ranks, `local` =
    the largest rank-local token count (float32)."""
    heads, lora, rope = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    kv = PCP * local * (lora + rope) * 4
    if layout == "replicated":
        return kv
    queries = PCP * local * heads * (nope + rope) * 4 if prefill else 0
    return kv + queries + PCP * local * heads * (v + 1) * 4


def layout_run(folder: Path, layout: str, context: int, new_tokens: int, repeats: int) -> dict:
    from tandem import LLM, SamplingParams
    from tandem.bench.prompts import random_token_ids

    config = json.loads((folder / "config.json").read_text())
    per_token = config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4
    llm = LLM(str(folder), dtype="float32", prefill_context_parallel_size=PCP, pcp_kv_layout=layout,
              max_num_batched_tokens=CHUNK, max_model_len=context + max(new_tokens + 2, 64), max_num_seqs=1,
              kv_cache_memory_bytes=int(3.2 * (context + new_tokens + 64) * per_token) + (64 << 20))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    try:
        llm.generate([{"prompt_token_ids": random_token_ids(config["vocab_size"], 64, 1)}], one, use_tqdm=False)
        prompt = random_token_ids(config["vocab_size"], context, 7)
        before = _gathered(llm)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        ttft = time.perf_counter() - start
        prefill_bytes = (_gathered(llm) - before) / -(-context // CHUNK)
        walls: dict[int, float] = {}
        decode_bytes = 0.0
        for r in range(repeats):
            prompts = [random_token_ids(config["vocab_size"], context, 1000 + r)]
            plant_prefix(llm.engine, prompts, "contiguous")
            for n in (1, 1 + new_tokens):
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                before = _gathered(llm)
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                walls[n] = min(walls.get(n, float("inf")), time.perf_counter() - start)
                if n == 1:
                    first = _gathered(llm) - before
                else:
                    decode_bytes = (_gathered(llm) - before - first) / new_tokens
    finally:
        llm.shutdown()
    layers = config["num_hidden_layers"]
    local = -(-CHUNK // PCP)
    return {"context": context, "layout": layout, "ttft_s": ttft,
            "tpot_ms": (walls[1 + new_tokens] - walls[1]) / new_tokens * 1e3,
            "prefill_bytes_per_step": prefill_bytes, "decode_bytes_per_step": decode_bytes,
            "formula_prefill_per_layer": formula_bytes(config, layout, local, True),
            "formula_decode_per_layer": formula_bytes(config, layout, 1, False), "layers": layers,
            # beside the layers: the sampled row's hidden state restored for the logits (P rows of hidden_size)
            "logits_restore_bytes": PCP * config["hidden_size"] * 4}


def capacity_rows(per_rank_tokens: int, kv_cache_dtypes: tuple[str, ...] = ("auto",)) -> list[dict]:
    """The bundled model, a per-rank KV budget of `per_rank_tokens` float32 tokens' bytes: the longest prompt each
    kv_cache_dtype, P and layout runs. The budget is handed to the engine in bytes (kv_cache_memory_bytes), so a
    narrower dtype holds more tokens in it."""
    from tandem import LLM, SamplingParams
    from tandem.assets import DEFAULT_MODEL
    from tandem.bench.prompts import random_token_ids
    from tandem.config import ConfigError

    block_size = 16
    engine = {"dtype": "float32", "block_size": block_size, "max_num_batched_tokens": 2048}
    rows = []
    for kv in kv_cache_dtypes:
        # the same bytes as per_rank_tokens float32 tokens: probed on one rank (each PCP rank's pool is the same)
        probe = LLM(str(DEFAULT_MODEL), **engine, max_model_len=block_size, kv_cache_dtype="auto",
                    kv_cache_memory_bytes=1 << 30)
        kv_bytes = (1 << 30) // probe.engine.executor.num_kv_blocks * per_rank_tokens // block_size
        probe.shutdown()
        sized = LLM(str(DEFAULT_MODEL), **engine, max_model_len=block_size, kv_cache_dtype=kv,
                    kv_cache_memory_bytes=kv_bytes)
        pool = sized.engine.executor.num_kv_blocks * block_size  # tokens one rank's budget holds in this dtype
        sized.shutdown()
        for pcp in (1, 2, 4):
            for layout in ("replicated", "sharded") if pcp > 1 else ("replicated",):
                budget = pool * (pcp if layout == "sharded" else 1)
                row = {"kv_cache_dtype": kv, "kv_bytes": kv_bytes, "pcp": pcp, "layout": layout,
                       "per_rank_tokens": pool}
                if budget > 4096:  # the bundled model's max_position_embeddings
                    continue
                try:  # the longest context the pool could hold; replicated past one rank's pool is refused
                    llm = LLM(str(DEFAULT_MODEL), **engine, prefill_context_parallel_size=pcp, pcp_kv_layout=layout,
                              max_model_len=budget, kv_cache_dtype=kv, kv_cache_memory_bytes=kv_bytes)
                except ConfigError as e:
                    rows.append({**row, "max_prompt": None, "note": str(e)[:80]})
                    continue
                try:
                    prompt = random_token_ids(1000, budget - 4, pcp)
                    start = time.perf_counter()
                    out = llm.generate([{"prompt_token_ids": prompt}],
                                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
                    ok = len(out.outputs[0].token_ids) == 4
                    rows.append({**row, "max_prompt": len(prompt) if ok else None,
                                 "wall_s": time.perf_counter() - start,
                                 "note": "ran" if ok else out.outputs[0].finish_reason})
                finally:
                    llm.shutdown()
                try:  # one token past what the pools hold is refused at configuration
                    LLM(str(DEFAULT_MODEL), **engine, prefill_context_parallel_size=pcp, pcp_kv_layout=layout,
                        max_model_len=budget + 1, kv_cache_dtype=kv, kv_cache_memory_bytes=kv_bytes).shutdown()
                    rows[-1]["note"] += "; max_model_len + 1 accepted (!)"
                except ConfigError:
                    rows[-1]["note"] += "; max_model_len + 1 refused"
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--layouts", nargs="+", default=["replicated", "sharded"])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--capacity", action="store_true", help="the capacity table instead")
    p.add_argument("--per-rank-tokens", type=int, default=1024, help="--capacity: each rank's KV budget, in the bytes "
                   "of this many float32 tokens")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], help="--capacity: one table row group each")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    from tandem.bench.machine import machine_info

    info = machine_info()
    print(f"{info['cpu']}, {info['num_cores']} cores, torch {info['torch']}", flush=True)
    torch.set_num_threads(PCP)  # the multi-rank executor hands each rank threads // world: 1 each
    if a.capacity:
        rows = capacity_rows(a.per_rank_tokens, tuple(a.kv_cache_dtypes))
        print("\n| kv_cache_dtype | per-rank KV bytes | P | layout | per-rank KV (tokens) | longest prompt that runs | "
              "note |\n|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['kv_cache_dtype']} | {r['kv_bytes']:,} | {r['pcp']} | {r['layout']} | "
                  f"{r['per_rank_tokens']} | {r['max_prompt'] or '-'} | {r['note']} |")
    else:
        folder = random_model_folder("dsv3", Path(".cache"))
        rows = []
        for context in a.contexts:
            for layout in a.layouts:
                rows.append(layout_run(folder, layout, context, a.new_tokens, a.repeats))
                r = rows[-1]
                print(f"  {context:>6} {layout:>10}: TTFT {r['ttft_s']:.2f} s, TPOT {r['tpot_ms']:.2f} ms", flush=True)
        print("\n| context | layout | TTFT s | TPOT ms | prefill bytes/step measured | formula (layers x per layer) "
              "| decode bytes/step measured | formula (+ logits row) |\n|---|---|---|---|---|---|---|---|")
        for r in rows:
            n = r["layers"]
            print(f"| {r['context']} | {r['layout']} | {r['ttft_s']:.2f} | {r['tpot_ms']:.2f} | "
                  f"{r['prefill_bytes_per_step'] / 1e6:.2f} MB | {n * r['formula_prefill_per_layer'] / 1e6:.2f} MB | "
                  f"{r['decode_bytes_per_step'] / 1e3:.1f} kB | "
                  f"{(n * r['formula_decode_per_layer'] + r['logits_restore_bytes']) / 1e3:.1f} kB |")
    if a.json:
        a.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
