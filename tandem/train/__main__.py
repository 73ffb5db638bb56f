"""`python -m tandem.train`: rebuild the bundled model from scratch (tokenizer -> target + MTP -> DSpark).

    python -m tandem.train --out build/bundle --bundle   # the full run (about 45 min on 2 CPU cores)
    python -m tandem.train --out /tmp/t --target-steps 4 --dspark-steps 4   # a smoke run

Fixed seed; the run log (one JSON line per 10 steps) goes to OUT/train_log.jsonl and stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from tandem.data.gsm8k import SHARED_GSM8K, load_jsonl, synthetic_split

TARGET_NAME, DSPARK_NAME = "tandem-dsv3-tiny", "tandem-dsv3-tiny-dspark"
STAGES = ("tokenizer", "target", "dspark")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder that receives the checkpoint folders")
    p.add_argument("--data", default=str(SHARED_GSM8K / "train.jsonl"), help="GSM8K train.jsonl")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--target-steps", type=int, default=None, help="total target steps (default: the full run)")
    p.add_argument("--dspark-steps", type=int, default=None, help="DSpark steps (default: the full run)")
    p.add_argument("--distill-prompts", type=int, default=None, help="train questions the target answers for DSpark")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--bundle", action="store_true", help="then copy both folders into tandem/assets")
    p.add_argument("--resume-from", default=None, help="a saved target checkpoint to continue (with --start-phase)")
    p.add_argument("--start-phase", type=int, default=0, help="first target phase to run (a restart phase)")
    args = p.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        p.error(f"--stages: unknown stage(s) {unknown}; allowed: {list(STAGES)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target_dir, dspark_dir, tok_dir = out / TARGET_NAME, out / DSPARK_NAME, out / ".tokenizer"
    log_file = (out / "train_log.jsonl").open("a")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    gsm8k = load_jsonl(args.data)
    start = time.perf_counter()
    if "tokenizer" in stages:
        from tandem.train.tokenizer import train_tokenizer

        train_tokenizer(tok_dir, gsm8k + synthetic_split("train", 3000))
        log(json.dumps({"stage": "tokenizer", "elapsed_s": round(time.perf_counter() - start, 1)}))
    if "target" in stages:
        from tokenizers import Tokenizer

        from tandem.train.loop import DEFAULT_PHASES, save_target, train_target

        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        phases = DEFAULT_PHASES
        if args.target_steps is not None:  # a shortened run keeps the phase proportions
            total = sum(ph.steps for ph in DEFAULT_PHASES)
            phases = tuple(dataclasses.replace(ph, steps=max(1, ph.steps * args.target_steps // total))
                           for ph in DEFAULT_PHASES)
        log(json.dumps({"stage": "target", "phases": [vars(ph) for ph in phases]}))
        resume = Path(args.resume_from) if args.resume_from else None
        model, _ = train_target(gsm8k, lambda s: tok.encode(s, add_special_tokens=False).ids, phases,
                                seed=args.seed, log=log, start_phase=args.start_phase, resume_from=resume)
        save_target(model, tok_dir, target_dir)
        log(json.dumps({"stage": "target", "saved": str(target_dir),
                        "elapsed_s": round(time.perf_counter() - start, 1)}))
    if "dspark" in stages:
        from tandem.train.dspark import DEFAULT_DISTILL_PROMPTS, DEFAULT_DSPARK_STEPS, train_dspark

        train_dspark(target_dir, dspark_dir, gsm8k, steps=args.dspark_steps or DEFAULT_DSPARK_STEPS,
                     num_prompts=args.distill_prompts or DEFAULT_DISTILL_PROMPTS, seed=args.seed, log=log)
        log(json.dumps({"stage": "dspark", "saved": str(dspark_dir),
                        "elapsed_s": round(time.perf_counter() - start, 1)}))
    if args.bundle:
        from tandem.assets import ASSETS

        for folder in (target_dir, dspark_dir):
            shutil.copytree(folder, ASSETS / folder.name, dirs_exist_ok=True)
        log(json.dumps({"stage": "bundle", "into": str(ASSETS)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
