"""gpu_check.py's checks at a realistic size: one random checkpoint (tandem/bench/random_model.py) run in turn by tandem
eager, tandem compiled without graphs, tandem compiled with PIECEWISE CUDA graphs and Hugging Face (one of them on the
GPU at a time): greedy tokens against each other, decode tok/s per batch size beside the HBM bandwidth bound, and
TTFT per prompt length. Each row of a compiled runner says how many graphs its engine captured and replayed meanwhile.

Decode: B random prompts of `decode_prompt_len` tokens, greedy, EOS ignored, after a 4-token warm-up at the same
batch (the graphs of batch B are captured there); TPOT = (wall of 1 + N tokens - wall of 1 token) / N, one run each,
tok/s = B / TPOT. Bytes a step = weights read (all of them but an untied embedding table, whose B rows are noise;
of each MoE layer's routed experts the expected share that B rows touch, 1 - (1 - k/E)^B, routing taken as uniform,
which a random router nearly is) + B x KV bytes a token x the mean context; HBM share = bytes a step / TPOT / HBM.
TTFT: the wall of one prompt's first token (tandem: `generate`, max_tokens=1; HF: one forward, last logits only),
the best of 2 after a warm-up prompt of the same length. Prefix caching is off: timed prompts repeat.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tandem.bench.model_work import kv_bytes_per_token
from tandem.bench.offline import HFRunner, TandemRunner, timed
from tandem.bench.prompts import random_token_ids
from tandem.entrypoints.engine_args import EngineArgs

RUNNERS = ("tandem-eager", "tandem-compiled", "tandem-graphs", "hf")
# tandem-compiled: the same compiled pieces as tandem-graphs, uncaptured (issue 47's 1.3x is graphs over this)
COMPILED_NO_GRAPHS = {"mode": "VLLM_COMPILE", "cudagraph_mode": "NONE"}
COMPILED_RUNNERS = ("tandem-compiled", "tandem-graphs")
SECTIONS = ("realistic", "decode", "ttft")
PARITY_PROMPTS, PARITY_PROMPT_LEN, PARITY_TOKENS = 8, 32, 32
WARMUP_TOKENS = 4  # 3 decode steps at the batch: its graphs warm up, are recorded, replay


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: str  # compute dtype of the realistic checkpoints (bfloat16; float32 for an exact CPU check)
    sections: frozenset[str]  # of SECTIONS
    runners: tuple[str, ...]  # of RUNNERS, run in this order
    decode_batches: tuple[int, ...]
    decode_prompt_len: int
    decode_tokens: int  # N, timed beyond the first token
    ttft_lens: tuple[int, ...]
    attention_config: dict[str, Any] | None
    graphs_config: dict[str, Any]  # compilation_config of tandem-graphs
    hbm_bytes_per_s: float

    def max_batch(self) -> int:
        return max((*self.decode_batches, PARITY_PROMPTS))


class Peer(Protocol):
    def generate(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]: ...
    def first_token(self, ids: list[int]) -> int: ...
    def graph_counters(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class TandemPeer(TandemRunner):
    def generate(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        from tandem import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def first_token(self, ids: list[int]) -> int:
        return self.generate([ids], 1)[0][0]

    def graph_counters(self) -> dict[str, int]:
        return graph_counters(self.llm)

    def close(self) -> None:
        self.llm.shutdown()
        _free_device_memory()


class HFPeer(HFRunner):
    """`model.generate` on all prompts as one batch (they are of one length: no padding)."""

    def __init__(self, model: str, dtype: torch.dtype, device: str):
        super().__init__(model, dtype, device, batch_size=1 << 30)

    @torch.inference_mode()
    def first_token(self, ids: list[int]) -> int:
        logits = self.model(torch.tensor([ids], device=self.device), logits_to_keep=1).logits  # [1, 1, V]
        return int(logits[0, -1].argmax())

    def graph_counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        del self.model
        _free_device_memory()


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def graph_counters(llm: Any) -> dict[str, int]:
    """The PIECEWISE CUDA graphs of an engine's compiled forwards, the target's and each MTP layer's (a GraphRun
    each, tandem/compilation/piecewise.py): graphs captured (pieces x capture sizes), piece replays, and forwards
    whose capture failed (they run uncaptured). Empty where no forward has graphs: eager, compiled without graphs, a
    forward that broke and was recompiled without them (logged), or ranks in other processes."""
    runner = getattr(llm.engine.executor, "runner", None)
    if runner is None:
        return {}
    mtp = getattr(runner.model, "mtp", None)
    forwards = [runner.model.forward, *(layer.forward for layer in (mtp.layers if mtp is not None else []))]
    runs = [run for forward in forwards if (run := getattr(forward, "graphs", None)) is not None]
    if not runs:
        return {}
    return {"captured": sum(r.num_captured for r in runs), "replays": sum(r.num_replays for r in runs),
            "failed": sum(r.failed for r in runs)}


def graphs_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Graphs captured and replayed from `before` to `after` (graph_counters), and the forwards failed by then."""
    if not after:
        return {}
    return {"captured": after["captured"] - before.get("captured", 0),
            "replays": after["replays"] - before.get("replays", 0), "failed": after["failed"]}


