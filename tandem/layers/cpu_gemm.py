"""CPU linear layers on oneDNN-prepacked weights, packed once after loading.

`F.linear` on the CPU runs sgemm on the weight as it lies in memory and re-blocks it on every call; at a decode
step's few rows that re-blocking is most of the GEMM. oneDNN packs a weight once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor's freezing does for compiled pieces, and what vLLM's CPU
backend does for its linears), and `_linear_pointwise` then reads it straight. Measured here (AMD EPYC, 2 cores,
avx2, float32, one [N, K] weight; benchmarks/cpu_gemm.py): SmolLM2's MLP gate_up [3072, 576] at 8 rows 617 ->
293 us, its LM head [49152, 576] at 32 rows 38.4 -> 17.2 ms; at prompt-chunk sizes (2,516 rows) the two are equal.

Eager mode packs every linear weight; compiled mode (whose freezing packs the pieces it compiles) only the LM head,
which runs outside them. The plain weight stays where it was (tied embeddings, MLA's absorbed kv_b and the compiled
pieces read it), so the packed copy is extra memory: about the model's linear weights once more in eager mode.
bfloat16 packs for oneDNN only where oneDNN has a bf16 path on this CPU (avx512bw/vl/dq or avx_ne_convert), from
BF16_PACK_MIN_ELEMENTS on, one row included. On a CPU without bf16 dot products (no avx512_bf16, no AMX: avx2
machines) torch's bf16 matmul is a generic loop, 4-8x slower than float32's sgemm at 8-128 rows, so with the native
kernels on every bf16 weight goes into tandem/native/panel_gemm.cpp's panels instead, which serve every row count
(float32 FMA on weights widened in registers: at or under float32's packed GEMM from 1 to 128 rows, within 1.1x of
it at 1,024).

A packed call costs ~50 us of fixed dispatch, so small GEMMs stay on F.linear (benchmarks/cpu_gemm.py measures
both over weight shapes x rows): weights under PACK_MIN_ELEMENTS are not packed (the bundled model's 256-wide
projections lose at every row count up to 32), and a single-row call (a gemv, which F.linear does well) uses the
packed weight only from ANY_ROWS_ELEMENTS on (the LM head at one row: 11.1 -> 6.6 ms; SmolLM2's [960, 576] qkv:
71 -> 86 us, a loss, but 142 -> 87 us at two rows; its [3072, 576] gate_up at one row measured a gain in one run
and a loss in another, and end to end slightly better packed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem import native
from tandem.layers.huge_pages import onto_huge_pages

PACKED_DTYPES = (torch.float32, torch.bfloat16)
DECODE_ROWS_HINT = 32  # the rows oneDNN blocks a packed weight for; any row count runs on it
# 1 MiB of float32: below it F.linear wins at decode row counts. SmolLM2's o_proj [576, 576] is over it: packed,
# 32 rows 146 -> 122 us, 2,048 rows 8.5 -> 6.9 ms (AMD EPYC avx512), and 1.04x end to end in an alternating A/B
# (32 x 32, 2026-12-03); the bundled model's weights all stay under it
PACK_MIN_ELEMENTS = 1 << 18
ANY_ROWS_ELEMENTS = 3 << 19  # from here the packed weight wins at one row too
# bfloat16 on a CPU with bf16 dot products: the packed GEMM won at every shape and row count measured, one row
# included (AMD EPYC, avx512_bf16: [576, 576] at 1 / 32 rows 83 -> 44 / 121 -> 106 us, [128, 256] 29 -> 24 us)
BF16_PACK_MIN_ELEMENTS = 1 << 15
_CPU_HAS_BF16_DOT = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
# A few rows of an eager float32 model go to the native small-row GEMM (tandem/native/small_gemm.cpp), which streams
# the weight once for all rows; MKL's sgemm costs twice its gemv from two rows on. Measured (AMD EPYC avx512, 2
# threads, us, F.linear or the packed weight / native): [576, 256] 24/11 at 1 row, 46/18 at 4, 63/53 at 16; [2048,
# 256] 60/24, 121/52, 172/151; packed [960, 576] 60/21, 73/45, 154/144 and [3072, 576] 101/73, 141/125 but 212/238
# at 8 rows; the [49152, 576] LM head 6.1/6.3 ms at one row, 5.9/8.1 at 4 (DRAM-bound: oneDNN's packed stream wins)
# rows of x up to which an unpacked weight goes native. Without avx512 the kernel's 16 accumulators spill (avx2 has
# 16 vector registers, an f32x16 takes two): measured there (AMD EPYC avx2, 2 threads, us, F.linear / native)
# [576, 256] 19/12 at 1 row, 54/35 at 4, 54/71 at 8, 79/111 at 16; [2048, 256] 65/43, 188/119, 191/217, 268/414
SMALL_ROWS = 16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 4
# ... and a packed one. Since the kernel streams 16 weight rows at once and prefetches the next 16, it holds a
# one-row decode's time up to 4 rows (a K = 3 verification pass). Measured (Intel Xeon with AMX, 2 threads, SmolLM2's
# 120 projections of a decode in turn, ~425 MB, cold; ms a sweep, native / oneDNN packed): float32 1 row 14.6/17.5,
# 4 rows 15.1/21.1, 8 rows 21.3/23.0, 12 rows 25.9/25.7, 16 rows 30.9/27.8; bfloat16 1 row 14.8/20.0, 2 rows
# 15.6/19.9, 4 rows 18.0/20.6, 6 rows 22.8/20.9 (oneDNN's AMX GEMM stays at one read of the weights there)
SMALL_ROWS_PACKED = 8
# bfloat16 on a CPU with bf16 dot products: up to 4 rows (the avx512_bf16 dot products above); elsewhere the
# widening path serves one row of a weight not packed into panels (the panels serve every row, one included: 26 vs
# 60 us for SmolLM2's qkv, 1.5 vs 2.7 ms for its LM head on an avx2 AMD EPYC, warm)
SMALL_ROWS_BF16 = 4 if torch.cpu._is_avx512_bf16_supported() else 1
# Weights past 16 MiB of float32 (LM heads) go native up to 4 rows (a decode, a K = 3 verification), oneDNN past
# that. Measured (Intel Xeon with AMX, 2 threads, ms a call, native / oneDNN packed): SmolLM2's [49152, 576] float32
# head, five copies in turn (cold) 3.80/4.17 at one row, 4.35/5.01 at four; bfloat16, eight copies 1.93/2.10 and
# 2.25/2.19; a [16384, 576] draft head in bfloat16 (cached) 0.31/0.33 at one row. Decode and verification rows then
# get their logits from one kernel, whose rows do not depend on the batch (bfloat16 greedy verification of up to 4
# rows, K <= 3 at batch 1, gives decoding's bits)
SMALL_MAX_ELEMENTS = 1 << 22
SMALL_ROWS_BIG = 4
# bfloat16 on a CPU with AMX: weights packed in AMX's tile layout instead of oneDNN's (native.amx_pack; the same
# memory), decode batches and their verification passes of up to AMX_MAX_ROWS rows on tandem/native/amx_gemm.cpp,
# which streams each weight once at the bandwidth where oneDNN's AMX GEMM reads ~19 GB/s; more rows (prompts) on
# F.linear. A row's result does not depend on its batch there, so bf16 greedy verification of up to 128 rows (batch 32,
# K <= 3) gives decoding's bits. Measured (Intel Xeon with AMX, 2 threads, SmolLM2-135M's 120 projections of a decode
# in turn twice, ~425 MB, cold; ms a sweep): oneDNN packed / AMX kernel 5 rows 22.6/15.9, 8 20.0/14.8, 16 18.8/13.3,
# 32 22.7/16.3, 48 22.3/20.7, 64 24.0/23.7, 128 32.2/43.5; F.linear / AMX kernel 64 rows 39.5/23.5, 96 41.7/34.7, 128
# 45.1/42.3, 256 67.4/81.8
AMX_MAX_ROWS = 128
# float32 on an avx2 CPU without avx512: every weight packed into panel_gemm.cpp's panels (in place of oneDNN's
# layout: the same memory), rows up to FP32_PANEL_MAX_ROWS on them (one row included: a row's result then does not
# depend on its batch at any decode or verification row count), more (long prompt chunks) on F.linear (MKL), which
# matches them there. Measured (AMD EPYC, Zen 3, avx2, 2 threads, 2026-12-07): `benchmarks/cpu_gemm.py --panel-sweep`
# (SmolLM2-135M's 120 projections in turn, cold, GFLOP/s, F.linear / oneDNN packed / panels) 1 row 7.5/10.8/16.3,
# 32 rows 87/114/153, 128 rows 129/143/173, 512 rows 168/156/166, 1,400 rows 170/158/168; SmolLM2-135M float32 in one
# engine, its linears' layouts swapped round by round (median of 5, before the panels' prefetch): panels / oneDNN's
# layout with the small-row kernel up to 8 rows, batch-1 decode step 26.5 / 32.2 ms, batch-32 101 / 132 ms
FP32_PANEL_MAX_ROWS = 512


# the native kernels linear() runs a call on (native_route), the kinds tandem/native/decoder_layer.cpp takes
PANELS, SMALL, AMX = 0, 1, 2


def native_route(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> tuple[int, torch.Tensor] | None:
    """The native kernel linear() runs x's rows on, with the weight as that kernel reads it: (PANELS, the panels),
    (SMALL, the weight) or (AMX, the tiles); None where linear() runs a PyTorch op."""
    rows = x.numel() // max(x.shape[-1], 1)
    if packed is not None and packed.dim() == 3:  # panel_pack's layout: bf16 rows of any count, float32 decode rows
        if native.serves_gemm(x, weight) and (weight.dtype == torch.bfloat16 or rows <= FP32_PANEL_MAX_ROWS):
            return PANELS, packed
        return None
    # compiled pieces: inductor's freezing packs what eager mode would have packed (prepack_linears packs only the
    # LM head there), so the same row limits apply; the guard on rows splits the compiled graphs at those limits
    packs = packed is not None or (torch.compiler.is_compiling() and weight.numel() >= PACK_MIN_ELEMENTS)
    limit = SMALL_ROWS_BF16 if weight.dtype == torch.bfloat16 else SMALL_ROWS_PACKED if packs else SMALL_ROWS
    if weight.numel() > SMALL_MAX_ELEMENTS:
        limit = min(limit, SMALL_ROWS_BIG)
    if rows <= limit and weight.is_contiguous() and native.serves_gemm(x, weight):
        return SMALL, weight
    if packed is not None and packed.dim() == 4 and rows <= AMX_MAX_ROWS and native.serves_gemm(x, weight):
        return AMX, packed  # AMX's tile layout (amx_pack): decode batches on the tiles
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K] -> [..., N]. `packed`: the weight as prepack laid it out (oneDNN's, AMX's or the
    panels'), or None."""
    route = native_route(x, weight, packed)
    if route is not None:
        kind, w = route
        x2 = x.reshape(x.numel() // max(x.shape[-1], 1), x.shape[-1])
        y = native.panel_linear(x2, w, weight.shape[0], bias) if kind == PANELS else \
            native.small_linear(x2, w, bias) if kind == SMALL else native.amx_linear(x2, w, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    if packed is not None and packed.dim() in (3, 4):  # panels or tiles the native kernels do not take here
        return F.linear(x, weight, bias)
    if packed is None or torch.compiler.is_compiling():  # the compiler packs (freezing) what it compiles
        return F.linear(x, weight, bias)
    if x.numel() == x.shape[-1] and weight.numel() < ANY_ROWS_ELEMENTS and not _native_bf16(weight.dtype):  # a gemv
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _native_bf16(dtype: torch.dtype) -> bool:
    """bfloat16 on a CPU with bf16 dot products (avx512_bf16 or AMX), where oneDNN's bf16 GEMM is native."""
    return dtype == torch.bfloat16 and _CPU_HAS_BF16_DOT


def prepack(weight: torch.Tensor, amx: bool = False) -> torch.Tensor | None:
    """weight [N, K] -> the same in oneDNN's blocked layout, or None where oneDNN cannot run it here. amx (the
    native kernels on): a bfloat16 weight whose shape AMX's tiles take goes into their layout instead, on a CPU with
    AMX-BF16; on a CPU without bf16 dot products, every bfloat16 weight goes into panel_gemm.cpp's panels, and on
    one without avx512 every float32 weight too."""
    if amx and _panel_fits(weight):
        return native.panel_pack(weight)
    min_elements = BF16_PACK_MIN_ELEMENTS if _native_bf16(weight.dtype) else PACK_MIN_ELEMENTS
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2 \
            or weight.numel() < min_elements:
        return None
    if amx and _amx_fits(weight):
        return native.amx_pack(weight)
    if not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), DECODE_ROWS_HINT)
    except RuntimeError:  # a CPU without oneDNN's path for this dtype
        return None


