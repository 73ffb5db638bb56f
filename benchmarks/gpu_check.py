"""The CUDA checks, in one script that fits in 8 minutes on one GPU; prints one markdown table.

    PYTHONPATH=. python benchmarks/gpu_check.py [--device cuda] [--quick]

1. HF parity on CUDA: tiny random checkpoints of every architecture (built here, as the tests build them), greedy
   tokens of tandem vs Hugging Face `generate`, in float32 and bfloat16.
2. eager vs compiled (compilation_config mode VLLM_COMPILE, PIECEWISE padding): identical greedy tokens.
3. Throughput on the bundled model at batch 1 and 32, no-spec vs MTP K=3, eager and compiled.
Needs torch with CUDA and transformers; tandem from this checkout (PYTHONPATH=.), nothing downloaded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from checkpoints import ARCHS, build_tiny_checkpoint  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.assets import DEFAULT_MODEL  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 22, 7, 31], [11, 4, 8, 19], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7, 7, 7]]
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


def throughput(device: str, batch: int, spec: dict | None, compilation: dict | None) -> float:
    llm = LLM(str(DEFAULT_MODEL), device=device, dtype="float32", speculative_config=spec,
              compilation_config=compilation)
    try:
        prompts = [{"prompt_token_ids": p * 4} for p in (PROMPTS * 8)[:batch]]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        return 64 * batch / (time.perf_counter() - start)
    finally:
        llm.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="two architectures and batch 1 only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked", file=sys.stderr)
        return 2
    rows = [f"| GPU | {torch.cuda.get_device_name()} | torch {torch.__version__} | |", "|---|---|---|---|"]
    failures = 0
    archs = ARCHS[:2] if args.quick else ARCHS
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            path = str(build_tiny_checkpoint(arch, Path(tmp) / arch))
            for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                ours, ref = tandem_tokens(path, args.device, dtype, 12), hf_tokens(path, args.device, torch_dtype, 12)
                same = sum(a == b for a, b in zip(ours, ref, strict=True))
                failures += dtype == "float32" and same != len(PROMPTS)
                rows.append(f"| HF parity {arch} {dtype} | {same}/{len(PROMPTS)} greedy outputs identical | | |")
            compiled = tandem_tokens(path, args.device, "float32", 12, compilation_config=COMPILED)
            eager = tandem_tokens(path, args.device, "float32", 12)
            failures += compiled != eager
            rows.append(f"| eager vs compiled {arch} | {'identical' if compiled == eager else 'DIFFERENT'} | | |")
    rows += ["", "| bundled model, 64 tokens | eager tok/s | compiled tok/s | compiled / eager |", "|---|---|---|---|"]
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    for batch in (1,) if args.quick else (1, 32):
        for name, spec in (("no-spec", None), ("MTP K=3", mtp)):
            eager = throughput(args.device, batch, spec, None)
            compiled = throughput(args.device, batch, spec, COMPILED)
            rows.append(f"| batch {batch} {name} | {eager:.1f} | {compiled:.1f} | {compiled / eager:.2f}x |")
    print("\n".join(rows))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