def graph_cells(graphs: dict[str, int]) -> str:
    if not graphs:
        return "no graphs"
    failed = f", capture FAILED in {graphs['failed']} forward(s), run uncaptured" if graphs["failed"] else ""
    return f"graphs: {graphs['captured']} captured, {graphs['replays']} replays{failed}"


def open_peer(kind: str, folder: Path, config: dict[str, Any], plan: Plan) -> Peer:
    if kind == "hf":
        return HFPeer(str(folder), getattr(torch, plan.dtype), plan.device)
    elem = getattr(torch, plan.dtype).itemsize
    per_token = kv_bytes_per_token(config, elem) * config["num_hidden_layers"]
    longest = max((plan.decode_prompt_len + plan.decode_tokens + 1, PARITY_PROMPT_LEN + PARITY_TOKENS,
                   *(n + 1 for n in plan.ttft_lens)))
    pool_tokens = max(plan.max_batch() * (plan.decode_prompt_len + plan.decode_tokens + 17), longest + 16)
    args = EngineArgs(model=str(folder), device=plan.device, dtype=plan.dtype, max_model_len=longest,
                      max_num_seqs=plan.max_batch(), max_num_batched_tokens=max(2048, *plan.ttft_lens),
                      kv_cache_memory_bytes=int(1.2 * pool_tokens * per_token) + (64 << 20),
                      enable_prefix_caching=False, attention_config=plan.attention_config,
                      compilation_config={"tandem-compiled": COMPILED_NO_GRAPHS,
                                          "tandem-graphs": plan.graphs_config}.get(kind))
    return TandemPeer(args)


def weight_bytes_per_step(folder: Path, config: dict[str, Any], batch: int, elem: int) -> float:
    """Weight bytes one decode step of `batch` rows reads (the module docstring says which)."""
    from safetensors import safe_open

    experts, top_k = config.get("n_routed_experts"), config.get("num_experts_per_tok")
    touched = 1 - (1 - top_k / experts) ** batch if experts else 1.0
    total = 0.0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name == "model.embed_tokens.weight" and not config.get("tie_word_embeddings"):
                    continue
                numel = torch.Size(f.get_slice(name).get_shape()).numel()
                total += numel * elem * (touched if ".mlp.experts." in name else 1.0)
    return total


def decode_point(peer: Peer, folder: Path, config: dict[str, Any], plan: Plan, batch: int) -> dict[str, float]:
    prompts = [random_token_ids(config["vocab_size"], plan.decode_prompt_len, 1000 + row) for row in range(batch)]
    peer.generate(prompts, WARMUP_TOKENS)
    one, _ = timed("one token", peer, prompts, 1)
    many, _ = timed(f"{1 + plan.decode_tokens} tokens", peer, prompts, 1 + plan.decode_tokens)
    tpot = (many - one) / plan.decode_tokens
    elem = getattr(torch, plan.dtype).itemsize
    context = plan.decode_prompt_len + 1 + plan.decode_tokens / 2
    step_bytes = (weight_bytes_per_step(folder, config, batch, elem)
                  + batch * kv_bytes_per_token(config, elem) * config["num_hidden_layers"] * context)
    return {"tok_s": batch / tpot, "tpot_ms": tpot * 1e3, "step_bytes": step_bytes,
            "hbm_fraction": step_bytes / tpot / plan.hbm_bytes_per_s}


def ttft_point(peer: Peer, config: dict[str, Any], length: int) -> float:
    """Seconds to the first token of a `length`-token prompt."""
    peer.first_token(random_token_ids(config["vocab_size"], length, 7 * length))
    walls = []
    for seed in (1, 2):
        ids = random_token_ids(config["vocab_size"], length, 7 * length + seed)
        start = time.perf_counter()
        peer.first_token(ids)
        walls.append(time.perf_counter() - start)
    return min(walls)


