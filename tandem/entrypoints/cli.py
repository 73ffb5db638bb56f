"""`tandem` command line: generate (and convert-gguf); serve, eval and bench arrive with their issues."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tandem.config import ConfigError
from tandem.entrypoints.engine_args import EngineArgs


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for one or more prompts")
    p.add_argument("model", nargs="?", default=None, help="local Hugging Face model folder")
    p.add_argument("-p", "--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a text file with one prompt per line")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    EngineArgs.add_cli_args(p)


def _convert_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert-gguf", help="convert a GGUF file into a Hugging Face folder tandem can load")
    p.add_argument("gguf", help="path of the .gguf file")
    p.add_argument("output", help="folder to write (config.json, model.safetensors, tokenizer.json)")


def run_generate(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("tandem generate: give at least one prompt with -p/--prompt or --prompts-file", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    for out in outputs:
        completion = out.outputs[0]
        print(f"--- prompt: {out.prompt!r}")
        print(completion.text if out.error is None else f"[error] {out.error}")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"=== {len(outputs)} prompts, {num_tokens} generated tokens in {elapsed:.2f} s "
          f"({num_tokens / max(elapsed, 1e-9):.1f} tokens/s)")
    metrics = {m.name: m for m in llm.get_metrics()}
    if "tandem:spec_decode_num_drafts" in metrics:
        rate, length = (metrics[f"tandem:spec_decode_{n}"].value  # type: ignore[union-attr]
                        for n in ("acceptance_rate", "mean_acceptance_length"))
        print(f"=== speculative decoding: acceptance rate {rate:.3f}, mean acceptance length {length:.3f}")
    llm.shutdown()
    return 0 if all(o.error is None for o in outputs) else 1


def run_convert(args: argparse.Namespace) -> int:
    from tandem.tools.convert_gguf import convert_gguf

    print(convert_gguf(args.gguf, args.output))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _convert_parser(sub)
    args = parser.parse_args(argv)
    try:
        return {"generate": run_generate, "convert-gguf": run_convert}[args.command](args)
    except (ConfigError, ValueError) as e:
        print(f"tandem {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
