"""A native kernel of this tree against the same kernel at another commit, in one process: both sources are built
side by side under their own op namespaces and called in alternating order, so a machine whose speed drifts between
minutes slows both alike. The measurements behind docs/kernels.md's A/B tables.

    python benchmarks/native_ab.py {attention,experts,gemv,gemv-sweep,panel-sweep,amx-sweep} REV [--threads 2]
        [--rounds 6]
    python benchmarks/native_ab.py panel-sweep REV [--rows 1 4 8] [--threads 2] [--rounds 6]
    python benchmarks/native_ab.py sdpa [--rounds 6]

attention: tandem/native/paged_attention.cpp, one line per (dtype, rows x queries x keys) case over 30 layers' caches
(SmolLM2's GQA heads, and the bundled model's MLA: 4 heads over one 576-wide latent whose first 512 are the values);
experts: small_gemm.cpp's moe_experts at the bundled model's shapes (8 experts, top-2, hidden 256, 128 inner) over 30
layers' expert weights, at 1 and 32 tokens;
gemv: tandem/native/small_gemm.cpp's small_linear, one line per (dtype, rows, [N, K]) case over 30 distinct weights
(SmolLM2-135M's projections). Each line: microseconds per call (the median of the rounds, each over the 30 inputs in
turn, cold) before and after, their ratio, and whether the outputs are identical to the bit. gemv-sweep: the same kernel
over a whole decode's projections (SmolLM2-135M's qkv, o, gate_up and down of 30 layers in turn, twice that in bfloat16:
~425 MB either way, past this VM's 300 MiB L3, so the weights come from DRAM as a decode's do), one line per (dtype,
rows), in milliseconds a sweep. panel-sweep: tandem/native/panel_gemm.cpp's panel_linear (an x86 CPU with avx2) over the
same sweep, float32 and bfloat16, at a decode's, a verification's and a batch's rows. amx-sweep:
tandem/native/amx_gemm.cpp's amx_linear (a CPU with AMX-BF16) over the same bf16 sweep and, apart, SmolLM2-135M's LM
head, at the rows of a decode batch and its verification (32-128), one line per (weights, rows). sdpa: this tree's
attention against the engine's SDPA path on single bf16 prompt rows of 256-2,048 queries, alone or as a chunk behind a
longer prefix (the long rows a bf16 model on AMX sends the kernel), one line a row.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.cpp_extension import load

from tandem.native import ISA_FLAGS

NATIVE = Path(__file__).resolve().parent.parent / "tandem" / "native"
LAYERS, BLOCK = 30, 16
SOURCES = {"attention": "paged_attention.cpp", "experts": "small_gemm.cpp", "gemv": "small_gemm.cpp",
           "gemv-sweep": "small_gemm.cpp", "amx-sweep": "amx_gemm.cpp", "panel-sweep": "panel_gemm.cpp"}
# sources a kernel calls into (silu_mul; amx_ready), where the revision has them
HELPERS = {"attention": ("amx_gemm.cpp",), "experts": ("elementwise.cpp",), "gemv": ("elementwise.cpp",),
           "gemv-sweep": ("elementwise.cpp",),
           "amx-sweep": (), "panel-sweep": ()}
# (queries' dtype, cache's dtype, rows, queries a row, keys a row): SmolLM2's heads (9 query / 3 KV heads x 64)
CASES = [(torch.bfloat16, torch.bfloat16, 32, 1, 80), (torch.bfloat16, torch.bfloat16, 32, 1, 512),
         (torch.bfloat16, torch.bfloat16, 1, 1, 2048), (torch.bfloat16, torch.bfloat16, 32, 64, 64),
         (torch.bfloat16, torch.bfloat16, 4, 4, 200), (torch.bfloat16, torch.bfloat16, 1, 1024, 1024),
         (torch.bfloat16, torch.float8_e4m3fn, 32, 1, 80),
         (torch.float32, torch.float32, 32, 1, 80), (torch.float32, torch.float32, 32, 1, 512),
         (torch.float32, torch.float32, 32, 64, 64)]
# the same for MLA's latents (the bundled model's 4 heads): a batch-32 decode, a K = 3 verification
MLA_CASES = [(torch.float32, torch.float32, 32, 1, 130), (torch.float32, torch.float32, 4, 4, 200)]
EXPERT_TOKENS = (1, 32)
# (dtype, rows of x, N, K): SmolLM2-135M's qkv, o, gate_up and down projections at a decode's few rows
GEMV_CASES = [(dtype, rows, n, k) for dtype, rows in ((torch.bfloat16, 1), (torch.float32, 1), (torch.float32, 4))
              for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536))]
SWEEP_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # a SmolLM2-135M layer's projections, [N, K]
SWEEP_ROWS = (1, 2, 3, 4, 8)
PANEL_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32)  # a decode's, its verification's (batch 1-3, K = 1-3), a batch's
AMX_ROWS = (32, 48, 64, 96, 128)  # a batch-32 decode and its verification at K = 1..3
SDPA_ROWS = ((256, 256), (512, 512), (1024, 1024), (2048, 2048), (512, 4096), (2048, 8192))  # (queries, keys)


def native_file(rev: str | None, name: str) -> str:
    """tandem/native/NAME at commit `rev`, or in this tree (rev None)."""
    if rev is None:
        return (NATIVE / name).read_text()
    return subprocess.run(["git", "show", f"{rev}:tandem/native/{name}"], check=True, capture_output=True, text=True,
                          cwd=NATIVE).stdout


def build(name: str, source: str, folder: Path, rev: str | None, helpers: tuple[str, ...] = ()) -> Any:
    """The kernel's source at `rev` (None: this tree) as its own extension, registered under torch.ops.<name>, in a
    folder of its own beside that revision's headers and the `helpers` sources it calls into."""
    folder.mkdir()
    for header in NATIVE.glob("*.h"):
        try:
            (folder / header.name).write_text(native_file(rev, header.name))
        except subprocess.CalledProcessError:  # a header newer than rev: its source does not include it
            pass
    paths, texts = [], [(name, native_file(rev, source))]
    for helper in helpers:
        try:
            texts.append((f"{name}_{Path(helper).stem}", native_file(rev, helper)))
        except subprocess.CalledProcessError:  # not at rev: its kernel did not call it then
            pass
    for stem, text in texts:
        paths.append(folder / f"{stem}.cpp")
        paths[-1].write_text(text.replace("TORCH_LIBRARY(tandem_native", f"TORCH_LIBRARY_FRAGMENT({name}")
                             .replace("TORCH_LIBRARY_FRAGMENT(tandem_native", f"TORCH_LIBRARY_FRAGMENT({name}"))
    flags = ["-O3", "-fopenmp", *ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]
    load(name=name, sources=[str(p) for p in paths], extra_cflags=flags, extra_ldflags=["-lgomp"],
         is_python_module=False)
    return getattr(torch.ops, name)


