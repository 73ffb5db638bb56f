"""The CUDA checks, in one script that fits in 8 minutes on one GPU; prints one markdown table.

    PYTHONPATH=. python benchmarks/gpu_check.py [--device cuda] [--quick] [--budget SECONDS]

Each row is printed as soon as it is measured; a row that raises is reported as ERROR (traceback on stderr) and the
checks go on; rows past `--budget` seconds are reported as skipped. `--device cpu` is a dry run of the script.

1. HF parity on CUDA: tiny random checkpoints of every architecture (built here, as the tests build them), greedy
   tokens of tandem vs Hugging Face `generate`, in float32 and bfloat16.
2. eager vs compiled (compilation_config mode VLLM_COMPILE, PIECEWISE padding: on CUDA the compiled pieces between
   the attention / MoE-expert / collective ops replay as CUDA graphs): identical greedy tokens, with inductor's
   counts of graph partitions and skipped captures.
3. Speculative greedy (MTP, n-gram, DSpark; K = 3 and "auto") identical to no-spec greedy on the bundled model.
4. Throughput on the bundled model at batch 1 and 32, no-spec vs MTP K=3, eager and compiled.
Needs torch with CUDA and transformers; tandem from this checkout (PYTHONPATH=.), nothing downloaded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from checkpoints import ARCHS, build_tiny_checkpoint  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.assets import DEFAULT_DSPARK, DEFAULT_MODEL  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 22, 7, 31], [11, 4, 8, 19], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7, 7, 7]]
SECTIONS = ("parity", "compiled", "drafters", "throughput")
COMPILED = {"mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}


def tandem_tokens(path: str, device: str, dtype: str, max_tokens: int, **kwargs: object) -> list[list[int]]:
    llm = LLM(path, device=device, dtype=dtype, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def hf_tokens(path: str, device: str, dtype: torch.dtype, max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, do_sample=False, max_new_tokens=max_tokens, attention_mask=torch.ones_like(ids))
            out.append(gen[0, len(p):].tolist())
    return out


def bundled_tokens(device: str, spec: dict | None, batch: int = 8) -> list[list[int]]:
    """Greedy tokens of the bundled model for `batch` repetitive prompts (n-gram drafts find matches in them)."""
    llm = LLM(str(DEFAULT_MODEL), device=device, dtype="float32", speculative_config=spec)
    try:
        prompts = [{"prompt_token_ids": p * 4} for p in (PROMPTS * 8)[:batch]]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def drafter_specs() -> list[tuple[str, dict]]:
    specs = []
    for method in ("mtp", "ngram", "dspark"):
        for k in (3, "auto"):
            spec: dict = {"method": method, "num_speculative_tokens": k}
            spec |= {"max_num_speculative_tokens": 3} if k == "auto" else {}
            spec |= {"model": str(DEFAULT_DSPARK)} if method == "dspark" else {}
            spec |= {"prompt_lookup_max": 3} if method == "ngram" else {}
            specs.append((f"{method} K={k}", spec))
    return specs


def graph_counters() -> dict[str, int]:
    """Inductor's CUDA-graph counters: graph partitions made, captures skipped (each skip is also logged, why)."""
    from torch._dynamo.utils import counters

    return {k: counters["inductor"][f"cudagraph_{k}"] for k in ("partitions", "skips")}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Table:
    """Rows printed as they are made; a check that raises or starts past the budget becomes a row saying so."""

    def __init__(self, budget_s: float):
        self.rows: list[str] = []
        self.failures = 0
        self.deadline = time.perf_counter() + budget_s

    def add(self, row: str) -> None:
        self.rows.append(row)
        print(row, flush=True)

    def check(self, label: str, fn: Callable[[], tuple[str, bool]]) -> None:
        """`fn` returns (the row's cells after the label, passed)."""
        if time.perf_counter() > self.deadline:
            self.add(f"| {label} | skipped: past the time budget | |")
            return
        start = time.perf_counter()
        try:
            cells, passed = fn()
        except Exception as e:  # noqa: BLE001 - the table reports every failure and goes on
            traceback.print_exc()
            cells, passed = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", False
        self.failures += not passed
        self.add(f"| {label} | {cells} | {time.perf_counter() - start:.0f} s |")


