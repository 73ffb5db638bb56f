"""The machine's speed phases, and what they do to the "auto" K policy.

    python benchmarks/speed_phases.py machine [--batch 1] [--rounds 4]
    python benchmarks/speed_phases.py simulate [--slow 1.5] [--phase-steps 40] [--forgetting 0.98]

`machine`: times every decode step of a no-spec engine (bundled model, greedy, 64 tokens) and a fixed pure-Python
loop beside it, and prints each round's step times: on the 2-core dev machine both run in phases (a decode step
~5.4 ms for a few hundred steps, then ~7.8 ms; the loop 1.4 vs 2.9 ms) with nothing in the engine changing.

`simulate`: the policy (engine/spec_policy.py) on tests/test_spec_policy.py's synthetic worlds, every step's
seconds multiplied by a speed factor that flips between 1 and --slow after exponentially distributed phases of
--phase-steps steps on average; prints the expected rate of the K it chose over its last 400 of 500 steps, as a
share of the best fixed K's, for 6 seeds. --slow 1 is the phase-free baseline; --forgetting sets the cost fits'.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def machine(batch: int, rounds: int) -> None:
    from spec_policy import gsm8k_prompts

    from tandem import LLM, SamplingParams
    from tandem.assets import DEFAULT_MODEL

    texts = gsm8k_prompts(batch)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm = LLM(str(DEFAULT_MODEL), max_model_len=2048)
    llm.generate(texts, params, use_tqdm=False)

    def loop() -> float:
        start, s = time.perf_counter(), 0
        for i in range(2000):
            s += i
        return time.perf_counter() - start

    for r in range(rounds):
        for text in texts:
            llm.engine.add_request(text, params)
        steps, loops = [], []
        while llm.engine.has_unfinished_requests():
            loops.append(loop())
            start = time.perf_counter()
            llm.engine.step()
            steps.append(time.perf_counter() - start)
        print(f"round {r}: decode step ms " + " ".join(f"{1e3 * s:.1f}" for s in steps[1:]))
        print("         2,000-iteration loop us " + " ".join(f"{1e6 * s:.0f}" for s in loops[1:]))
    llm.shutdown()


def simulate(slow: float, phase_steps: int, forgetting: float) -> None:
    from test_spec_policy import K_MAX, Simulation, World

    from tandem.engine.spec_policy import SpecPolicy

    @dataclass
    class PhaseWorld(World):
        slow: float = 1.5
        phase_steps: int = 40
        seed: int = 0

        def __post_init__(self) -> None:
            self.rng, self.factor, self.left = random.Random(self.seed), 1.0, 0

        def seconds(self, num_tokens: int, k: int) -> tuple[float, float]:
            target, draft = World.seconds(self, num_tokens, k)
            return target * self.factor, draft * self.factor

        def tick(self) -> None:
            if self.left <= 0:
                self.factor = self.slow if self.factor == 1.0 else 1.0
                self.left = int(self.rng.expovariate(1 / self.phase_steps)) + 1
            self.left -= 1

    def run(sim: Simulation, world: PhaseWorld, steps: int) -> list[int]:
        chosen: list[int] = []
        for _ in range(steps):
            world.tick()
            chosen += sim.run(world, 1)
        return chosen

    print(f"phases {slow}x, ~{phase_steps} steps; cost fits' forgetting {forgetting}")
    for alpha, batch in [(0.6, 1), (0.75, 4), (0.5, 16), (0.9, 1), (0.3, 1), (0.45, 8)]:
        base = World(alpha)
        best = base.rate(batch, base.best_k(batch))
        shares = []
        for seed in range(1, 7):
            world = PhaseWorld(alpha, slow=slow, phase_steps=phase_steps, seed=seed)
            policy = SpecPolicy(K_MAX)
            policy.target.forgetting = policy.draft.forgetting = forgetting
            sim = Simulation(policy, batch, seed=seed)
            run(sim, world, 100)
            chosen = run(sim, world, 400)
            tokens = sum(batch * sum(alpha ** j for j in range(k + 1)) for k in chosen)
            seconds = sum(sum(base.seconds(batch * (1 + k), k)) for k in chosen)
            shares.append(tokens / seconds / best)
        rates = [base.rate(batch, k) / best for k in range(K_MAX + 1)]
        print(f"  acceptance {alpha}, batch {batch:>2}: fixed K {np.round(rates, 3).tolist()}; auto "
              f"{np.round(shares, 3).tolist()}, mean {np.mean(shares):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("machine")
    m.add_argument("--batch", type=int, default=1)
    m.add_argument("--rounds", type=int, default=4)
    s = sub.add_parser("simulate")
    s.add_argument("--slow", type=float, default=1.5)
    s.add_argument("--phase-steps", type=int, default=40)
    s.add_argument("--forgetting", type=float, default=0.98)
    a = p.parse_args()
    if a.mode == "machine":
        machine(a.batch, a.rounds)
    else:
        simulate(a.slow, a.phase_steps, a.forgetting)


if __name__ == "__main__":
    main()
