"""Long-prompt prefill at real layer dimensions: TTFT of one prompt at 2k..32k tokens, PCP 1 / 2 (/ 4), beside
Hugging Face where it fits in memory, with peak RSS per rank and the achieved FLOP/s against a measured GEMM rate.

    .venv/bin/python benchmarks/long_prefill.py --model dsv3 --lengths 2048 8192 16384 --pcp 1 2
    .venv/bin/python benchmarks/long_prefill.py --model smollm2 --lengths 2048 8192 --pcp 1 2 --plot docs/plots/x.png

Models: `dsv3` is a random DeepSeek-V3-shaped checkpoint built here (2 dense layers, hidden 1024, 16 heads,
kv_lora_rank 512, q_lora_rank 768, nope 128, rope 64, v 128, intermediate 2816), `smollm2` SmolLM2-135M (make
setup converts it) with max_position_embeddings raised to fit. Every (model, PCP, length) runs in a fresh process
with 1 torch thread per rank, prefix caching off, 2,048-token chunks (`--chunk`), after a short warm-up prompt;
TTFT = wall time of generate(max_tokens=1). HF runs one forward of the prompt in its own process (skipped when
its [heads, S, S] float32 scores would not fit in 70% of the available memory). Peak RSS = VmHWM of each rank.

FLOPs counted are the necessary work: 2 x (linear weights a token passes through) per prompt token (kv_b_proj
once per token) + causal attention 2 x heads x S (S + 1) / 2 x (qk_head_dim + v_head_dim) per layer. Achieved
rate = FLOPs / (TTFT x ranks); GEMM rate = best single-thread float32 [2048 x 2048] @ [2048 x 2048].
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"
SMOLLM2 = CACHE / "smollm2-135m-instruct"
DSV3_SHAPE = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
              "q_lora_rank": 768, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
              "num_hidden_layers": 2, "first_k_dense_replace": 2, "intermediate_size": 2816}


def model_folder(name: str, max_len: int) -> Path:
    """The benchmark's checkpoint, built (dsv3) or re-configured (smollm2) once under .cache/."""
    folder = CACHE / f"long-prefill-{name}-{max_len}"
    if (folder / "config.json").is_file():
        return folder
    positions = max_len + 64
    if name == "dsv3":
        sys.path.insert(0, str(REPO / "tests"))
        from checkpoints import build_tiny_checkpoint  # the tests' HF-built random checkpoints

        tmp = folder.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny_checkpoint("deepseek_v3", tmp, overrides={**DSV3_SHAPE, "max_position_embeddings": positions})
        tmp.rename(folder)
        return folder
    if not (SMOLLM2 / "config.json").is_file():
        raise SystemExit(f"{SMOLLM2}: not converted (make .cache/smollm2-135m-instruct/config.json)")
    folder.mkdir(parents=True)
    for f in SMOLLM2.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f.resolve())
    config = json.loads((SMOLLM2 / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return folder


def necessary_flops(config: dict, s: int) -> float:
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    if "kv_lora_rank" in config:
        nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        lora, q_lora = config["kv_lora_rank"], config.get("q_lora_rank")
        q = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        attn_w = q + h * (lora + rope) + lora * heads * (nope + v) + heads * v * h
        qk, vd = nope + rope, v
    else:
        d = config.get("head_dim") or h // heads
        kv = config.get("num_key_value_heads") or heads
        attn_w = 2 * h * heads * d + 2 * h * kv * d
        qk = vd = d
    mlp_w = 3 * h * config["intermediate_size"]
    return 2.0 * s * layers * (attn_w + mlp_w) + layers * 2.0 * heads * s * (s + 1) / 2 * (qk + vd)


def gemm_rate() -> float:
    torch.set_num_threads(1)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = float("inf")
    for _ in range(4):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 2048**3 / best


def _vmhwm_mib(pid: int | str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _children() -> list[int]:
    pids: list[int] = []
    for f in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        pids += [int(p) for p in f.read_text().split()]
    return pids


def run_tandem(folder: str, length: int, pcp: int, chunk: int) -> dict:
    """Child process: one TTFT of one prompt."""
    from tandem import LLM, SamplingParams
    from tandem.bench.prompts import random_token_ids

    torch.set_num_threads(pcp)  # the multi-rank executor hands each rank threads // world
    config = json.loads((Path(folder) / "config.json").read_text())
    llm = LLM(folder, dtype="float32", prefill_context_parallel_size=pcp, max_num_batched_tokens=chunk,
              max_model_len=length + 8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    try:
        llm.generate([{"prompt_token_ids": random_token_ids(config["vocab_size"], 64, 1)}], params, use_tqdm=False)
        ids = random_token_ids(config["vocab_size"], length, 0)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        wall = time.perf_counter() - start
        ranks = sorted(_children(), key=_vmhwm_mib, reverse=True)[:pcp] if pcp > 1 else [os.getpid()]
        rss = [_vmhwm_mib(p) for p in ranks]
    finally:
        llm.shutdown()
    return {"wall_s": wall, "peak_rss_mib": rss, "first_token": out[0].outputs[0].token_ids[0]}


def run_hf(folder: str, length: int) -> dict:
    from transformers import AutoModelForCausalLM

    from tandem.bench.prompts import random_token_ids

    torch.set_num_threads(1)
    config = json.loads((Path(folder) / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([random_token_ids(config["vocab_size"], length, 0)])
    with torch.inference_mode():
        model(ids[:, :64])
        start = time.perf_counter()
        logits = model(ids).logits[0, -1]
        wall = time.perf_counter() - start
    return {"wall_s": wall, "peak_rss_mib": [_vmhwm_mib("self")], "first_token": int(logits.argmax())}


def hf_fits(config: dict, length: int) -> bool:
    avail = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemAvailable:"))
    return 3 * config["num_attention_heads"] * length * length * 4 < 0.7 * avail


def child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], info: dict, model: str, folder_name: str, path: Path) -> Path:
    from tandem.bench.plot import Panel, lines_by, machine_caption, plot_lines

    ok = [r for r in rows if "wall_s" in r]

    def label(r: dict) -> str:
        return "HF" if r["system"] == "hf" else f"tandem PCP={r['pcp']}"

    panels = [Panel("TTFT (s)", lines_by(ok, "length", "wall_s", label), log_y=True),
              Panel("share of the fp32 GEMM rate", lines_by(ok, "length", "gemm_fraction", label), y_min=0)]
    return plot_lines(path, panels, title=f"long-prompt prefill, {model}, 1 thread per rank",
                      x_label="prompt tokens", subtitle=machine_caption(info, folder_name), log2_x=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["dsv3", "smollm2"], default="dsv3")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--pcp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, metavar="FILE.png")
    p.add_argument("--replot", type=Path, metavar="FILE.json", help="draw --plot from an earlier --json and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.replot:
        saved = json.loads(a.replot.read_text())
        if a.plot is None:
            p.error("--replot needs --plot FILE.png")
        print("plot:", plot(saved["rows"], saved["machine"], saved.get("model", a.model), saved.get("folder", ""),
                            a.plot))
        return
    if a.child:
        kind, folder, length, *rest = json.loads(a.child)
        res = run_hf(folder, length) if kind == "hf" else run_tandem(folder, length, rest[0], rest[1])
        print(json.dumps(res))
        return
    from tandem.bench.machine import machine_info

    info = machine_info()
    folder = model_folder(a.model, max(a.lengths))
    config = json.loads((folder / "config.json").read_text())
    peak = gemm_rate()
    print(f"{info['cpu']}, {info['num_cores']} cores, torch {info['torch']}; model {a.model} ({folder.name}); "
          f"fp32 GEMM 1 thread {peak / 1e9:.1f} GFLOP/s; chunk {a.chunk}", flush=True)
    rows: list[dict] = []
    for length in sorted(a.lengths):
        flops = necessary_flops(config, length)
        base: dict | None = None
        configs = [("tandem", pcp) for pcp in sorted(a.pcp)]
        if not a.no_hf:
            configs.append(("hf", 1))
        for kind, pcp in configs:
            if kind == "hf" and not hf_fits(config, length):
                rows.append({"system": "hf", "pcp": 1, "length": length, "error": "does not fit in memory"})
                print(f"  {length:>6} HF: skipped (scores would not fit in memory)", flush=True)
                continue
            res = child(["hf", str(folder), length] if kind == "hf" else ["tandem", str(folder), length, pcp, a.chunk])
            row = {"system": kind, "pcp": pcp, "length": length, "tflop": flops / 1e12, **res}
            if "wall_s" in res:
                row["gemm_fraction"] = flops / (res["wall_s"] * pcp) / peak
                if kind == "tandem" and pcp == 1:
                    base = row
                if base is not None:
                    row["speedup_vs_pcp1"] = base["wall_s"] / res["wall_s"]
                    row["efficiency"] = row["speedup_vs_pcp1"] / pcp
                    row["same_first_token"] = res["first_token"] == base["first_token"]
            rows.append(row)
            print(f"  {length:>6} {kind:>6} PCP={pcp}: " + (
                f"{res['wall_s']:.2f} s, {row['gemm_fraction']:.0%} of GEMM rate, peak RSS "
                + "/".join(f"{r:.0f}" for r in res["peak_rss_mib"]) + " MiB"
                + (f", efficiency {row['efficiency']:.2f}" if "efficiency" in row and pcp > 1 else "")
                + (f", first token {'=' if row.get('same_first_token') else '!='} PCP=1" if base else "")
                if "wall_s" in res else res["error"]), flush=True)
    print(f"\n| prompt | system | PCP | TTFT s | of {peak / 1e9:.0f} GFLOP/s GEMM | speedup | efficiency | "
          "peak RSS/rank MiB | vs HF |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "wall_s" not in r:
            print(f"| {r['length']} | {r['system']} | {r['pcp']} | {r['error']} | | | | | |")
            continue
        hf = next((h for h in rows if h["system"] == "hf" and h["length"] == r["length"] and "wall_s" in h), None)
        vs_hf = f"{hf['wall_s'] / r['wall_s']:.2f}x" if hf and r["system"] == "tandem" else ""
        print(f"| {r['length']} | {r['system']} | {r['pcp']} | {r['wall_s']:.2f} | {r['gemm_fraction']:.0%} | "
              f"{r.get('speedup_vs_pcp1', 0):.2f} | {r.get('efficiency', 0):.2f} | "
              f"{max(r['peak_rss_mib']):.0f} | {vs_hf} |")
    if a.json:
        a.json.write_text(json.dumps({"machine": info, "model": a.model, "folder": folder.name, "gemm_flops": peak,
                                      "rows": rows}, indent=2) + "\n")
    if a.plot:
        print("plot:", plot(rows, info, a.model, folder.name, a.plot))

if __name__ == "__main__":
    main()