def _amx_fits(weight: torch.Tensor) -> bool:
    """A bfloat16 [N, K] CPU weight AMX's tiles take (N a multiple of 16, K of 32) on a CPU where amx_linear runs."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2 \
        and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and native.amx_available()


def bf16_on_panels() -> bool:
    """Whether bfloat16 linears run on tandem/native/panel_gemm.cpp here: a CPU without bf16 dot products (no
    avx512_bf16, no AMX), where oneDNN has no bf16 GEMM and torch's falls back to a generic loop, with the native
    kernels built."""
    return not _CPU_HAS_BF16_DOT and native.panels_available()


def fp32_on_panels() -> bool:
    """Whether float32 linears run on tandem/native/panel_gemm.cpp here: an x86 CPU with avx2 but not avx512, where
    the panels beat oneDNN's float32 GEMM at decode and verification row counts (FP32_PANEL_MAX_ROWS above), with the
    native kernels built."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2" and native.panels_available()


def _panel_fits(weight: torch.Tensor) -> bool:
    """A [N, K] CPU weight the panels serve here: bfloat16 where bf16_on_panels(), float32 where fp32_on_panels()."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype == torch.bfloat16:
        return bf16_on_panels()
    return weight.dtype == torch.float32 and fp32_on_panels()


def prepack_linears(model: nn.Module, lm_head_only: bool, amx: bool = False) -> int:
    """Pack the weight of every module that declares `packed_weight` (the linear layers and the LM head), or only
    the LM head's; returns how many were packed. amx: bfloat16 weights into AMX's layout where the CPU has it
    (prepack)."""
    from tandem.layers.embedding import ParallelLMHead

    count, ours = 0, []
    for module in model.modules():
        if not hasattr(module, "packed_weight"):
            continue
        native_layout = amx and (_amx_fits(module.weight) or _panel_fits(module.weight))  # AMX's or the panels'
        if lm_head_only and not isinstance(module, ParallelLMHead) and not native_layout:
            continue  # inside compiled pieces inductor's freezing packs for oneDNN; AMX's and the panels' are ours
        module.packed_weight = prepack(module.weight, amx)
        count += module.packed_weight is not None
        if module.packed_weight is not None and native_layout:
            ours.append(module)
    onto_huge_pages(ours)
    return count
