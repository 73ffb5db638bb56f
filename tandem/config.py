"""One frozen config tree for the engine, built from user arguments and the checkpoint's config.json.

`EngineConfig.validate()` is the single place where combinations are checked; every error names
the field, the value and what is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def _env_native_kernels() -> bool:
    from tandem import envs  # (tandem.envs imports this module for ConfigError)

    return envs.native_kernels()


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names the field, the value and the choices."""


# kv_cache_dtype names and the cache tensor's dtype for each (tandem/attention/kv_dtype.py stores and reads them)
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
_STORAGE: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,  # vLLM's "fp8"
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_storage_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for `kv_cache_dtype=name`: "auto" is the model's compute dtype."""
    if name == "auto":
        return compute_dtype
    if name not in _STORAGE:
        raise ValueError(f"kv_cache_dtype={name!r} is not allowed (--kv-cache-dtype): one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return _STORAGE[name]


def _fail(field_name: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{field_name}={value!r} is not allowed: {allowed}")


def resolve_dtype(name: str | torch.dtype, checkpoint_dtype: str | None) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        # Like vLLM: keep the checkpoint's dtype but compute float16/bfloat16 on CPU as float32
        # only when asked; "auto" takes the checkpoint's own dtype, float32 if it names none.
        return _DTYPES.get(checkpoint_dtype or "float32", torch.float32)
    if name not in _DTYPES:
        _fail("dtype", name, f"one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    model: str
    hf: SimpleNamespace  # config.json as attributes (nested dicts stay dicts)
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0

    @staticmethod
    def from_path(model: str, dtype: str | torch.dtype = "auto", max_model_len: int | None = None,
                  seed: int = 0) -> ModelConfig:
        path = Path(model)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"model={model!r}: no config.json found; MODEL must be a local Hugging Face "
                              "folder with config.json, *.safetensors and tokenizer.json")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"model={model!r}: config.json is not valid JSON: {e}") from e
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or len(archs) != 1:
            _fail("config.json architectures", archs, "a list with exactly one architecture name")
        hf = SimpleNamespace(**raw)
        limit = getattr(hf, "max_position_embeddings", None) or 2048
        if max_model_len is None:
            max_model_len = limit
        torch_dtype = raw.get("torch_dtype") or raw.get("dtype")
        return ModelConfig(model=str(path), hf=hf, architecture=archs[0],
                           dtype=resolve_dtype(dtype, torch_dtype), max_model_len=int(max_model_len),
                           seed=seed)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self.hf, name, default)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV pool size in blocks; None sizes it from kv_cache_memory_bytes.
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    # kv_cache_dtype (vLLM's CacheConfig.cache_dtype): auto (the model's dtype), bfloat16, fp8 (= fp8_e4m3),
    # fp8_e5m2; the budget above counts bytes, so a narrower dtype holds more tokens (tandem/attention/kv_dtype.py)
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # fp8 caches: per-layer k_scale / v_scale from the first batch that writes the cache (amax / 200 for K, / 100
    # for V, vLLM's constants), replacing a checkpoint's scales and the default 1.0 (tandem/attention/kv_scales.py)
    calculate_kv_scales: bool = False

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache tensors' dtype."""
        return kv_storage_dtype(self.cache_dtype, model_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    enable_expert_parallel: bool = False
    decode_context_parallel_size: int = 1  # accepted as a name only: DCP is outside tandem's contract
    # where each token's K/V lives under PCP: "replicated" (every rank holds the whole context) or "sharded"
    # (on the rank that owns its KV block, attention/kv_ownership.py: context capacity grows with the PCP size).
    # Neither is faster everywhere (docs/pcp.md): sharded wins long prefills, replicated short-context decoding
    pcp_kv_layout: str = "replicated"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.prefill_context_parallel_size

    def check_model(self, model: ModelConfig) -> None:
        """What TP and EP split must divide evenly; checked here, before any rank starts (each would raise)."""
        tp = self.tensor_parallel_size
        if tp > 1:
            for name in ("num_attention_heads", "intermediate_size", "moe_intermediate_size"):
                value = model.get(name)
                if isinstance(value, int) and value % tp:
                    _fail("tensor_parallel_size", tp, f"a divisor of the model's {name} ({value})")
            kv = model.get("num_key_value_heads")
            if isinstance(kv, int) and kv > 0 and kv % tp and tp % kv:
                _fail("tensor_parallel_size", tp, f"a divisor or a multiple of num_key_value_heads ({kv})")
        experts = model.get("n_routed_experts")
        if self.enable_expert_parallel and isinstance(experts, int) and experts % self.world_size:
            _fail("tensor_parallel_size x prefill_context_parallel_size", self.world_size,
                  f"a divisor of n_routed_experts ({experts}) with enable_expert_parallel")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None
    # K drafts per step, or "auto": a cost model picks K in 0..max_num_speculative_tokens each step
    # (engine/spec_policy.py)
    num_speculative_tokens: int | str = 0
    # dynamic K: ((max running requests, K), ...) ascending, e.g. ((8, 3), (16, 2), (32, 1)); more
    # running requests than the last bound -> no drafts
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int], ...] = ()
    draft_sample_method: str = "greedy"
    attention_backend: str | None = None
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    adaptive_verification: bool = False  # accepted as a name only, and rejected: not implemented
    # the largest K any step may use: given with "auto", derived from K or the schedule otherwise
    max_num_speculative_tokens: int | None = None
    # an EAGLE-3 head's compute (and KV) dtype: "auto" = the target's; "bfloat16" under a float32 target reads half
    # a draft pass's bytes. A drafter's arithmetic only moves acceptance: verification stays exact either way
    draft_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.max_num_speculative_tokens is None:
            object.__setattr__(self, "max_num_speculative_tokens", self._derived_max_k())

    def _derived_max_k(self) -> int:
        k = self.num_speculative_tokens if isinstance(self.num_speculative_tokens, int) else 0
        return max([k, *(k for _, k in self.num_speculative_tokens_per_batch_size)])

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def auto(self) -> bool:
        """K is chosen each step by the cost model (engine/spec_policy.py)."""
        return self.num_speculative_tokens == "auto"

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a sampling row reserves past its tokens: model drafters (MTP, DSpark) write their own KV at
        the next step's draft positions while proposing; n-gram writes nothing."""
        return self.max_k if self.method in ("mtp", "eagle3", "dspark") else 0

    @property
    def max_k(self) -> int:
        return self.max_num_speculative_tokens or 0

    @property
    def prefix_keys_next_token(self) -> bool:
        """MTP's (and EAGLE-3's) KV entry at a block's last position was computed from the token after the block,
        so a cached block is keyed by its tokens and that one (engine/block_manager.py)."""
        return self.method in ("mtp", "eagle3")

    @property
    def uses_mtp_layers(self) -> bool:
        """The checkpoint's MTP layers draft; otherwise they are not even loaded (vLLM loads them into its drafter)."""
        return self.method == "mtp"

    @property
    def keeps_token_history(self) -> bool:
        """The drafter reads each request's whole token history (n-gram), so admissions send it once."""
        return self.method == "ngram"

    def drafter_dtype(self, target_dtype: torch.dtype) -> torch.dtype:
        """The dtype the drafter computes in (draft_dtype "auto": the target's)."""
        return target_dtype if self.draft_dtype == "auto" else getattr(torch, self.draft_dtype)

    def num_tokens_for_batch(self, num_running: int) -> int:
        """K for a step with `num_running` running requests (a fixed K or the schedule; not "auto")."""
        if not self.num_speculative_tokens_per_batch_size:
            return int(self.num_speculative_tokens)
        for bound, k in self.num_speculative_tokens_per_batch_size:
            if num_running <= bound:
                return k
        return 0

    def _validate_k(self) -> None:
        k, schedule, max_k = self.num_speculative_tokens, self.num_speculative_tokens_per_batch_size, \
            self.max_num_speculative_tokens
        if isinstance(k, str) and k != "auto":
            _fail("speculative_config.num_speculative_tokens", k, 'a positive integer or "auto"')
        if self.auto:
            if schedule:
                _fail("speculative_config.num_speculative_tokens_per_batch_size", schedule,
                      'empty with num_speculative_tokens "auto" (the cost model chooses K)')
            if not isinstance(max_k, int) or isinstance(max_k, bool) or not 1 <= max_k <= 16:
                _fail("speculative_config.max_num_speculative_tokens", max_k,
                      'an integer from 1 to 16 with num_speculative_tokens "auto" (the largest K it may choose)')
            return
        if max_k != self._derived_max_k():
            _fail("speculative_config.max_num_speculative_tokens", max_k,
                  'only with num_speculative_tokens "auto"; a fixed K or a schedule sets its own maximum')
        if k < 1 and not schedule:
            _fail("speculative_config.num_speculative_tokens", k,
                  'a positive integer or "auto" (or give num_speculative_tokens_per_batch_size)')
        bounds = [b for b, _ in schedule]
        if any(b < 1 or k < 0 for b, k in schedule) or bounds != sorted(set(bounds)):
            _fail("speculative_config.num_speculative_tokens_per_batch_size", schedule,
                  "pairs [max_running_requests, K] with strictly increasing bounds >= 1 and K >= 0")

    def validate(self, model: ModelConfig) -> None:
        if self.method is None:
            if self.num_speculative_tokens or self.num_speculative_tokens_per_batch_size:
                _fail("speculative_config.method", None, f"one of {', '.join(SPEC_METHODS)} when "
                      "num_speculative_tokens is set")
            return
        if self.method not in SPEC_METHODS:
            _fail("speculative_config.method", self.method, f"one of {', '.join(SPEC_METHODS)}")
        self._validate_k()
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            _fail("speculative_config.draft_sample_method", self.draft_sample_method, "greedy or probabilistic")
        if self.draft_dtype not in DRAFT_DTYPES:
            _fail("speculative_config.draft_dtype", self.draft_dtype, f"one of {', '.join(DRAFT_DTYPES)}")
        if self.draft_dtype != "auto" and self.method != "eagle3":
            _fail("speculative_config.draft_dtype", self.draft_dtype, f"'auto' with method {self.method!r} (its "
                  "drafter computes in the target's dtype); another dtype only with method 'eagle3'")
        if self.method == "mtp" and not model.get("num_nextn_predict_layers"):
            _fail("speculative_config.method", "mtp", f"a checkpoint with MTP layers; {model.model} has "
                  "num_nextn_predict_layers = 0")
        if self.method == "eagle3":
            if not self.model:
                _fail("speculative_config.model", self.model, "the EAGLE-3 head's checkpoint folder (method 'eagle3')")
            from tandem.models.eagle3 import Eagle3Config  # the models import this module

            Eagle3Config.from_folder(self.model).check_target(model)
        if self.method == "dspark" and not self.model:
            _fail("speculative_config.model", self.model, "the DSpark drafter's checkpoint folder")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            _fail("speculative_config.prompt_lookup_min", self.prompt_lookup_min,
                  f"1 <= prompt_lookup_min <= prompt_lookup_max ({self.prompt_lookup_max})")