def compare(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """Outputs identical to the reference's, and the mean length of the common prefix."""
    same = sum(a == b for a, b in zip(tokens, reference, strict=True))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
              for a, b in zip(tokens, reference, strict=True)]
    return same, sum(prefix) / len(prefix)


def check_model(table: Any, name: str, folder: Path, plan: Plan) -> dict[str, Any]:
    """Every runner of `plan` on the checkpoint in `folder`, a table row per measurement; the results."""
    config = json.loads((folder / "config.json").read_text())
    results: dict[str, Any] = {"runners": {}, "parity": {}}
    for kind in plan.runners:
        out = results["runners"][kind] = {"decode": {}, "ttft_s": {}, "graphs": {}}
        peers: list[Peer] = []

        def load(kind: str = kind, peers: list[Peer] = peers) -> tuple[str, bool]:
            peers.append(open_peer(kind, folder, config, plan))
            return "loaded", True

        table.check(f"{name} {kind}: load",
                    _with_graphs(kind, "load", out, load, lambda peers=peers: peers[0] if peers else None))
        if peers:
            try:
                _measure(table, f"{name} {kind}", peers[0], kind, folder, config, plan, results)
            finally:
                peers[0].close()
    return results


def _with_graphs(kind: str, what: str, out: dict[str, Any], fn: Callable[[], tuple[str, bool]],
                 peer: Callable[[], Peer | None]) -> Callable[[], tuple[str, bool]]:
    """`fn`'s row and, for a compiled runner, the graphs its engine captured and replayed during it (also kept in
    out["graphs"][what]). A tandem-graphs row fails where a capture failed, where loading (whose warmup captures
    every capture size) captured none, and where a decode (every decode batch is a capture size) replayed none."""
    if kind not in COMPILED_RUNNERS:
        return fn

    def counters() -> dict[str, int]:
        now = peer()  # None before the load row has made it
        return now.graph_counters() if now is not None else {}

    def row() -> tuple[str, bool]:
        before = counters()
        cells, passed = fn()
        graphs = out["graphs"][what] = graphs_between(before, counters())
        if kind == "tandem-graphs":
            needed = {"load": "captured", "decode": "replays"}.get(what.split()[0])
            passed = passed and bool(graphs) and not graphs["failed"] and (needed is None or graphs[needed] > 0)
        return f"{cells}; {graph_cells(graphs)}", passed

    return row


def _measure(table: Any, label: str, peer: Peer, kind: str, folder: Path, config: dict[str, Any], plan: Plan,
             results: dict[str, Any]) -> None:
    out: dict[str, Any] = results["runners"][kind]
    if "realistic" in plan.sections:
        prompts = [random_token_ids(config["vocab_size"], PARITY_PROMPT_LEN, 100 + i) for i in range(PARITY_PROMPTS)]
        table.check(f"{label}: greedy, {PARITY_PROMPTS} prompts x {PARITY_TOKENS} tokens",
                    _with_graphs(kind, "greedy", out, lambda: _greedy(peer, prompts, kind, results, plan),
                                 lambda: peer))
    for batch in plan.decode_batches * ("decode" in plan.sections):
        def decode(batch: int = batch) -> tuple[str, bool]:
            point = out["decode"][batch] = decode_point(peer, folder, config, plan, batch)
            return (f"{point['tok_s']:.1f} tok/s (TPOT {point['tpot_ms']:.2f} ms), "
                    f"{100 * point['hbm_fraction']:.1f}% of HBM"), True
        table.check(f"{label}: decode batch {batch}", _with_graphs(kind, f"decode {batch}", out, decode, lambda: peer))
    for length in plan.ttft_lens * ("ttft" in plan.sections):
        def ttft(length: int = length) -> tuple[str, bool]:
            out["ttft_s"][length] = ttft_point(peer, config, length)
            return f"{out['ttft_s'][length] * 1e3:.1f} ms", True
        table.check(f"{label}: TTFT {length} tokens", _with_graphs(kind, f"ttft {length}", out, ttft, lambda: peer))


def _greedy(peer: Peer, prompts: list[list[int]], kind: str, results: dict[str, Any], plan: Plan) -> tuple[str, bool]:
    """Greedy tokens, compared with those of the first runner of RUNNERS that has run (tandem eager's, mostly)."""
    runners = results["runners"]
    _, runners[kind]["tokens"] = timed(kind, peer, prompts, PARITY_TOKENS)
    reference = next((r for r in RUNNERS if r != kind and "tokens" in runners.get(r, {})), None)
    if reference is None:
        return "reference tokens", True
    same, prefix = compare(runners[kind]["tokens"], runners[reference]["tokens"])
    results["parity"][f"{kind} vs {reference}"] = same
    # bfloat16 rounding may flip a near-tie argmax (and with it the rest of that output); float32 must match
    return (f"{same}/{len(prompts)} identical to {reference} (mean common prefix {prefix:.1f}/{PARITY_TOKENS})",
            plan.dtype != "float32" or same == len(prompts))


