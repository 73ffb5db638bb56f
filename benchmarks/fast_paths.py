"""A/B of one fast path inside one process: the same engine, the same prompts, the path switched on and off in
alternating rounds (ABBA...), so the shared machine's drift hits both sides alike; prints median and best tok/s of
each side and whether the tokens are identical.

    python benchmarks/fast_paths.py --path cascade|dense-moe|bf16-small-mm|gqa-head-major|bf16-pack|native-kernels|
        native-elementwise|bf16-elementwise|add-norm|small-gemm|ngram-search|native-moe|expanded-prefix
        [--model PATH] [--dtype float32] [--spec JSON] [--batch 32] [--reps 4] [--max-tokens 96] [--fresh]
        [--zero-shot] [--threads 1]

`cascade`: attention over a prefix every short row shares, once for all rows (metadata.CASCADE_MIN_KEYS).
`dense-moe`: every local expert over every token when experts are few (FusedMoE._dense_pays).
`bf16-small-mm`: a batch-of-one attention matmul in bf16/fp16 as one 2-D mm (prefix.small_matmul).
`gqa-head-major`: bf16/fp16 few-query GQA attention as matmuls over a head-major K/V copy (prefix.HEAD_MAJOR_DTYPES)
instead of CPU SDPA. `bf16-pack`: bf16 weights packed from cpu_gemm.BF16_PACK_MIN_ELEMENTS on, one row included,
where the CPU has bf16 dot products; off is float32's rule (PACK_MIN_ELEMENTS, F.linear for one row).
`native-kernels`: every native CPU kernel (tandem/native, float32 models): short rows' paged attention, RMSNorm,
silu(gate) * up, rotary; off is the PyTorch paths (padded gathers + SDPA, in-place views; the ops' formulas).
`native-elementwise`: only the elementwise kernels (RMSNorm, silu(gate) * up, rotary), attention native both ways.
`bf16-elementwise`: the elementwise kernels on bfloat16 activations too (native.ELEMENTWISE_DTYPES); off is float32
only (a bf16 model's norms, SwiGLU and rotary through the PyTorch formulas).
`add-norm`: a decoder layer's residual add and the norm after it as one native pass (RMSNorm.add_residual); off is
the add, then the norm.
`small-gemm`: linears of up to cpu_gemm.SMALL_ROWS rows (4 on packed weights) through the native small-row GEMM;
off is F.linear / the packed oneDNN weight.
`ngram-search`: n-gram lookup by str.rfind over the proposer's kept text of each history (spec_decode/ngram.py); off
is the Python scan it replaced (use with
--spec '{"method": "ngram", ...}').
`native-moe`: a MoE layer's routed experts through the native kernel (the chosen pairs only); off is the PyTorch
paths (dense, gathered or looped, FusedMoE._experts).
`expanded-prefix`: MLA cascade attention over the shared prefix in its kept expanded form
(tandem/attention/expanded_prefix.py); off attends it absorbed every step.
`--zero-shot`: the bare GSM8K questions of `tandem bench offline` instead (no shared prefix, so no cascade).
Prompts: 5-shot GSM8K test questions (benchmarks/spec_decode.py's), so the rows share the cached 5-shot prefix;
greedy, `ignore_eos`, one torch thread. By default every round reruns the same prompts (after the warm-up the whole
prompts are cached, so the rounds time decoding); `--fresh` gives every run new questions behind the same cached
5-shot prefix, so each run also prefills its questions (TTFT-heavy with few tokens), and checks identical tokens on
one extra batch run both ways.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams, native
from tandem.assets import DEFAULT_MODEL
from tandem.attention import expanded_prefix, metadata
from tandem.attention.backends import prefix
from tandem.bench.prompts import bench_prompts
from tandem.layers import cpu_gemm, moe
from tandem.layers.norm import RMSNorm
from tandem.spec_decode import ngram

sys.path.insert(0, str(Path(__file__).parent))
from spec_decode import prompts  # noqa: E402


def switch(path: str, on: bool, saved: dict[str, Any]) -> None:
    if path == "cascade":
        metadata.CASCADE_MIN_KEYS = saved["cascade"] if on else 10**9
    elif path == "dense-moe":
        moe.FusedMoE._dense_pays = saved["dense"] if on else (lambda self, t, k: False)  # type: ignore[method-assign]
    elif path == "bf16-small-mm":  # off: torch.matmul for every attention matmul
        prefix.small_matmul = saved["small_mm"] if on else torch.matmul
    elif path == "gqa-head-major":
        prefix.HEAD_MAJOR_DTYPES = saved["head_major"] if on else ()
    elif path == "native-kernels":
        native.set_enabled(on)
    elif path == "native-elementwise":  # the layers ask native.serves before each elementwise kernel
        native.serves = saved["serves"] if on else (lambda *args, **kwargs: False)  # type: ignore[assignment]
    elif path == "bf16-elementwise":
        native.ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16) if on else (torch.float32,)
    elif path == "add-norm":  # off: the two ops RMSNorm.add_residual fuses
        RMSNorm.add_residual = saved["add_norm"] if on else (  # type: ignore[method-assign]
            lambda self, x, residual: (self(residual + x), residual + x))
    elif path == "ngram-search":
        ngram.propose_ngram = saved["ngram"] if on else (  # type: ignore[assignment]
            lambda tokens, k, min_n, max_n, text=None: ngram._scan(tokens, k, min_n, max_n))
    elif path == "native-moe":
        moe.NATIVE_EXPERTS = on
    elif path == "expanded-prefix":
        expanded_prefix.MAX_BYTES = saved["expanded"] if on else 0
    elif path == "small-gemm":
        cpu_gemm.SMALL_ROWS, cpu_gemm.SMALL_ROWS_PACKED = saved["small_rows"] if on else (0, 0)
    else:  # bf16-pack: off unpacks what float32's rule would not have packed
        cpu_gemm._CPU_HAS_BF16_DOT = saved["bf16_dot"] if on else False
        for module, packed in saved["packed"]:
            module.packed_weight = packed if on or module.weight.numel() >= cpu_gemm.PACK_MIN_ELEMENTS else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True,
                   choices=["cascade", "dense-moe", "bf16-small-mm", "gqa-head-major", "bf16-pack", "native-kernels",
                            "native-elementwise", "bf16-elementwise", "add-norm", "small-gemm", "ngram-search",
                            "native-moe", "expanded-prefix"])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--spec", default=None, help="speculative_config as JSON")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--fresh", action="store_true", help="new questions every run (each run prefills them)")
    p.add_argument("--zero-shot", action="store_true", help="bare questions (tandem bench offline's prompts)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, speculative_config=json.loads(args.spec) if args.spec else None)
    torch.set_num_threads(args.threads)
    model = llm.engine.executor.runner.model
    saved = {"cascade": metadata.CASCADE_MIN_KEYS, "dense": moe.FusedMoE._dense_pays,
             "head_major": prefix.HEAD_MAJOR_DTYPES, "serves": native.serves,
             "small_rows": (cpu_gemm.SMALL_ROWS, cpu_gemm.SMALL_ROWS_PACKED), "ngram": ngram.propose_ngram,
             "bf16_dot": cpu_gemm._CPU_HAS_BF16_DOT, "expanded": expanded_prefix.MAX_BYTES,
             "small_mm": prefix.small_matmul, "add_norm": RMSNorm.add_residual,
             "packed": [(m, m.packed_weight) for m in model.modules() if hasattr(m, "packed_weight")]}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = 2 * args.reps + 2 if args.fresh else 1
    pool = bench_prompts(args.batch * runs) if args.zero_shot else prompts(args.batch * runs)
    batches = iter([pool[i * args.batch:(i + 1) * args.batch] for i in range(runs)])
    batch = next(batches)
    llm.generate(batch, params, use_tqdm=False)  # warm-up; caches the shared prefix
    speeds: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {}
    for r in range(args.reps):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            switch(args.path, on, saved)
            batch = next(batches) if args.fresh else batch
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens[on] = [o.outputs[0].token_ids for o in outs]
            speeds[on].append(sum(len(t) for t in tokens[on]) / wall)
    if args.fresh:  # one new batch both ways (the second run finds the whole prompts cached: same tokens due)
        batch = next(batches)
        for on in (True, False):
            switch(args.path, on, saved)
            tokens[on] = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    switch(args.path, True, saved)
    for on in (True, False):
        v = speeds[on]
        print(f"{args.path} {'on ' if on else 'off'} {args.dtype} spec={args.spec or 'none'} batch={args.batch}: "
              f"median {statistics.median(v):.1f} tok/s, best {max(v):.1f} (rounds {[round(x, 1) for x in v]})")
    print(f"on / off (medians): {statistics.median(speeds[True]) / statistics.median(speeds[False]):.2f}x; "
          f"identical tokens: {tokens[True] == tokens[False]}")
    llm.shutdown()


if __name__ == "__main__":
    main()