@dataclass(frozen=True)
class AttentionConfig:
    backend: str | None = None
    # attention kind ("full_attention", "mla_attention", ...) -> backend name
    backend_per_kind: dict[str, str] = field(default_factory=dict)


PCP_KV_LAYOUTS = ("replicated", "sharded")
DRAFT_DTYPES = ("auto", "float32", "bfloat16")

# vLLM's default capture sizes, cut at 512 (tandem's steps are at most max_num_batched_tokens anyway).
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class CompilationConfig:
    """vLLM's names. `mode`: 0 / "NONE" runs the model eagerly; 3 / "VLLM_COMPILE" compiles it with torch.compile
    (inductor), split at the attention, MoE-expert and collective calls, which run eagerly between the compiled
    pieces (vLLM's PIECEWISE); a failed compile falls back to eager with one warning.
    `cudagraph_mode` "PIECEWISE": a step of at most max(capture sizes) tokens is padded up to the next capture
    size, and so are MTP's one-token draft decodes (DESIGN §5); on CUDA the compiled pieces are replayed as CUDA
    graphs at those sizes. `FULL` is accepted only without PCP (and then behaves as PIECEWISE)."""

    mode: int | str = 0
    cudagraph_mode: str = "NONE"
    cudagraph_capture_sizes: tuple[int, ...] = ()
    # tandem's native CPU kernels (tandem/native) for this engine; TANDEM_NATIVE_KERNELS=0 turns the default off
    native_kernels: bool = field(default_factory=_env_native_kernels)

    @property
    def level(self) -> int:
        """`mode` as its number (names accepted as vLLM spells them)."""
        return COMPILATION_MODES.get(self.mode, self.mode) if isinstance(self.mode, str) else self.mode

    @property
    def compiles(self) -> bool:
        return self.level == COMPILATION_MODES["VLLM_COMPILE"]

    @property
    def pads(self) -> bool:
        return self.cudagraph_mode != "NONE"

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.cudagraph_capture_sizes or DEFAULT_CAPTURE_SIZES))

    def padded_size(self, num_tokens: int) -> int:
        """The capture size a batch of `num_tokens` runs at (itself when padding is off or it is too big)."""
        if not self.pads:
            return num_tokens
        return next((size for size in self.capture_sizes if size >= num_tokens), num_tokens)


