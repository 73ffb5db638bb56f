"""Paired A/B of two "auto" K policies at one point: "auto" (this tree) and "auto_b" (the same policy with some of
its attributes overridden after start-up), beside no-spec and every fixed K, all in one interleaved run
(spec_policy.run_point: the engines take turns of 8 steps, so a drift of the machine's speed hits all alike).

    python benchmarks/spec_policy_ab.py --batch 8 --drafter dspark --repeats 10 --explore-at-k1
    python benchmarks/spec_policy_ab.py --batch 8 --drafter mtp --prompts long --set target.forgetting=0.995 \
        draft.forgetting=0.995

Reported: the median over rounds of auto / auto_b (paired, round by round), each variant's paired median over the
best fixed config, and the K each chose. On the 2-core dev machine a point's best-of-rounds figures move by 10-20%
between runs (the machine runs in fast and slow phases, ~1.45x apart, lasting a few hundred steps); the paired
ratio of two engines that share every round is what a policy change can be judged by.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import spec_policy as sp

from tandem import LLM

FIXED = ("no-spec", "K=1", "K=2", "K=3")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--drafter", choices=["mtp", "dspark", "ngram"], default="mtp")
    p.add_argument("--prompts", choices=["gsm8k", "long"], default="gsm8k")
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--set", nargs="*", default=[], metavar="ATTR=VALUE",
                   help="auto_b's policy attributes (dotted, float values), e.g. target.forgetting=0.995")
    p.add_argument("--explore-at-k1", action="store_true",
                   help="auto_b explores at K = 1 always (the policy before 2026-12-04's nineteenth session)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    overrides = {k: float(v) for k, v in (s.split("=", 1) for s in a.set)}
    if not overrides and not a.explore_at_k1:
        p.error("nothing to compare: give --set and/or --explore-at-k1")

    def make_llm(model: str, speculative_config: dict | None = None, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
        spec = dict(speculative_config) if speculative_config else None
        variant = spec.pop("_variant", False) if spec else False
        llm = LLM(model, speculative_config=spec, **kwargs)
        if variant:
            policy = llm.engine.policy
            for path, value in overrides.items():
                *head, last = path.split(".")
                obj = policy
                for name in head:
                    obj = getattr(obj, name)
                setattr(obj, last, value)
            if a.explore_at_k1:
                policy._exploring_k = lambda rate: 1
        return llm

    sp.LLM = make_llm  # run_point builds its engines through this name
    args = argparse.Namespace(max_tokens=a.max_tokens, dtype="float32", max_num_batched_tokens=2048,
                              kv_cache_gib=0.25, repeats=a.repeats, interleave=8, max_k=3)
    with tempfile.TemporaryDirectory() as tmp:
        model, max_len = str(sp.DEFAULT_MODEL), 2048
        if a.prompts == "long":  # as spec_policy.main: a copy whose max_position_embeddings fits the prompts
            model = str(Path(tmp) / "model")
            shutil.copytree(sp.DEFAULT_MODEL, model)
            cfg_path = Path(model) / "config.json"
            cfg = json.loads(cfg_path.read_text())
            max_len = a.long_len + 2 * a.max_tokens + 64
            cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), max_len)
            cfg_path.write_text(json.dumps(cfg))
        texts = sp.long_prompts(model, a.batch, a.long_len) if a.prompts == "long" else sp.gsm8k_prompts(a.batch)
        configs: dict[str, dict | None] = {"no-spec": None}
        configs |= {f"K={k}": sp.drafter_spec(a.drafter, k, 3) for k in (1, 2, 3)}
        configs["auto"] = sp.drafter_spec(a.drafter, "auto", 3)
        configs["auto_b"] = sp.drafter_spec(a.drafter, "auto", 3) | {"_variant": True}
        measured = sp.run_point(model, configs, texts, args, max_len)
    rounds = {name: np.array(r["round_tokens_per_s"]) for name, r in measured.items()}

    def vs_best(name: str) -> float:
        return min(float(np.median(rounds[name] / rounds[f])) for f in FIXED)

    ratio = rounds["auto"] / rounds["auto_b"]
    print(f"{a.prompts} batch {a.batch} {a.drafter}, {a.repeats} rounds; auto_b: {a.set or ''}"
          f"{' explore at K = 1' if a.explore_at_k1 else ''}")
    print("  best round tok/s: " + ", ".join(f"{n} {v.max():.0f}" for n, v in rounds.items()))
    print(f"  auto / auto_b paired {np.median(ratio):.3f} (rounds {np.round(ratio, 2).tolist()}); paired vs the "
          f"best fixed config: auto {vs_best('auto'):.3f}, auto_b {vs_best('auto_b'):.3f}")
    for name in ("auto", "auto_b"):
        print(f"  {name} chose K {measured[name]['chosen_k']}, full steps {measured[name]['full_step_prices']}")
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "measured": measured}, indent=2,
                                     default=str))


if __name__ == "__main__":
    main()
