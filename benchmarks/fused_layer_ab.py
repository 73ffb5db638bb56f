"""Decode steps with the fused decoder layer (tandem/native/decoder_layer.cpp) against the module path, in one
engine: the two take turns round by round, so a machine whose speed drifts slows both alike. The figures behind
docs/kernels.md's "Fused decoder layers" table.

    python benchmarks/fused_layer_ab.py MODEL_DIR [--dtype float32] [--batch 1 32] [--rounds 5]

Each batch size: `batch` random 128-token prompts, greedy; a decode step's time is (time of prompt + 33 tokens -
time of prompt + 1 token) / 32. One line per batch size: each round's ms a step on both paths, their medians'
ratio, and whether the 24-token greedy outputs of both are identical.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tandem import LLM, SamplingParams
from tandem.models import fused_decoder_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    vocab = llm.engine.config.model_config.hf.vocab_size
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads")
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        prompts = [{"prompt_token_ids": torch.randint(100, min(vocab, 40000), (128,), generator=gen).tolist()}
                   for _ in range(batch)]

        def generate(n: int, prompts: list[dict] = prompts) -> list[list[int]]:
            sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

        def step_ms(generate: Callable[[int], list[list[int]]] = generate) -> float:
            t0 = time.perf_counter()
            generate(1)
            t1 = time.perf_counter()
            generate(33)
            return ((time.perf_counter() - t1) - (t1 - t0)) / 32 * 1e3

        fused_decoder_layer.enabled = False
        reference = generate(24)
        fused_decoder_layer.enabled = True
        identical = generate(24) == reference
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for on in (False, True):
                fused_decoder_layer.enabled = on
                times[on].append(step_ms())
        fused_decoder_layer.enabled = True
        module, fused = statistics.median(times[False]), statistics.median(times[True])
        print(f"batch {batch}: module path {' '.join(f'{t:.1f}' for t in times[False])} ms, fused "
              f"{' '.join(f'{t:.1f}' for t in times[True])} ms; medians {module:.2f} / {fused:.2f} = "
              f"{module / fused:.2f}x; identical outputs: {identical}")


if __name__ == "__main__":
    main()