def inputs(dtype: torch.dtype, kv_dtype: torch.dtype, rows: int, nq: int, keys: int, hq: int = 9, hkv: int = 3,
           d: int = 64, dv: int | None = None) -> tuple:
    """q [rows * nq, hq, d]; LAYERS caches [slots, hkv, d] behind one random block table; rows, positions, out, lse.
    dv (MLA): the values are a view of each cache's first dv channels."""
    blocks = (keys + BLOCK - 1) // BLOCK
    slots = (rows * blocks + 1) * BLOCK
    ks = [torch.randn(slots, hkv, d).to(kv_dtype) for _ in range(LAYERS)]
    vs = [k[..., :dv] for k in ks] if dv else [torch.randn(slots, hkv, d).to(kv_dtype) for _ in range(LAYERS)]
    table = (torch.randperm(rows * blocks) + 1).int().view(rows, blocks).contiguous()
    q = torch.randn(rows * nq, hq, d).to(dtype)
    row_table = torch.tensor([[i, i * nq, nq, keys, 0] for i in range(rows)], dtype=torch.int32)
    positions = torch.tensor([keys - nq + j for _ in range(rows) for j in range(nq)], dtype=torch.int64)
    out = torch.empty(rows * nq, hq, dv or d, dtype=dtype)
    return q, ks, vs, table, row_table, positions, out, torch.empty(rows * nq, hq)


def alternate(rounds: int, call: Callable[[str], torch.Tensor | tuple[torch.Tensor, ...]],
              ) -> tuple[float, float, bool]:
    """Median microseconds per call of `call(name)` (which runs LAYERS calls) before and after, rounds alternating
    their order, and whether the last outputs are identical."""
    times: dict[str, list[float]] = {"before": [], "after": []}
    results = {}
    for r in range(rounds):
        for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
            start = time.perf_counter()
            out = call(name)
            times[name].append((time.perf_counter() - start) / LAYERS * 1e6)
            results[name] = out if isinstance(out, tuple) else (out,)
    same = all(torch.equal(a, b) for a, b in zip(results["before"], results["after"], strict=True))
    return statistics.median(times["before"]), statistics.median(times["after"]), same


def attention_layers(ops: dict[str, Any], args: tuple, name: str) -> tuple[torch.Tensor, ...]:
    q, ks, vs, table, row_table, positions, out, lse = args
    for k, v in zip(ks, vs, strict=True):
        ops[name].paged_attention(q, k, v, table, row_table, positions, BLOCK, q.shape[-1] ** -0.5, out, lse)
    return out.clone(), lse.clone()


