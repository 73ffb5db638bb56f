"""tandem's native CPU kernels, one C++ extension built once per machine:

- paged_attention.cpp: paged attention for short rows (decodes, verification rows), reading keys and values in
  place through the block table. Plain PyTorch ops cannot read a paged cache in place: the fallback gathers every
  row's keys and values into a padded copy a layer (index_select), builds a mask, and calls SDPA, whose CPU kernel
  pays ~5 us of fixed work per (row, KV head) at decode sizes.
- elementwise.cpp: RMSNorm (alone or with the residual add before it), silu(gate) * up and rotary embedding, in
  float32 and bfloat16 (rounded where Hugging Face's bf16 ops round), one pass and one dispatch each instead of 3-10
  PyTorch ops (every one a ~5-15 us dispatch at decode sizes and a pass over memory at prompt sizes); and the
  greedy argmax over logits rows (torch's CPU argmax is a scalar loop: ~1.2 ms a step at [32, 49152]).
- small_gemm.cpp: y = x W^T for up to 16 rows of x (decode, verification and draft passes at small batch), the
  weight streamed once for every row; MKL's sgemm costs twice its gemv from two rows on. And a MoE layer's routed
  experts over only the chosen (token, expert) pairs, each expert's weights streamed once for its rows: the PyTorch
  paths run every expert densely (E / K times the work) or loop over experts with a dispatch per matmul.
- amx_gemm.cpp / panel_gemm.cpp: bfloat16 linears of many rows where oneDNN's bf16 GEMM falls short: on AMX tiles
  (decode batches, streaming each weight once), and on CPUs without bf16 dot products (avx2), where torch's bf16
  matmul is a generic loop, float32 FMA on weights widened in registers.
- decoder_layer.cpp: a Llama or Qwen3 decoder layer in one call for steps of short rows (decodes, verification), the
  kernels above in the module path's order: the ~40 Python-level calls a layer makes around ~0.6 ms of weights
  streamed at batch 1 cost ~10 ms of a SmolLM2 step (tandem/models/fused_decoder_layer.py).

vLLM's CPU backend has its own C++ ops for the same reasons. The extension is compiled with torch's C++ extension
builder (the C++ compiler and ninja that inductor's CPU code generation needs too), cached under torch's extensions
folder, and loaded on first use. Where it cannot be built (no compiler) the engine keeps the PyTorch paths and says
so once. `TANDEM_NATIVE_KERNELS=0` turns all of it off (`TANDEM_NATIVE_ATTENTION=0`, its earlier name, too).
"""

from __future__ import annotations

import logging
import sys
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem import envs
from tandem.native.build_lock import building

log = logging.getLogger("tandem")

_SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "elementwise.cpp", "small_gemm.cpp",
                                                          "amx_gemm.cpp", "panel_gemm.cpp", "decoder_layer.cpp")]
# headers the sources include: torch's builder re-builds a cached extension when its sources or flags change, not its
# headers, so their checksum goes into the flags
_HEADERS = [Path(__file__).with_name(name)
            for name in ("vec16.h", "attention_bf16.h", "attention_amx.h", "amx_tiles.h")]
_OPS = ("paged_attention", "rms_norm", "add_rms_norm", "silu_and_mul", "rotary", "argmax_rows", "small_linear",
        "small_linear_isa", "moe_experts", "amx_linear", "panel_linear", "gqa_decoder_layer")
ISA_FLAGS = {"AVX2": ["-mavx2", "-mfma", "-mf16c"],
             "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]}
_lock = threading.Lock()
_state: dict[str, bool] = {}


# Model dtypes the kernel serves. float32 always; bfloat16 for models without latent (MLA) attention. The kernel
# keeps bf16 scores and probabilities in float32 where Hugging Face's bf16 attention rounds them to bf16; on the tiny
# random GQA checkpoints (llama, qwen3, glm4_moe) the greedy tokens stay within tests/test_bf16_parity.py's tie rule,
# and SmolLM2-135M's bf16 decode gains 1.17x (32 rows, an in-process A/B). On the
# tiny deepseek_v3 (MLA) checkpoint the difference flips a router's top-k and the tokens part far from HF's (a gap of
# 0.43 at the first difference, the rule's tie is 0.03), so bf16 MLA keeps the PyTorch path, whose absorbed-MLA
# matmuls round as HF's do. The small-row GEMM serves float32 and bfloat16 (GEMM_DTYPES: float32 sums, one rounding,
# as oneDNN's bf16 GEMM); the elementwise kernels serve both dtypes (ELEMENTWISE_DTYPES), with Hugging Face's bf16
# roundings.
NATIVE_DTYPES = (torch.float32,)
NATIVE_DTYPES_WITHOUT_MLA = (torch.float32, torch.bfloat16)
ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)
GEMM_DTYPES = (torch.float32, torch.bfloat16)  # the small-row GEMM's (bf16: tandem/layers/cpu_gemm.py's rows)


