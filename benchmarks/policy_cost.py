"""What the "auto" policy itself costs a step: its choose and record_step (and their parts) timed inside a running
engine, then the same calls replayed in a tight loop from a snapshot of the policy; with --baseline REV, the replay
also runs REV's policy.py and cost_model.py (from git) on the same calls, and says whether both chose the same Ks.

    python benchmarks/policy_cost.py [--drafter ngram] [--batch 1] [--runs 4] [--baseline HEAD~1]

5-shot GSM8K, greedy, 64 tokens, the grid's stop strings (benchmarks/spec_policy.py). Inside the engine every part
runs after the model's step with the interpreter's caches cold, ~2x its replayed time; no fixed K pays any of it.
"""

from __future__ import annotations

import argparse
import collections
import copy
import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from spec_policy import STOP_STRINGS, drafter_spec, gsm8k_prompts

import tandem.engine.spec_acceptance as acceptance
import tandem.engine.spec_cost_model as cost_model
import tandem.engine.spec_policy as policy
from tandem import LLM, SamplingParams
from tandem.assets import DEFAULT_MODEL

PARTS = [(policy.SpecPolicy, "choose"), (policy.SpecPolicy, "record_step"), (policy.SpecPolicy, "expected"),
         (cost_model.LinearCostModel, "observe"), (cost_model.LinearCostModel, "refit"), (policy, "step_shape"),
         (acceptance.PositionRates, "observe_rows"), (acceptance.PositionRates, "estimates")]
Call = tuple[str, tuple, int]


def timed_parts(totals: collections.Counter) -> Callable[[], None]:
    """Wrap every part with a timer adding into `totals`; returns the undo."""
    saved = []
    for owner, name in PARTS:
        fn = getattr(owner, name)
        saved.append((owner, name, fn))

        def timed(*a, _fn=fn, _name=name, **kw):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                totals[_name] += time.perf_counter() - start

        setattr(owner, name, timed)
    return lambda: [setattr(owner, name, fn) for owner, name, fn in saved]  # type: ignore[func-returns-value]


def replay(snapshot: policy.SpecPolicy, calls: list[Call], cls: type | None = None, model_cls: type | None = None
           ) -> list[int]:
    p = copy.deepcopy(snapshot)
    if cls is not None:
        p.__class__ = cls
    if model_cls is not None:
        p.target.__class__ = p.draft.__class__ = model_cls
    ks = []
    for kind, args, _ in calls:
        if kind == "c":
            ks.append(p.choose(*args))
        else:
            p.record_step(*args)
    return ks


def load_revision(rev: str, folder: Path) -> tuple[ModuleType, ModuleType]:
    """REV's cost_model and policy modules, policy importing REV's cost_model."""
    def load(name: str, text: str) -> ModuleType:
        path = folder / f"{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    def show(path: str) -> str:
        return subprocess.check_output(["git", "show", f"{rev}:{path}"], text=True)

    old_costs = load("baseline_cost_model", show("tandem/engine/spec_cost_model.py"))
    old_policy = load("baseline_policy", show("tandem/engine/spec_policy.py").replace(
        "from tandem.engine.spec_cost_model import", "from baseline_cost_model import"))
    return old_costs, old_policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", choices=["mtp", "dspark", "ngram"], default="ngram")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--runs", type=int, default=4, help="batches generated while timing")
    p.add_argument("--replays", type=int, default=8, help="replays of the captured calls, best kept")
    p.add_argument("--baseline", default=None, help="a git revision whose policy also replays the calls")
    args = p.parse_args()
    texts = gsm8k_prompts(args.batch)
    params = SamplingParams(temperature=0, max_tokens=64, stop=STOP_STRINGS)
    llm = LLM(str(DEFAULT_MODEL), max_model_len=2048, speculative_config=drafter_spec(args.drafter, "auto", 3))
    try:
        llm.generate(texts, params, use_tqdm=False)  # warm-up: prefix cache, the policy's first fits
        pol = llm.engine.policy
        snapshot = copy.deepcopy(pol)
        calls: list[Call] = []
        live: collections.Counter = collections.Counter()
        undo = timed_parts(live)  # before the capture binds choose and record_step: they are timed parts too
        choose, record_step = pol.choose, pol.record_step

        def captured_choose(running, new_batch=False):  # type: ignore[no-untyped-def]
            k = choose(running, new_batch)
            calls.append(("c", (list(running), new_batch), k))
            return k

        def captured_record(plan, output, step_s, draft_s, calibration=False):  # type: ignore[no-untyped-def]
            calls.append(("r", (plan, output, step_s, draft_s), -1))
            record_step(plan, output, step_s, draft_s, calibration)

        pol.choose, pol.record_step = captured_choose, captured_record  # type: ignore[method-assign]
        start = time.perf_counter()
        for _ in range(args.runs):
            llm.generate(texts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        undo()
    finally:
        llm.shutdown()
    steps = sum(kind == "c" for kind, _, _ in calls)
    replay(snapshot, calls)  # warm
    parts_replayed: collections.Counter = collections.Counter()
    undo = timed_parts(parts_replayed)
    for _ in range(args.replays):
        replay(snapshot, calls)
    undo()
    ks = [k for kind, _, k in calls if kind == "c"]
    print(f"{args.drafter}, batch {args.batch}: {steps} steps, {1e3 * wall / steps:.2f} ms a step in the engine, "
          f"chosen K {dict(sorted(collections.Counter(ks).items()))}")
    print(f"{'part':>14}{'engine us/step':>16}{'replayed us/step':>18}{'ratio':>7}")
    for _, name in PARTS:
        engine_us, replay_us = 1e6 * live[name] / steps, 1e6 * parts_replayed[name] / args.replays / steps
        print(f"{name:>14}{engine_us:>16.1f}{replay_us:>18.1f}{engine_us / max(replay_us, 1e-9):>7.2f}")
    best = float("inf")
    for _ in range(args.replays):
        start = time.perf_counter()
        same = replay(snapshot, calls) == ks
        best = min(best, time.perf_counter() - start)
    print(f"replayed without timers: {1e6 * best / steps:.1f} us a step (choose + record_step), same Ks: {same}")
    if args.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            old_costs, old_policy = load_revision(args.baseline, Path(tmp))
            old_best, old_ks = float("inf"), []
            for _ in range(args.replays):
                start = time.perf_counter()
                old_ks = replay(snapshot, calls, old_policy.SpecPolicy, old_costs.LinearCostModel)
                old_best = min(old_best, time.perf_counter() - start)
        print(f"{args.baseline}: {1e6 * old_best / steps:.1f} us a step replayed (this tree {best / old_best:.2f}x "
              f"of it), same Ks as this tree: {old_ks == ks}")


if __name__ == "__main__":
    main()
