"""`tandem train draft-head TARGET --out HEAD`: distil -> features -> draft vocabulary -> train -> export.
Every stage writes under the work folder (data, features, checkpoint, train_log.jsonl); a rerun skips what exists."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from tandem.train.draft_head.distill import Distiller, DistillPlan, read_rows
from tandem.train.draft_head.export import save_head
from tandem.train.draft_head.features import FeatureStore, TargetModel, chunk_done, compute_chunk
from tandem.train.draft_head.head import DraftHead
from tandem.train.draft_head.loop import LoopConfig, split, train
from tandem.train.draft_head.objective import init_from_target_layer, init_head, warm_start
from tandem.train.draft_head.target_config import aux_layer_ids, eagle3_config, head_shape, read_target_config
from tandem.train.draft_head.vocab import build_vocab, coverage, heldout_coverage, response_counts

MIN_RESPONSE_TOKENS = 4


@dataclass(frozen=True)
class DraftHeadArgs:
    target: Path
    out: Path  # the head folder written at the end
    work: Path  # data, features, checkpoints, log
    gsm8k: Path
    num_prompts: int = 3000
    magpie_share: float = 0.5
    max_tokens: int = 256
    distill_dtype: str = "float32"
    draft_vocab_size: int = 16384
    ttt_steps: int = 3
    epochs: int = 3
    batch_tokens: int = 4096
    lr: float = 1e-3
    seed: int = 0
    threads: int | None = None
    max_hours: float = 24.0
    bf16: bool = True
    init_from: Path | None = None  # a trained head folder to continue from
    init_layer: str = "target"  # "target": the decoder layer starts as the target's last aux layer; "random"
    max_steps: int | None = None  # optimizer steps at most (the schedule's length when shorter than the epochs')
    prompt_offset: int = 0  # the first GSM8K question (in the seed's order) and Magpie seed offset this run uses
    exclude_data: tuple[Path, ...] = ()  # earlier work folders whose answered GSM8K questions are skipped
    renumber: bool = False  # GSM8K questions with their numbers redrawn (seeded)
    reuse_data: tuple[Path, ...] = ()  # earlier work folders whose data and features join this run's training set

    def validate(self, target_vocab_size: int) -> None:
        checks = [("num_prompts", self.num_prompts >= 1, "at least 1"),
                  ("magpie_share", 0.0 <= self.magpie_share <= 1.0, "0 to 1"),
                  ("max_tokens", self.max_tokens >= 4, "at least 4"),
                  ("distill_dtype", self.distill_dtype in ("float32", "bfloat16"), "float32 or bfloat16"),
                  ("draft_vocab_size", 1 <= self.draft_vocab_size <= target_vocab_size,
                   f"1 to the target's vocab_size {target_vocab_size}"),
                  ("ttt_steps", 1 <= self.ttt_steps <= 8, "1 to 8"), ("epochs", self.epochs >= 1, "at least 1"),
                  ("batch_tokens", self.batch_tokens >= 16, "at least 16"), ("lr", self.lr > 0, "above 0"),
                  ("max_hours", self.max_hours > 0, "above 0"),
                  ("max_steps", self.max_steps is None or self.max_steps >= 1, "at least 1"),
                  ("prompt_offset", self.prompt_offset >= 0, "0 or more"),
                  ("init_layer", self.init_layer in ("target", "random"), "target or random")]
        if self.init_from is not None:
            checks.append(("init_from", (self.init_from / "model.safetensors").is_file()
                           and (self.init_from / "config.json").is_file(),
                           "a head folder holding config.json and model.safetensors"))
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r} is not allowed: {allowed}")


class JsonLog:
    def __init__(self, path: Path):
        self.path = path

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps({"time": round(time.time(), 1), **record})
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def target_tensors(target: Path, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The target checkpoint's tensors whose names `wanted` accepts, float32, over every safetensors file."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if wanted(key):
                    tensors[key] = fh.get_tensor(key).float()
    return tensors


def target_embed_and_head(target: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and LM head [V, H] (the embedding when tied), float32."""
    tensors = target_tensors(target, lambda key: key in ("model.embed_tokens.weight", "lm_head.weight"))
    embed = tensors["model.embed_tokens.weight"]
    return embed, tensors.get("lm_head.weight", embed)