def throughput(device: str, batch: int, spec: dict | None, compilation: dict | None) -> float:
    llm = LLM(str(DEFAULT_MODEL), device=device, dtype="float32", speculative_config=spec,
              compilation_config=compilation)
    try:
        prompts = [{"prompt_token_ids": p * 4} for p in (PROMPTS * 8)[:batch]]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        sync(device)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync(device)
        return 64 * batch / (time.perf_counter() - start)
    finally:
        llm.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="two architectures and batch 1 only")
    p.add_argument("--budget", type=float, default=420.0, help="seconds after which remaining checks are skipped")
    p.add_argument("--archs", nargs="+", choices=ARCHS, help="tiny architectures to check (default: all)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="throughput batch sizes")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="which checks to run")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing checked", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU (dry run)"
    table = Table(args.budget)
    table.add(f"| check ({name}, torch {torch.__version__}) | result | time |")
    table.add("|---|---|---|")
    archs = args.archs or (ARCHS[:2] if args.quick else ARCHS)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {arch: str(build_tiny_checkpoint(arch, Path(tmp) / arch)) for arch in archs}
        dtypes = (("float32", torch.float32), ("bfloat16", torch.bfloat16))
        for dtype, torch_dtype in dtypes * ("parity" in args.sections):
            for arch in archs:
                def parity(arch: str = arch, dtype: str = dtype, torch_dtype: torch.dtype = torch_dtype
                           ) -> tuple[str, bool]:
                    ours = tandem_tokens(paths[arch], args.device, dtype, 12)
                    ref = hf_tokens(paths[arch], args.device, torch_dtype, 12)
                    same = sum(a == b for a, b in zip(ours, ref, strict=True))
                    # bfloat16 rounding may legitimately flip a near-tie argmax; float32 must match exactly
                    return f"{same}/{len(PROMPTS)} greedy outputs identical", dtype != "float32" or same == len(PROMPTS)
                table.check(f"HF parity {arch} {dtype}", parity)
        for arch in archs * ("compiled" in args.sections):
            def compiled_vs_eager(arch: str = arch) -> tuple[str, bool]:
                before = graph_counters()
                compiled = tandem_tokens(paths[arch], args.device, "float32", 12, compilation_config=COMPILED)
                after = graph_counters()
                eager = tandem_tokens(paths[arch], args.device, "float32", 12)
                graphs = ", ".join(f"{k} {after[k] - before[k]}" for k in after)
                return ("identical" if compiled == eager else "DIFFERENT") + f" ({graphs})", compiled == eager
            table.check(f"eager vs compiled {arch}", compiled_vs_eager)
    if "drafters" in args.sections:
        reference: list[list[int]] = []
        table.check("bundled no-spec greedy, batch 8", lambda: (reference.extend(bundled_tokens(args.device, None))
                                                                 or "reference tokens", True))
        for label, spec in drafter_specs():
            def lossless(spec: dict = spec) -> tuple[str, bool]:
                same = bundled_tokens(args.device, spec) == reference
                return ("identical to no-spec" if same else "DIFFERENT from no-spec"), same
            table.check(f"bundled {label} greedy, batch 8", lossless)
    table.add("")
    table.add("| bundled model, 64 tokens | eager tok/s | compiled tok/s | compiled / eager | time |")
    table.add("|---|---|---|---|---|")
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    for batch in ([1] if args.quick else args.batches) * ("throughput" in args.sections):
        for label, spec in (("no-spec", None), ("MTP K=3", mtp)):
            def speeds(batch: int = batch, spec: dict | None = spec) -> tuple[str, bool]:
                eager = throughput(args.device, batch, spec, None)
                before = graph_counters()
                compiled = throughput(args.device, batch, spec, COMPILED)
                after = graph_counters()
                graphs = ", ".join(f"{k} {after[k] - before[k]}" for k in after)
                return f"{eager:.1f} | {compiled:.1f} ({graphs}) | {compiled / eager:.2f}x", True
            table.check(f"batch {batch} {label}", speeds)
    print("\n".join(["", "# table", *table.rows]), flush=True)
    return 1 if table.failures else 0


if __name__ == "__main__":
    sys.exit(main())