# the summary's ratio columns: graphs over the same pieces uncaptured (issue 47's 1.3x), then over eager and HF
RATIOS = (("tandem-graphs", "tandem-compiled"), ("tandem-graphs", "tandem-eager"), ("tandem-compiled", "tandem-eager"),
          ("tandem-graphs", "hf"), ("tandem-eager", "hf"))


def summary(name: str, results: dict[str, Any], plan: Plan) -> list[str]:
    """One markdown table of the model's decode and TTFT figures, a column per runner, then the ratios."""
    runs = results["runners"]
    kinds = [k for k in plan.runners if k in runs]
    ratios = [(a, b) for a, b in RATIOS if a in runs and b in runs]
    lines = [f"| {name} ({plan.dtype}) | " + " | ".join(kinds) + "".join(f" | {a} / {b}" for a, b in ratios) + " |",
             "|---" * (1 + len(kinds) + len(ratios)) + "|"]
    for batch in plan.decode_batches:
        cells = [f"{p['tok_s']:.1f} ({100 * p['hbm_fraction']:.0f}% HBM)" if (p := runs[k]["decode"].get(batch))
                 else "-" for k in kinds]
        cells += [_ratio(runs[a]["decode"].get(batch, {}).get("tok_s"), runs[b]["decode"].get(batch, {}).get("tok_s"))
                  for a, b in ratios]
        lines.append(f"| decode batch {batch}: tok/s (share of HBM) | " + " | ".join(cells) + " |")
    for length in plan.ttft_lens:
        cells = [f"{s * 1e3:.1f}" if (s := runs[k]["ttft_s"].get(length)) else "-" for k in kinds]
        # a speedup in TTFT is the inverse ratio of the times
        cells += [_ratio(runs[b]["ttft_s"].get(length), runs[a]["ttft_s"].get(length)) for a, b in ratios]
        lines.append(f"| TTFT {length} tokens: ms | " + " | ".join(cells) + " |")
    return lines


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """Issue 47's targets for the Llama-1B-shaped model: (target, measured, met; None where not measured, or for a
    reference row, which has no bar)."""
    runs, parity = results["runners"], results["parity"]

    def decode(kind: str, batch: int, key: str = "tok_s") -> float | None:
        return runs.get(kind, {}).get("decode", {}).get(batch, {}).get(key)

    rows: list[tuple[str, str, bool | None]] = []
    graphs = runs.get("tandem-graphs", {}).get("graphs", {})
    captured, replays = graphs.get("load", {}).get("captured"), graphs.get("decode 1", {}).get("replays")
    rows.append(("graphs captured at load and replayed in batch-1 decode",
                 "-" if replays is None else f"{captured} captured, {replays} replays",
                 None if replays is None else bool(captured) and replays > 0))
    share = decode("tandem-graphs", 1, "hbm_fraction")
    rows.append(("batch-1 decode (graphs) >= 70% of HBM bandwidth", f"{100 * share:.1f}%" if share else "-",
                 share >= 0.7 if share else None))
    for label, (a, b), bar in (("batch 32 (graphs) >= 5x HF generate", (("tandem-graphs", 32), ("hf", 32)), 5.0),
                               ("graphs >= 1.3x uncaptured (compiled, no graphs) at batch 1",
                                (("tandem-graphs", 1), ("tandem-compiled", 1)), 1.3),
                               ("graphs / eager at batch 1 (reference)",
                                (("tandem-graphs", 1), ("tandem-eager", 1)), None)):
        x, y = decode(*a), decode(*b)
        rows.append((label, _ratio(x, y), x / y >= bar if x and y and bar else None))
    pairs = ("tandem-graphs vs tandem-eager", "hf vs tandem-eager")
    counts = [parity.get(p) for p in pairs]
    rows.append(("greedy tokens (graphs) equal eager and HF",
                 ", ".join(f"{p}: {c}/{PARITY_PROMPTS}" for p, c in zip(pairs, counts, strict=True) if c is not None)
                 or "-", all(c == PARITY_PROMPTS for c in counts) if None not in counts else None))
    return rows