@dataclass(frozen=True)
class Serving:
    """The model the kernels serve: its dtype, whether any attention layer is latent (MLA), and the engine's
    `compilation_config.native_kernels`. Each engine's runner holds its own and makes it current for its steps
    (`with serving(...)`), so two engines in one process (a float32 MLA model and a bf16 one) never share it."""

    dtype: torch.dtype = torch.float32
    mla: bool = False
    on: bool = True


DEFAULT_SERVING = Serving()  # what the kernels serve outside any engine's step
_serving: ContextVar[Serving | None] = ContextVar("tandem_native_serving", default=None)


@contextmanager
def serving(model: Serving) -> Iterator[None]:
    token = _serving.set(model)
    try:
        yield
    finally:
        _serving.reset(token)


def enabled() -> bool:
    """True when the kernel serves the current model (`serving`; outside an engine's step, a float32 model): it is
    on, its dtype is one of NATIVE_DTYPES (NATIVE_DTYPES_WITHOUT_MLA for a model without MLA), and the kernel is
    built and loaded (built on the first call)."""
    model = _serving.get() or DEFAULT_SERVING
    if not model.on or model.dtype not in (NATIVE_DTYPES if model.mla else NATIVE_DTYPES_WITHOUT_MLA):
        return False
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
    return _state["ok"]


def set_enabled(on: bool) -> None:
    """Turn the kernels off (or back on, where they load): tests and the A/B benchmark compare both paths."""
    _state["ok"] = on and _load()


def _load() -> bool:
    if not envs.native_kernels():
        return False
    if _built():
        return True
    try:
        from torch.utils.cpp_extension import load

        capability = torch.backends.cpu.get_cpu_capability()
        headers = zlib.crc32(b"".join(h.read_bytes() for h in _HEADERS))
        flags = ["-O3", "-fopenmp", *ISA_FLAGS.get(capability, []), f"-DTANDEM_NATIVE_HEADERS={headers}"]
        name, build_dir = build_name(), _build_dir(build_name())
        # asked again once the lock is held: the process that held it may have just built the library
        with building(build_dir, say_wait=needs_build(name)) if build_dir is not None else nullcontext():
            if needs_build(name):
                # ~1 minute once per machine (`make setup` does it at install time): say so before the wait
                print(f"tandem: building the native CPU kernels ({name}, once per machine, about a minute) ...",
                      file=sys.stderr, flush=True)
            load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=flags,
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, a build error: the PyTorch path serves
        log.warning("tandem: the native CPU kernels could not be built (%s: %s); attention, norms, SwiGLU and "
                    "rotary use the PyTorch paths", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return False
    return _built()


def build_name() -> str:
    """The extension's name, which names its build folder: the instruction set torch itself dispatches to here is
    part of it, so a build cached by one kind of CPU is never loaded by another; and so is where these sources live,
    because the build records their paths: two checkouts sharing one folder would rebuild it each time they took
    turns (a minute of three compilers each time, with every other engine waiting on the build lock)."""
    where = zlib.crc32(str(Path(__file__).resolve().parent).encode())
    return f"tandem_native_{torch.backends.cpu.get_cpu_capability().lower()}_{where:08x}"


def needs_build(name: str) -> bool:
    """True when loading extension `name` will compile: its library is missing or older than a source or header
    (the rule torch's builder, ninja, applies)."""
    build_dir = _build_dir(name)
    library = build_dir / f"{name}.so" if build_dir is not None else None
    if library is None or not library.is_file():
        return True
    built = library.stat().st_mtime
    return any(p.stat().st_mtime > built for p in (*_SOURCES, *_HEADERS))


def _build_dir(name: str) -> Path | None:
    """Extension `name`'s build folder under torch's extensions folder (None where torch's private helper is
    missing: then torch's own lock alone guards the build)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return None
    return Path(_get_build_directory(name, verbose=False))


def _built() -> bool:
    if not all(hasattr(torch.ops.tandem_native, op) for op in _OPS):
        return False
    _register_fakes()
    return True


def _register_fakes() -> None:
    """Shapes of the ops that compiled pieces call (torch.compile traces with fake tensors): the small-row GEMM
    runs inside them, where inductor's frozen oneDNN linears cost ~50 us a call at a few rows."""
    if _state.get("fakes"):
        return
    _state["fakes"] = True

    @torch.library.register_fake("tandem_native::small_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("tandem_native::amx_linear")
    def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0] * 16)

    @torch.library.register_fake("tandem_native::panel_linear")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)


