"""Sharded vs replicated MTP draft prefill under PCP: for long prompts at PCP = P, the time-to-first-token
with no drafter, with the MTP drafter sharded (its step 0 on each rank's DualChunkSwap segments) and with it
replicated (every rank runs step 0 over the whole prompt), in one run; draft prefill time = rank 0's wall time in
the drafter's hooks (StepOutput.draft_s), printed beside TTFT with the drafter - TTFT without it (which also
holds engine-to-engine noise of ~0.1 s on the 2-core dev machine). Also prints the bytes each mode moves over the
PCP group.

    .venv/bin/python benchmarks/draft_modes.py --prompt-len 2048 8192 --repeats 7

Model: the bundled tandem-dsv3-tiny (MLA, kv_lora_rank 512, one MTP layer) copied to a temporary folder with
max_position_embeddings raised so an 8k prompt fits; its weights are untouched (this measures time, not text).
Replicated mode is forced the way a user would: an explicit draft backend without PCP support
(CONTIGUOUS_MLA). One thread per rank, prefix caching off, best of `--repeats`.

`--drafter dspark` compares the two layouts of the DSpark drafter's context K/V instead (the bundled
tandem-dsv3-tiny-dspark; spec_decode/dspark_context.py): sharded (each rank projects its own rows and all-gathers
the K/V, the default) against replicated (restore the target's layer outputs, project every token on every rank;
TANDEM_DSPARK_CONTEXT_KV=replicated). Both keep a replicated drafter cache. Columns: TTFT and TTFT minus TTFT
without a drafter (as for MTP); rank 0's own wall time in the drafter's hooks for the prompt (StepOutput.draft_s:
context projection, its all-gather and the one block proposal); bytes all-gathered, measured (the proposer's
context_gather_bytes counter) and by the formula of spec_decode/dspark_context.py; and one rank's context
projection + cache write timed in this process on one thread without the collective. Each mode runs on two
engines, started in the order none, sharded, replicated, replicated, sharded, none, and keeps the better of each
column: on this machine the engine started second in a process measured 0.1-0.2 s slower TTFT whichever mode it
ran, more than the difference between the modes.

    .venv/bin/python benchmarks/draft_modes.py --drafter dspark --prompt-len 8192 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from tandem.assets import DEFAULT_DSPARK, DEFAULT_MODEL
from tandem.bench.machine import machine_info
from tandem.bench.prompts import random_token_ids
from tandem.spec_decode.dspark_context import CONTEXT_KV_ENV
from tandem.step_plan import StepOutput, StepPlan
from tandem.worker.pcp import partition

MTP = {"method": "mtp", "num_speculative_tokens": 1}
MODES = {"no drafter": None, "sharded": MTP, "replicated": {**MTP, "attention_backend": "CONTIGUOUS_MLA"}}
DSPARK = {"method": "dspark", "model": str(DEFAULT_DSPARK), "num_speculative_tokens": 1}
DSPARK_MODES = {"no drafter": None, "sharded": DSPARK, "replicated": DSPARK}  # the layout: $TANDEM_DSPARK_CONTEXT_KV


def extra_bytes(config: dict, prompt_len: int, budget: int, pcp: int, mode: str) -> int:
    """Bytes all-gathered over the PCP group by draft prefill, beyond what the target already moves (the target
    itself gathers only its logits rows). Sharded, per prefill step: the MTP layer's latent K/V
    (P * max_local * (kv_lora + rope) * 4) and step 0's two outputs at the one drafting row (2 * P * hidden * 4,
    last chunk only). Replicated: the restore of every target hidden state it drafts from
    (P * max_local * hidden * 4), then every token on every rank."""
    elem = 4  # float32 compute
    chunks = [min(budget, prompt_len - s) for s in range(0, prompt_len, budget)]
    max_local = [partition(np.array([0, n]), np.array([True]), pcp).max_local_tokens for n in chunks]
    if mode == "sharded":
        kv = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * elem
        return sum(pcp * m * kv for m in max_local) + 2 * pcp * config["hidden_size"] * elem
    if mode == "replicated":
        return sum(pcp * m * config["hidden_size"] * elem for m in max_local)
    return 0


def dspark_bytes(prompt_len: int, budget: int, pcp: int, mode: str) -> int:
    """Bytes all-gathered over the PCP group for DSpark's context, per the formula of spec_decode/dspark_context.py:
    per step P * max_local * row, row = the drafter's K/V (sharded: L * 2 * Hkv * D * 4) or the target's captured
    layer outputs (replicated: n * H_t * 4)."""
    cfg = json.loads((DEFAULT_DSPARK / "config.json").read_text())
    row = {"sharded": cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4,
           "replicated": len(cfg["target_layer_ids"]) * cfg["target_hidden_size"] * 4}.get(mode, 0)
    chunks = [min(budget, prompt_len - s) for s in range(0, prompt_len, budget)]
    return sum(pcp * partition(np.array([0, n]), np.array([True]), pcp).max_local_tokens * row for n in chunks)


@torch.inference_mode()
def dspark_context_s(prompt_len: int, pcp: int, repeats: int) -> dict[str, float]:
    """One rank's context work for one prefill chunk of `prompt_len` tokens, in this process on one thread and
    without the collective (best of `repeats`): sharded projects its max_local_tokens rows and writes all
    prompt_len gathered rows; replicated projects and writes all prompt_len rows."""
    from tandem.models.dspark import DSparkConfig, DSparkDrafter
    from tandem.models.loader import load_weights, read_checkpoint

    cfg = DSparkConfig.from_folder(str(DEFAULT_DSPARK))
    drafter = DSparkDrafter(cfg, max_position=prompt_len + cfg.block_size)
    load_weights(drafter, read_checkpoint(str(DEFAULT_DSPARK)))
    for attn in drafter.attention_layers():
        attn.kv_cache = torch.zeros(attn.kv_cache_shape(-(-prompt_len // 16), 16))
    local = partition(np.array([0, prompt_len]), np.array([True]), pcp).max_local_tokens
    aux = torch.randn(prompt_len, len(cfg.target_layer_ids) * cfg.target_hidden_size)  # [T, n * H_t]
    positions = slots = torch.arange(prompt_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    work = {"sharded": lambda: drafter.write_context_kv(  # the gathered rows stand in for every rank's own
                drafter.context_kv(aux[:local], positions[:local]).repeat(pcp, 1, 1, 1, 1)[:prompt_len], slots),
            "replicated": lambda: drafter.write_context(aux, positions, slots)}
    best = {}
    for name, fn in work.items():
        walls = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - start)
        best[name] = min(walls)
    torch.set_num_threads(threads)
    return best


class Timing(NamedTuple):
    ttft_s: float  # best of the repeats
    draft_mode: str
    context_gather_bytes: float  # DSpark's counter for one prefill of the prompt
    rank0_draft_s: float  # best of the repeats: rank 0's wall seconds in the drafter's hooks (StepOutput.draft_s)
    step_s: float  # best of the repeats: wall seconds in executor.execute, without the engine's request handling
    #                and output work that TTFT also holds


def ttft(model: Path, prompts: list[list[int]], pcp: int, budget: int, spec: dict | None, repeats: int,
         env: dict[str, str] | None = None) -> list[Timing]:
    """One engine: the Timing of each prompt in turn (best of `repeats` each) after one short warm-up."""
    from tandem import LLM, SamplingParams

    torch.set_num_threads(pcp)  # the executor hands each rank get_num_threads() // world = 1 thread
    os.environ.update(env or {})  # read by the spawned ranks when they build their drafter
    llm = LLM(str(model), dtype="float32", prefill_context_parallel_size=pcp, max_num_batched_tokens=budget,
              max_model_len=max(map(len, prompts)) + 8, enable_prefix_caching=False, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=1)
    try:
        llm.generate([{"prompt_token_ids": prompts[0][:64]}], params, use_tqdm=False)  # warm-up
        stats = llm.engine.spec_stats.draft_stats
        execute = llm.engine.executor.execute
        draft_s: list[float] = []
        step_s: list[float] = []

        def timed_execute(plan: StepPlan) -> StepOutput:
            start = time.perf_counter()
            out = execute(plan)
            step_s[-1] += time.perf_counter() - start
            draft_s[-1] += out.draft_s
            return out

        llm.engine.executor.execute = timed_execute  # type: ignore[method-assign]
        timings = []
        for ids in prompts:
            walls, draft_s[:], step_s[:] = [], [], []
            for _ in range(repeats):
                before = stats.get("context_gather_bytes", 0.0)
                draft_s.append(0.0)
                step_s.append(0.0)
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                walls.append(time.perf_counter() - start)
            timings.append(Timing(min(walls), str(llm.draft_mode), stats.get("context_gather_bytes", 0.0) - before,
                                  min(draft_s), min(step_s)))
        return timings
    finally:
        llm.shutdown()
        for name in env or {}:
            del os.environ[name]


def main_dspark(args: argparse.Namespace, model: Path, ids: list[int]) -> dict:
    # two engines a mode in a balanced start order (the docstring says why), the better of each column kept
    engines = []  # (mode, Timing) in start order
    for name in [*DSPARK_MODES, *reversed(DSPARK_MODES)]:
        env = {CONTEXT_KV_ENV: name} if DSPARK_MODES[name] else None
        engines.append((name, ttft(model, [ids], args.pcp_size, args.max_num_batched_tokens, DSPARK_MODES[name],
                                   args.repeats, env)[0]))
    runs = {name: [t for n, t in engines if n == name] for name in DSPARK_MODES}
    rows = {name: {"ttft_s": min(t.ttft_s for t in ts), "rank0_draft_s": min(t.rank0_draft_s for t in ts),
                   "draft_mode": ts[0].draft_mode, "context_gather_bytes": ts[0].context_gather_bytes,
                   "formula_bytes": dspark_bytes(args.prompt_len, args.max_num_batched_tokens, args.pcp_size, name),
                   "engines": [t._asdict() for t in ts]}
            for name, ts in runs.items()}
    compute = dspark_context_s(min(args.prompt_len, args.max_num_batched_tokens), args.pcp_size, args.repeats)
    base = rows["no drafter"]["ttft_s"]
    print(f"\n{'context K/V':>12}{'TTFT s':>8}{'TTFT - none s':>15}{'rank-0 drafter s':>18}{'bytes gathered':>16}"
          f"{'formula':>12}{'1-rank compute s':>18}")
    for name, r in rows.items():
        r["draft_prefill_s"] = r["ttft_s"] - base if name != "no drafter" else 0.0
        r["rank_context_compute_s"] = compute.get(name, 0.0)
        print(f"{name:>12}{r['ttft_s']:>8.2f}{r['draft_prefill_s']:>15.3f}{r['rank0_draft_s']:>18.3f}"
              f"{r['context_gather_bytes']:>16,.0f}{r['formula_bytes']:>12,}{r['rank_context_compute_s']:>18.4f}")
    print("\nper engine in start order, TTFT s / rank-0 drafter s: "
          + ", ".join(f"{name} {t.ttft_s:.2f} / {t.rank0_draft_s:.3f}" for name, t in engines))
    sharded, replicated = rows["sharded"], rows["replicated"]
    # the drafter's own time on rank 0: a TTFT difference of a few tens of ms is within the noise of the TTFT
    ratio = sharded["rank0_draft_s"] / max(replicated["rank0_draft_s"], 1e-9)
    print(f"\nsharded / replicated: rank-0 drafter time {ratio:.2f}, bytes gathered "
          f"{sharded['context_gather_bytes'] / max(replicated['context_gather_bytes'], 1):.2f}")
    return {"rows": rows, "sharded_over_replicated": ratio}


def main_mtp(args: argparse.Namespace, model: Path, config: dict) -> dict:
    """Each mode's engine prefills every asked length p."""
    budget, pcp = args.max_num_batched_tokens, args.pcp_size
    ids = random_token_ids(config["vocab_size"], max(args.prompt_len), 0)
    runs = {name: dict(zip(args.prompt_len, ttft(model, [ids[:n] for n in args.prompt_len], pcp, budget, spec,
                                                 args.repeats), strict=True)) for name, spec in MODES.items()}
    points = {}
    for p in args.prompt_len:
        base = runs["no drafter"][p].ttft_s
        rows = {name: {"ttft_s": r[p].ttft_s, "draft_mode": r[p].draft_mode,
                       "ttft_minus_none_s": r[p].ttft_s - base, "rank0_draft_s": r[p].rank0_draft_s,
                       "extra_gather_bytes": extra_bytes(config, p, budget, pcp, name)} for name, r in runs.items()}
        print(f"\nprompt {p} tokens, PCP={pcp}\n{'mode':>12}{'TTFT s':>9}{'TTFT - none s':>15}{'drafter s':>11}"
              f"{'extra bytes gathered':>22}")
        for name, r in rows.items():
            print(f"{name:>12}{r['ttft_s']:>9.2f}{r['ttft_minus_none_s']:>15.3f}{r['rank0_draft_s']:>11.3f}"
                  f"{r['extra_gather_bytes']:>22,}")
        ratio = rows["sharded"]["rank0_draft_s"] / max(rows["replicated"]["rank0_draft_s"], 1e-9)
        print(f"sharded / replicated drafter time = {ratio:.2f} (expect <= 0.6)")
        points[str(p)] = {"rows": rows, "sharded_over_replicated": ratio}
    return {"points": points, "per_length": {name: {n: t._asdict() for n, t in r.items()} for name, r in runs.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, nargs="+", default=[8192],
                   help="mtp: one or more lengths; dspark: one length")
    p.add_argument("--pcp-size", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=7,
                   help="timings per length, best kept (a 2k prefill is ~0.3 s: best of 3 moved 0.07-0.09 s)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--drafter", choices=("mtp", "dspark"), default="mtp",
                   help="mtp: sharded vs replicated draft prefill; dspark: sharded vs replicated context K/V")
    args = p.parse_args()
    if args.drafter == "dspark" and len(args.prompt_len) != 1:
        p.error(f"--prompt-len {args.prompt_len}: --drafter dspark takes one length")
    info = machine_info()
    longest = max(args.prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        shutil.copytree(DEFAULT_MODEL, model)
        config = json.loads((model / "config.json").read_text())
        config["max_position_embeddings"] = max(config["max_position_embeddings"], longest + 64)
        (model / "config.json").write_text(json.dumps(config))
        print(f"{info['cpu']}, {info['num_cores']} cores, torch {info['torch']}, "
              f"load {info['load_avg_1m_at_start']:.2f}")
        print(f"prompts of {args.prompt_len} tokens, PCP={args.pcp_size}, budget {args.max_num_batched_tokens}, "
              f"1 thread per rank, best of {args.repeats}, drafter {args.drafter}")
        if args.drafter == "dspark":
            args.prompt_len = longest
            result = main_dspark(args, model, random_token_ids(config["vocab_size"], longest, 0))
        else:
            result = main_mtp(args, model, config)
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "args": vars(args) | {"json": str(args.json)}, **result},
                                        indent=2))


if __name__ == "__main__":
    main()