def attention(ops: dict[str, Any], rounds: int) -> None:
    cases = [(c, {}) for c in CASES] + [(c, {"hq": 4, "hkv": 1, "d": 576, "dv": 512}) for c in MLA_CASES]
    for (dtype, kv_dtype, rows, nq, keys), heads in cases:
        args = inputs(dtype, kv_dtype, rows, nq, keys, **heads)
        before, after, same = alternate(rounds, partial(attention_layers, ops, args))
        kv = str(kv_dtype).removeprefix("torch.")
        print(f"{'MLA, ' if heads else ''}{str(dtype).removeprefix('torch.')} q, {kv} cache, {rows} x {nq} x {keys}: "
              f"before {before:.1f} us, after {after:.1f} us, after / before {after / before:.2f}, identical {same}",
              flush=True)


def experts(ops: dict[str, Any], rounds: int) -> None:
    """The routed experts at the bundled model's shapes, LAYERS layers' weights in turn (cold, ~3 MB a layer)."""
    num_experts, hidden, inner, top_k = 8, 256, 128, 2
    w13 = [torch.randn(num_experts, 2 * inner, hidden) * 0.05 for _ in range(LAYERS)]
    w2 = [torch.randn(num_experts, hidden, inner) * 0.05 for _ in range(LAYERS)]
    for tokens in EXPERT_TOKENS:
        x = torch.randn(tokens, hidden)
        weights, ids = torch.randn(tokens, num_experts).softmax(-1).topk(top_k)

        def layers(name: str, x: torch.Tensor = x, ids: torch.Tensor = ids, weights: torch.Tensor = weights,
                   ) -> torch.Tensor:
            return torch.stack([ops[name].moe_experts(x, a, b, ids.contiguous(), weights.contiguous(), 0)
                                for a, b in zip(w13, w2, strict=True)])

        before, after, same = alternate(rounds, layers)
        print(f"experts, {tokens} tokens: before {before:.1f} us, after {after:.1f} us, after / before "
              f"{after / before:.2f}, identical {same}", flush=True)