def serves(x: torch.Tensor, *params: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,),
           in_compiled: bool = False) -> bool:
    """True when a kernel should compute on x: a CPU tensor of one of `dtypes` (float32 unless the caller's kernel
    takes more: ELEMENTWISE_DTYPES) in a model whose kernels serve its dtype and are loaded, with no gradient to
    carry (the kernels have no backward: training, tandem/train, runs the PyTorch formulas). Eager only unless
    `in_compiled` (the small-row GEMM, an opaque op inside compiled pieces; inductor fuses elementwise ops)."""
    if x.dtype not in dtypes or x.device.type != "cpu" or (torch.compiler.is_compiling() and not in_compiled):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return False
    return _enabled_when_traced() if torch.compiler.is_compiling() else enabled()


def _enabled_when_traced() -> bool:
    """enabled(), a constant of the compiled graph (prepare_for_tracing marks it): Dynamo cannot trace the
    ContextVar read (a graph break would cost the whole-graph compile and its guard savings,
    tandem/compilation/compile.py). Each engine compiles its own forward inside its own steps (`serving`), so the
    value at trace time is the one every call of it sees."""
    return enabled()


def prepare_for_tracing() -> None:
    """Call before torch.compile traces code that calls serves(): marks _enabled_when_traced a constant of the graph
    (torch.compiler.assume_constant_result, which marks the function itself). Not a decorator at import: that imports
    torch._dynamo (with sympy and triton: ~2.7 s of `import tandem` on 2 cores) into every process and every rank,
    where an eager engine never needs it."""
    torch.compiler.assume_constant_result(_enabled_when_traced)


def serves_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """serves() for the small-row GEMM: float32 or bfloat16 (x's and the weight's dtype alike), in eager models and
    compiled pieces alike."""
    return weight.dtype == x.dtype and serves(x, weight, dtypes=GEMM_DTYPES, in_compiled=True)


def serves_elementwise(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """serves() for the elementwise kernels (RMSNorm, SwiGLU, rotary): float32 or bfloat16."""
    return serves(x, *params, dtypes=ELEMENTWISE_DTYPES)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H] float32 or bfloat16 (last dim contiguous); weight: [H], x's dtype -> weight * x * rsqrt(mean(x^2)
    + eps), a new [..., H] (bfloat16: the normed row rounded before the weight multiplies, as Hugging Face's)."""
    return torch.ops.tandem_native.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] (last dim contiguous) -> (rms_norm(x + residual), x + residual), both new [T, H]."""
    out, summed = torch.ops.tandem_native.add_rms_norm(x, residual, weight, eps)
    return out, summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2I] float32 or bfloat16 ([gate | up]) -> silu(gate) * up, a new [..., I] (bfloat16: silu
    rounded before the multiply, as F.silu(gate) * up)."""
    return torch.ops.tandem_native.silu_and_mul(gate_up)


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
           interleaved: bool) -> torch.Tensor:
    """x: [T, H, D] float32 or bfloat16 (D contiguous); positions: [T] int64; cos, sin: [max_position, rotary_dim
    / 2] float32 -> a new [T, H, D] with each head's first rotary_dim dims rotated (neox halves or interleaved pairs;
    bfloat16: cos, sin and every product rounded, as the PyTorch formula on bf16 tensors)."""
    return torch.ops.tandem_native.rotary(x, positions, cos, sin, rotary_dim, interleaved)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                    rows: torch.Tensor, positions: torch.Tensor, block_size: int, scale: float, out: torch.Tensor,
                    lse: torch.Tensor, isa: int = -1) -> None:
    """q: [T, Hq, Dk]; k: [slots, Hkv, Dk]; v: [slots, Hkv, Dv]; block_table: [B, max_blocks] int32;
    rows: [R, 5] int32 (table row, first token, queries, seq_len, first key position); positions: [T] int64.
    Writes out [T, Hq, Dv] and lse [T, Hq] (float32) at the rows' query tokens. isa, for bfloat16 queries over a
    bfloat16 cache: 1 the avx512_bf16 dot products, 2 those and AMX tiles for rows of 33 queries or more, 0 the
    widening path, -1 the best this CPU has."""
    torch.ops.tandem_native.paged_attention(q, k, v, block_table, rows, positions, block_size, scale, out, lse, isa)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [M, K] float32 (K contiguous), M <= 16; weight: [N, K] contiguous; bias: [N] or None -> a new [M, N],
    each output one dot product summed in a fixed order whatever M (small_gemm.cpp)."""
    return torch.ops.tandem_native.small_linear(x, weight, bias)


def tiles_long_row(num_queries: int, num_keys: int) -> bool:
    """Whether the attention kernel takes a prompt row longer than the 128 queries it takes for every model: for a
    bfloat16 model on a CPU with AMX, a row whose keys are at most twice its queries (a prompt, or a chunk behind a
    prefix no longer than itself), which its tiles run faster than torch's SDPA; behind a longer prefix each query
    block lays the prefix out again and SDPA is faster (`python benchmarks/native_ab.py sdpa`, docs/kernels.md)."""
    model = _serving.get() or DEFAULT_SERVING
    return model.dtype == torch.bfloat16 and num_keys <= 2 * num_queries and amx_available()


def amx_available() -> bool:
    """Whether amx_linear runs here: the kernels are built, the CPU has AMX-BF16 and the OS granted its state."""
    return _load() and bool(torch.ops.tandem_native.amx_available())


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16, N % 16 == 0, K % 32 == 0 -> [N / 16, K / 2, 16, 2]: each 16 columns' weights of a K pair
    side by side, AMX's B-tile layout (amx_gemm.cpp)."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [M, K] bf16 (K contiguous); packed: amx_pack(weight); bias: [N] or None -> a new [M, N] bf16, float32
    sums rounded once (amx_gemm.cpp)."""
    return torch.ops.tandem_native.amx_linear(x, packed, bias)