STRUCTURED_OUTPUT_BACKENDS = ("xgrammar", "guidance", "llguidance")  # guidance: vLLM's name for llguidance


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's names (`--structured-outputs-config`). `backend`: the grammar engine (xgrammar; llguidance, which vLLM
    names guidance); `disable_any_whitespace`: JSON without free whitespace between tokens (a small model then
    cannot wander into endless blank lines); `compile_timeout_s`: a grammar that compiles longer is refused."""

    backend: str = "xgrammar"
    disable_any_whitespace: bool = False
    compile_timeout_s: float = 10.0


COMPILATION_MODES = {"NONE": 0, "VLLM_COMPILE": 3}
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL")
SPEC_METHODS = ("mtp", "eagle3", "dspark", "ngram")


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    attention_config: AttentionConfig = field(default_factory=AttentionConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    device: str = "cpu"

    def validate(self) -> EngineConfig:
        m, c, s, p = self.model_config, self.cache_config, self.scheduler_config, self.parallel_config
        if m.max_model_len < 1:
            _fail("max_model_len", m.max_model_len, "a positive integer")
        limit = m.get("max_position_embeddings")
        if limit is not None and m.max_model_len > limit and not m.get("rope_scaling"):
            _fail("max_model_len", m.max_model_len,
                  f"at most the model's max_position_embeddings ({limit})")
        if c.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            _fail("block_size", c.block_size, "a power of two from 1 to 256")
        if c.cache_dtype not in KV_CACHE_DTYPES:
            _fail("kv_cache_dtype (--kv-cache-dtype)", c.cache_dtype, f"one of {', '.join(KV_CACHE_DTYPES)}")
        if c.calculate_kv_scales and not c.cache_dtype.startswith("fp8"):
            _fail("calculate_kv_scales (--calculate-kv-scales)", c.calculate_kv_scales,
                  f"only with an fp8 kv_cache_dtype (fp8, fp8_e4m3, fp8_e5m2), not {c.cache_dtype!r}")
        if c.num_gpu_blocks is not None and c.num_gpu_blocks < 1:
            _fail("num_gpu_blocks", c.num_gpu_blocks, "a positive integer or None")
        if s.max_num_seqs < 1:
            _fail("max_num_seqs", s.max_num_seqs, "a positive integer")
        if s.max_num_batched_tokens < 1:
            _fail("max_num_batched_tokens", s.max_num_batched_tokens, "a positive integer")
        if not s.enable_chunked_prefill and s.max_num_batched_tokens < m.max_model_len:
            _fail("max_num_batched_tokens", s.max_num_batched_tokens,
                  f"at least max_model_len ({m.max_model_len}) when chunked prefill is off")
        for name in ("tensor_parallel_size", "prefill_context_parallel_size"):
            if getattr(p, name) < 1:
                _fail(name, getattr(p, name), "a positive integer")
        if p.pcp_kv_layout not in PCP_KV_LAYOUTS:
            _fail("pcp_kv_layout", p.pcp_kv_layout, f"one of {', '.join(PCP_KV_LAYOUTS)}")
        p.check_model(m)
        self.speculative_config.validate(m)
        so = self.structured_outputs_config
        if so.backend not in STRUCTURED_OUTPUT_BACKENDS:
            _fail("structured_outputs_config.backend", so.backend, f"one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}")
        if not so.compile_timeout_s > 0:
            _fail("structured_outputs_config.compile_timeout_s", so.compile_timeout_s, "a number of seconds > 0")
        self._reject_unsupported()
        mode = self.compilation_config.mode
        if isinstance(mode, bool) or self.compilation_config.level not in COMPILATION_MODES.values():
            _fail("compilation_config.mode", mode, "0 / \"NONE\" (eager) or 3 / \"VLLM_COMPILE\" (torch.compile, "
                  "split at attention)")
        if self.compilation_config.cudagraph_mode not in CUDAGRAPH_MODES:
            _fail("compilation_config.cudagraph_mode", self.compilation_config.cudagraph_mode,
                  f"one of {', '.join(CUDAGRAPH_MODES)}")
        sizes = self.compilation_config.cudagraph_capture_sizes
        if any(not isinstance(n, int) or n < 1 for n in sizes) or len(set(sizes)) != len(sizes):
            _fail("compilation_config.cudagraph_capture_sizes", list(sizes), "distinct positive integers")
        return self

    def _reject_unsupported(self) -> None:
        p, pcp = self.parallel_config, self.parallel_config.prefill_context_parallel_size
        if p.decode_context_parallel_size != 1:
            _unsupported("decode_context_parallel_size", p.decode_context_parallel_size,
                         "decode context parallelism (DCP) is outside tandem's PCP contract; use 1")
        if self.speculative_config.adaptive_verification:
            _unsupported("speculative_config.adaptive_verification", True,
                         "verification always checks every draft (greedy or probabilistic)")
        if self.model_config.get("index_topk") is not None:
            _unsupported("sparse MLA (config.json index_topk)", self.model_config.get("index_topk"),
                         "tandem's MLA backends attend densely")
        if self.compilation_config.cudagraph_mode == "FULL" and pcp > 1:
            _unsupported("compilation_config.cudagraph_mode", "FULL", "full graphs do not cover PCP's "
                         "per-step partition and collectives; use PIECEWISE with prefill_context_parallel_size > 1")


def kv_pools(config: EngineConfig) -> int:
    """KV block pools the scheduler allocates from: one per PCP rank with the sharded layout, else one (every
    rank holds every block)."""
    p = config.parallel_config
    return p.prefill_context_parallel_size if p.pcp_kv_layout == "sharded" else 1


def _unsupported(what: str, value: Any, why: str) -> None:
    raise ConfigError(f"{what}={value!r} is not supported: {why}")


def config_fields(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


__all__ = [
    "AttentionConfig", "CacheConfig", "CompilationConfig", "ConfigError", "EngineConfig", "ModelConfig",
    "ParallelConfig", "SchedulerConfig", "SpeculativeConfig", "config_fields", "kv_pools", "replace", "resolve_dtype",
]
