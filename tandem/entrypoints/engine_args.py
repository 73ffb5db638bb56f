"""Engine arguments shared by `LLM(...)` and every CLI command, with vLLM's names."""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.config import (
    KV_CACHE_DTYPES,
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from tandem.entrypoints.model_folder import check_model_folder

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    pcp_kv_layout: str = "replicated"
    enable_expert_parallel: bool = False
    speculative_config: dict[str, Any] | None = None
    attention_config: dict[str, Any] | None = None
    compilation_config: dict[str, Any] | None = None
    structured_outputs_config: dict[str, Any] | None = None
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)

    def create_engine_config(self) -> EngineConfig:
        from tandem.assets import DEFAULT_DSPARK, DEFAULT_MODEL, default_model

        model = self.model if self.model is not None else default_model()
        if model is None:
            raise ConfigError(f"model=None: the bundled default model is missing from {DEFAULT_MODEL}; pass MODEL, "
                              "a local Hugging Face folder (config.json, *.safetensors, tokenizer.json)")
        check_model_folder(model)
        _check_device(self.device)
        speculative = self.speculative_config
        if (speculative is not None and speculative.get("method") == "dspark" and speculative.get("model") is None
                and model == str(DEFAULT_MODEL)):
            speculative = {**speculative, "model": str(DEFAULT_DSPARK)}  # the bundled target's own drafter
        if speculative is not None and isinstance(speculative.get("model"), str):
            check_model_folder(speculative["model"])
        mc = ModelConfig.from_path(model, self.dtype, self.max_model_len, self.seed)
        return EngineConfig(
            model_config=mc,
            cache_config=CacheConfig(self.block_size, self.num_gpu_blocks_override, self.kv_cache_memory_bytes,
                                     cache_dtype=self.kv_cache_dtype,
                                     calculate_kv_scales=self.calculate_kv_scales,
                                     enable_prefix_caching=self.enable_prefix_caching),
            scheduler_config=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens,
                                             self.enable_chunked_prefill),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                           prefill_context_parallel_size=self.prefill_context_parallel_size,
                                           pcp_kv_layout=self.pcp_kv_layout,
                                           enable_expert_parallel=self.enable_expert_parallel),
            speculative_config=_sub(SpeculativeConfig, "speculative_config", speculative),
            attention_config=_sub(AttentionConfig, "attention_config", self.attention_config),
            compilation_config=_sub(CompilationConfig, "compilation_config", self.compilation_config),
            structured_outputs_config=_sub(StructuredOutputsConfig, "structured_outputs_config",
                                           self.structured_outputs_config),
            device=self.device,
        ).validate()

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        d = EngineArgs()
        p.add_argument("--dtype", default=d.dtype, help="auto, float32, bfloat16 or float16")
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--block-size", type=int, default=d.block_size)
        p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV pool size in blocks")
        p.add_argument("--kv-cache-memory-bytes", type=int, default=d.kv_cache_memory_bytes)
        p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                       help="the KV cache's dtype: auto (the model's), bfloat16, fp8 (= fp8_e4m3) or fp8_e5m2; the "
                            "same --kv-cache-memory-bytes then holds 2x (bf16 -> fp8) or 4x (float32 -> fp8) tokens")
        p.add_argument("--calculate-kv-scales", action="store_true",
                       help="fp8 KV cache: per-layer scales from the first batch's K/V (amax / 200, V: / 100) "
                            "instead of the checkpoint's k_scale / v_scale or 1.0")
        p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
        p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
        p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        p.add_argument("--seed", type=int, default=d.seed)
        p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
        p.add_argument("-pcp", "--prefill-context-parallel-size", type=int, default=1)
        p.add_argument("--pcp-kv-layout", choices=("replicated", "sharded"), default=d.pcp_kv_layout,
                       help="under PCP, every rank holds the whole KV (replicated) or each token's K/V lives on "
                            "one rank (sharded: context capacity grows with the PCP size)")
        p.add_argument("--enable-expert-parallel", action="store_true")
        for name in ("speculative", "attention", "compilation", "structured-outputs"):
            p.add_argument(f"--{name}-config", type=_json_arg, default=None, help="JSON object")
        p.add_argument("--device", default=d.device)

    @staticmethod
    def from_cli_args(args: argparse.Namespace) -> EngineArgs:
        names = set(asdict(EngineArgs())) - {"extra"}
        return EngineArgs(**{k: v for k, v in vars(args).items() if k in names})


def _json_arg(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _check_device(device: str) -> None:
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise ConfigError(f"device={device!r} is not allowed: cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} is not allowed: this machine has no usable CUDA device "
                              f"(torch {torch.__version__}); use cpu")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device={device!r} is not allowed: this machine has {torch.cuda.device_count()} "
                              "CUDA device(s)")


def _check_types(cls: type, name: str, values: dict[str, Any]) -> None:
    """A JSON value of the wrong type (K as the string "3") is named here rather than failing a comparison later."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        options = typing.get_args(hints[key]) if isinstance(hints[key], types.UnionType) else (hints[key],)
        kinds = tuple(typing.get_origin(o) or o for o in options)
        kinds = tuple(list if k is tuple else k for k in kinds) + ((tuple,) if tuple in kinds else ())
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            allowed = " or ".join("null" if k is type(None) else k.__name__ for k in kinds if k is not tuple)
            raise ConfigError(f"{name}.{key}={value!r} is not allowed: {allowed}")


def _sub(cls: type, name: str, values: dict[str, Any] | None) -> Any:
    allowed = set(cls.__dataclass_fields__)
    unknown = set(values or {}) - allowed
    if unknown:
        raise ConfigError(f"{name} has unknown keys {sorted(unknown)}: allowed keys are {sorted(allowed)}")
    values = dict(values or {})
    _check_types(cls, name, values)
    if "cudagraph_capture_sizes" in values:
        values["cudagraph_capture_sizes"] = tuple(values["cudagraph_capture_sizes"])
    if "num_speculative_tokens_per_batch_size" in values:
        values["num_speculative_tokens_per_batch_size"] = tuple(
            (int(b), int(k)) for b, k in values["num_speculative_tokens_per_batch_size"])
    return cls(**values)