def target_layer_tensors(target: Path, layer: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The target's decoder layer `layer` (names below `model.layers.N.`) and its final norm, float32."""
    prefix = f"model.layers.{layer}."
    tensors = target_tensors(target, lambda key: key.startswith(prefix) or key == "model.norm.weight")
    missing = [name for name in ("model.norm.weight", f"{prefix}self_attn.q_proj.weight", f"{prefix}mlp.up_proj.weight")
               if name not in tensors]
    if missing:
        raise ValueError(f"{target}: --init-layer target needs {', '.join(missing)}, not among its safetensors "
                         "(--init-layer random starts without them)")
    norm = tensors.pop("model.norm.weight")
    return {key[len(prefix):]: t for key, t in tensors.items()}, norm


def end_token_ids(target: Path, raw: dict[str, Any]) -> list[int]:
    """The eos / end-of-turn ids: config's eos_token_id(s) and the tokenizer's eos token."""
    from transformers import AutoTokenizer

    eos = raw.get("eos_token_id")
    ids = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    tok_eos = AutoTokenizer.from_pretrained(str(target)).eos_token_id
    return sorted({*ids, *([tok_eos] if tok_eos is not None else [])})


def reused_chunks(work_dirs: tuple[Path, ...], aux_width: int) -> list[tuple[Path, list[dict[str, Any]]]]:
    """(feature stem, rows) of every chunk an earlier run's work folder finished, rows filtered as this run's are.
    The features must have been computed for this run's aux layers (the same target and head shape)."""
    out = []
    for work in work_dirs:
        data = sorted((work / "data").glob("*.jsonl")) if (work / "data").is_dir() else []
        stems = [work / "features" / p.stem for p in data]
        if not data or not all(chunk_done(s) for s in stems):
            raise ValueError(f"--reuse-data {work}: no finished data/ and features/ chunks there (a `tandem train "
                             "draft-head` work folder whose run got past its features)")
        for p, stem in zip(data, stems, strict=True):
            rows = [r for r in read_rows([p]) if len(r["ids"]) - r["response_start"] >= MIN_RESPONSE_TOKENS]
            want = (sum(len(r["ids"]) for r in rows), aux_width)
            shape = np.load(f"{stem}.aux.npy", mmap_mode="r").shape
            if shape != want:
                raise ValueError(f"--reuse-data {work}: {stem.name}'s features are {list(shape)}, this target's "
                                 f"aux layers need {list(want)} (another target or aux layers)")
            out.append((stem, rows))
    return out


def run(args: DraftHeadArgs) -> Path:
    started = time.time()
    raw = read_target_config(args.target)
    args.validate(raw["vocab_size"])
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    log = JsonLog(args.work / "train_log.jsonl")
    log({"stage": "start", "target": str(args.target), **{k: str(v) for k, v in vars(args).items()}})

    t0 = time.time()
    paths = Distiller(DistillPlan(args.target, args.work, args.gsm8k, args.num_prompts, args.magpie_share,
                                  args.max_tokens, args.seed, args.distill_dtype, args.prompt_offset,
                                  args.exclude_data, args.renumber)).run()
    chunks = [(p, [r for r in read_rows([p]) if len(r["ids"]) - r["response_start"] >= MIN_RESPONSE_TOKENS])
              for p in paths]
    rows = [r for _, rs in chunks for r in rs]
    reused = reused_chunks(args.reuse_data, len(aux_layer_ids(raw)) * raw["hidden_size"])
    rows += [r for _, rs in reused for r in rs]
    log({"stage": "distill", "seconds": round(time.time() - t0, 1), "sequences": len(rows),
         "reused_sequences": sum(len(rs) for _, rs in reused),
         "response_tokens": sum(len(r["ids"]) - r["response_start"] for r in rows),
         "total_tokens": sum(len(r["ids"]) for r in rows),
         "truncated": sum(r["finish_reason"] == "length" for r in rows)})

    t0 = time.time()
    feature_dir = args.work / "features"
    feature_dir.mkdir(exist_ok=True)
    stems = [(feature_dir / p.stem, rs) for p, rs in chunks]
    missing = [(stem, rs) for stem, rs in stems if not chunk_done(stem)]
    stems += reused
    if missing:
        target_model = TargetModel(args.target, aux_layer_ids(raw))
        for stem, rs in missing:
            compute_chunk(target_model, rs, stem, bf16=args.bf16)
        del target_model
    log({"stage": "features", "seconds": round(time.time() - t0, 1), "computed_chunks": len(missing)})

    # the vocabulary sees only the training split, so held-out acceptance counts its misses honestly
    train_idx, eval_idx = split(len(rows), args.seed)
    counts = response_counts([rows[i] for i in train_idx])
    heldout = response_counts([rows[i] for i in eval_idx])
    always = end_token_ids(args.target, raw)
    vocab = build_vocab(counts, args.draft_vocab_size, raw["vocab_size"], always)
    log({"stage": "vocab", "draft_vocab_size": vocab.size, "distinct_response_tokens": len(counts),
         "heldout_coverage": coverage(vocab, heldout),
         **heldout_coverage(counts, heldout, raw["vocab_size"], always)})

    shape = head_shape(raw, vocab.size)
    head = DraftHead(shape)
    embed, lm_head = target_embed_and_head(args.target)
    init_head(head, lm_head, vocab, args.seed)
    if args.init_layer == "target" and args.init_from is None:  # a warm start replaces every weight anyway
        init_from_target_layer(head, *target_layer_tensors(args.target, aux_layer_ids(raw)[-1]))
    if args.init_from is not None:
        rows = warm_start(head, vocab, args.init_from, raw["vocab_size"], aux_layer_ids(raw))
        log({"stage": "init_from", "head": str(args.init_from), "lm_head_rows_copied": rows})
    deadline = started + args.max_hours * 3600 - 120  # two minutes kept for the export
    cfg = LoopConfig(epochs=args.epochs, batch_tokens=args.batch_tokens, lr=args.lr, num_steps=args.ttt_steps,
                     seed=args.seed, deadline=deadline, bf16=args.bf16, max_steps=args.max_steps)
    train(head, embed, FeatureStore(stems), vocab, cfg, args.work, log)

    save_head(head, vocab, eagle3_config(raw, shape), args.out)
    shutil.copyfile(args.work / "train_log.jsonl", args.out / "train_log.jsonl")
    log({"stage": "done", "out": str(args.out), "seconds": round(time.time() - started, 1)})
    return args.out