def sdpa_row(n: int, keys: int, rounds: int) -> None:
    """One bf16 prompt row of n queries at the last n of `keys` positions (SmolLM2's heads): the engine's SDPA path
    for a long row (tandem/attention/causal_rows.py: flash SDPA on the causal diagonal, and on the prefix, merged;
    "before") against this tree's kernel ("after"; AMX tiles where the CPU has them), one layer's call."""
    import tandem.native as native
    from tandem.attention.causal_rows import causal_row_attention

    native.enabled()
    q, ks, vs, table, row_table, positions, out, lse = inputs(torch.bfloat16, torch.bfloat16, 1, n, keys)
    slots = (table[0].long()[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:keys]  # the row's keys in order
    qh, kh, vh = q.transpose(0, 1), ks[0][slots].transpose(0, 1), vs[0][slots].transpose(0, 1)

    def call(name: str) -> torch.Tensor:
        if name == "before":
            return causal_row_attention(qh, kh, vh, 0.125).transpose(0, 1)
        native.paged_attention(q, ks[0], vs[0], table, row_table, positions, BLOCK, 0.125, out, lse)
        return out.clone()

    times: dict[str, list[float]] = {"before": [], "after": []}
    outs = {}
    for r in range(rounds):
        for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
            start = time.perf_counter()
            outs[name] = call(name)
            times[name].append((time.perf_counter() - start) * 1e3)
    before, after = statistics.median(times["before"]), statistics.median(times["after"])
    diff = (outs["before"].float() - outs["after"].float()).abs().max().item()
    print(f"bfloat16, one row of {n} queries over {keys} keys: SDPA {before:.3f} ms, native {after:.3f} ms, "
          f"native / SDPA {after / before:.2f}, max |difference| {diff:.3f}", flush=True)


def gemv_layers(ops: dict[str, Any], x: torch.Tensor, weights: list[torch.Tensor], name: str) -> torch.Tensor:
    return torch.stack([ops[name].small_linear(x, w, None) for w in weights])


def gemv(ops: dict[str, Any], rounds: int) -> None:
    for dtype, rows, n, k in GEMV_CASES:
        x = torch.randn(rows, k).to(dtype)
        weights = [(torch.randn(n, k) * k ** -0.5).to(dtype) for _ in range(LAYERS)]
        before, after, same = alternate(rounds, partial(gemv_layers, ops, x, weights))
        print(f"{str(dtype).removeprefix('torch.')}, {rows} row(s), [{n}, {k}]: before {before:.1f} us, after "
              f"{after:.1f} us, after / before {after / before:.2f}, identical {same}", flush=True)


def gemv_sweep(ops: dict[str, Any], rounds: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        layers = LAYERS * (4 // dtype.itemsize)  # ~425 MB of weights in either dtype
        weights = [(torch.randn(n, k) * k ** -0.5).to(dtype) for _ in range(layers) for n, k in SWEEP_SHAPES]
        for rows in SWEEP_ROWS:
            xs = {k: torch.randn(rows, k).to(dtype) for _, k in SWEEP_SHAPES}

            def sweep(name: str, xs: dict[int, torch.Tensor] = xs,
                      weights: list[torch.Tensor] = weights) -> torch.Tensor:
                return torch.cat([ops[name].small_linear(xs[w.shape[1]], w, None).flatten() for w in weights])

            before, after, same = alternate(rounds, sweep)
            scale = LAYERS / 1e3  # alternate() divides by LAYERS: back to one sweep, in ms
            print(f"{str(dtype).removeprefix('torch.')}, {rows} row(s), {len(weights)} projections: before "
                  f"{before * scale:.2f} ms, after {after * scale:.2f} ms, after / before {after / before:.2f}, "
                  f"identical {same}", flush=True)


def panel_sweep(ops: dict[str, Any], rounds: int, row_counts: tuple[int, ...] = PANEL_ROWS) -> None:
    from tandem.native import panel_pack

    for dtype in (torch.float32, torch.bfloat16):
        layers = LAYERS * (4 // dtype.itemsize)  # ~425 MB of weights in either dtype
        shapes = [shape for _ in range(layers) for shape in SWEEP_SHAPES]
        packed = [panel_pack((torch.randn(n, k) * k ** -0.5).to(dtype)) for n, k in shapes]
        for rows in row_counts:
            xs = {k: torch.randn(rows, k).to(dtype) for _, k in SWEEP_SHAPES}

            def sweep(name: str, xs: dict[int, torch.Tensor] = xs, packed: list[torch.Tensor] = packed,
                      shapes: list[tuple[int, int]] = shapes) -> torch.Tensor:
                return torch.cat([ops[name].panel_linear(xs[k], p, n, None).flatten()
                                  for (n, k), p in zip(shapes, packed, strict=True)])

            before, after, same = alternate(rounds, sweep)
            scale = LAYERS / 1e3  # alternate() divides by LAYERS: back to one sweep, in ms
            print(f"{str(dtype).removeprefix('torch.')}, {rows} row(s), {len(packed)} projections: before "
                  f"{before * scale:.2f} ms, after {after * scale:.2f} ms, after / before {after / before:.2f}, "
                  f"identical {same}", flush=True)


def amx_sweep(ops: dict[str, Any], rounds: int) -> None:
    from tandem.native import amx_pack

    weights = [amx_pack((torch.randn(n, k) * k ** -0.5).bfloat16()) for _ in range(2 * LAYERS)
               for n, k in SWEEP_SHAPES]
    lm_head = [amx_pack((torch.randn(49152, 576) * 576 ** -0.5).bfloat16())]
    for label, packed in ((f"{len(weights)} projections", weights), ("LM head [49152, 576]", lm_head)):
        for rows in AMX_ROWS:
            xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}

            def sweep(name: str, xs: dict[int, torch.Tensor] = xs, packed: list[torch.Tensor] = packed,
                      ) -> torch.Tensor:
                return torch.cat([ops[name].amx_linear(xs[p.shape[1] * 2], p, None).flatten() for p in packed])

            before, after, same = alternate(rounds, sweep)
            scale = LAYERS / 1e3  # alternate() divides by LAYERS: back to one sweep, in ms
            print(f"bfloat16, {rows} rows, {label}: before {before * scale:.2f} ms, after {after * scale:.2f} ms, "
                  f"after / before {after / before:.2f}, identical {same}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=[*sorted(SOURCES), "sdpa"])
    parser.add_argument("rev", nargs="?", help="the commit whose kernel source is 'before' (sdpa: none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--rows", type=int, nargs="+", help=f"panel-sweep's rows of x (default {PANEL_ROWS})")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.kernel == "sdpa":
        for n, keys in SDPA_ROWS:
            sdpa_row(n, keys, args.rounds + 1)
        return
    if args.rev is None:
        parser.error(f"{args.kernel} needs REV, the commit to compare against")
    source, helpers = SOURCES[args.kernel], HELPERS[args.kernel]
    with tempfile.TemporaryDirectory() as tmp:
        ops = {"before": build("tandem_ab_before", source, Path(tmp) / "before", args.rev, helpers),
               "after": build("tandem_ab_after", source, Path(tmp) / "after", None, helpers)}
    if args.kernel == "panel-sweep":
        panel_sweep(ops, args.rounds, tuple(args.rows or PANEL_ROWS))
        return
    kernels = {"attention": attention, "experts": experts, "gemv": gemv, "gemv-sweep": gemv_sweep,
               "amx-sweep": amx_sweep}
    kernels[args.kernel](ops, args.rounds)


if __name__ == "__main__":
    main()