def panels_available() -> bool:
    """Whether panel_linear runs here: the kernels are built on an x86 CPU with avx2 and FMA (their baseline)."""
    return _load() and torch.backends.cpu.get_cpu_capability() in ISA_FLAGS


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 or float32 -> [ceil(N / 16), K, 16] of its dtype: for each panel of 16 output columns and
    each k, the panel's weights in one piece (panel_gemm.cpp's layout; N padded with zeros). bf16 lays columns j and
    8 + j side by side (one shift or mask widens either half); float32 keeps them in order."""
    if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"panel_pack: a bfloat16 or float32 [N, K] weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    pad = -n % 16
    w = weight.detach()
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    if w.dtype == torch.float32:
        return w.reshape(-1, 16, k).transpose(1, 2).contiguous()
    return w.reshape(-1, 2, 8, k).permute(0, 3, 2, 1).reshape(-1, k, 16)


def panel_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [M, K] bf16 or float32 (K contiguous); packed: panel_pack(weight [n, K]) of x's dtype; bias: [n] or None ->
    a new [M, n] of x's dtype: float32 FMA (on widened bf16 weights), each output one chain over k in order, a bf16
    result rounded once (panel_gemm.cpp)."""
    return torch.ops.tandem_native.panel_linear(x, packed, n, bias)


def gqa_decoder_layer(hidden: torch.Tensor, positions: torch.Tensor, norms: list[torch.Tensor], eps: float,
                      weights: list[torch.Tensor], kinds: list[int], sizes: list[int],
                      biases: list[torch.Tensor | None], cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                      interleaved: bool, num_heads: int, num_kv_heads: int, head_dim: int, kv_cache: torch.Tensor,
                      write_slots: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor,
                      attn_positions: torch.Tensor, scale: float,
                      attn_input: torch.Tensor | None = None) -> torch.Tensor:
    """hidden: [T, H] the residual stream into a Llama-family layer -> [T, H] out of it: RMSNorm, qkv, rotary, K/V
    written at write_slots (the first len(write_slots) tokens'), paged attention over `rows` (paged_attention's
    form), o, residual add + RMSNorm, gate_up, SwiGLU, down, residual add; each linear on the kernel kinds[i]
    names (tandem.layers.cpu_gemm.native_route) with weights[i]. The module path's kernels in its order: its bits.
    attn_input: [T, K] qkv's input in place of the RMSNorm of hidden (an EAGLE-3 head's layer)."""
    return torch.ops.tandem_native.gqa_decoder_layer(hidden, positions, norms, eps, weights, kinds, sizes, biases, cos,
                                                     sin, rotary_dim, interleaved, num_heads, num_kv_heads, head_dim,
                                                     kv_cache, write_slots, block_table, rows, attn_positions, scale,
                                                     attn_input)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, expert_start: int) -> torch.Tensor:
    """x: [T, H] float32; w13: [E, 2I, H] ([gate | up]); w2: [E, H, I]; topk_ids: [T, K] int64 global expert ids;
    topk_weights: [T, K] float32 -> a new [T, H]: each token's chosen local experts (ids expert_start ..
    expert_start + E - 1) weighted and summed in ascending expert order; a token's result does not depend on the
    other tokens of the call."""
    return torch.ops.tandem_native.moe_experts(x, w13, w2, topk_ids, topk_weights, expert_start)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [S, V] float32 (V contiguous) -> [S] int64, torch.argmax(x, -1)'s answer (first maximum; NaN wins)."""
    return torch.ops.tandem_native.argmax_rows(x)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[S, V] logits -> [S] int64 argmax token ids, through the native kernel where it serves."""
    if logits.dim() == 2 and logits.shape[-1] > 0 and serves(logits):
        return argmax(logits)
    return logits.argmax(dim=-1)
