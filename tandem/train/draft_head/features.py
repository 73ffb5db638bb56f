"""Target features, computed once per sequence with transformers and cached for every epoch: the residual
streams entering the aux layers (bf16) and the target's top-k next-token probabilities (full vocabulary).
Scope: OUT/features/<chunk>.{aux,topk_ids,topk_probs}.npy, one set per data chunk (a rerun skips finished ones),
memmapped back by `FeatureStore`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

TOP_K = 16
BATCH_TOKENS = 4096


class TargetModel:
    """The frozen target (transformers' implementation)."""

    def __init__(self, target: Path, layer_ids: list[int]):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        self.model.requires_grad_(False)
        self.layer_ids = layer_ids

    @torch.no_grad()
    def features(self, ids: torch.Tensor, lengths: list[int], starts: list[int],
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids: [B, T] right-padded -> aux [B, T, A*H] bf16, top-k ids [B, T, k] int32, probs [B, T, k] fp16.
        Probabilities are computed only where they can be labels (index >= response start - 1)."""
        out = self.model.model(input_ids=ids, output_hidden_states=True)
        # hidden_states[l] is the residual stream entering layer l (index 0 = the embeddings)
        aux = torch.cat([out.hidden_states[i] for i in self.layer_ids], dim=-1).to(torch.bfloat16)
        b, t = ids.shape
        top_ids = torch.zeros(b, t, TOP_K, dtype=torch.int32)
        top_probs = torch.zeros(b, t, TOP_K, dtype=torch.float16)
        for r in range(b):
            lo, hi = max(starts[r] - 1, 0), lengths[r]
            with torch.autocast("cpu", enabled=False):  # the labels' probabilities stay float32 under --bf16
                last = out.last_hidden_state[r, lo:hi].float()
                logits = torch.nn.functional.linear(last, self.model.lm_head.weight.float())  # [hi - lo, V]
            p, i = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
            top_ids[r, lo:hi], top_probs[r, lo:hi] = i.int(), p.half()
        return aux, top_ids, top_probs


def compute_chunk(target: TargetModel, rows: list[dict[str, Any]], stem: Path, bf16: bool = False) -> None:
    """Concatenated along tokens in row order; write-then-rename so a chunk exists whole or not at all.
    bf16: autocast the target's matmuls (1.6x faster on the AVX512-BF16 EPYC; the aux streams are stored in bf16
    anyway, and they moved 0.5% relative, about bf16's own rounding)."""
    lengths = [len(r["ids"]) for r in rows]
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    aux_all = np.lib.format.open_memmap(f"{stem}.aux.tmp.npy", mode="w+", dtype=np.uint16,
                                        shape=(int(offsets[-1]), len(target.layer_ids)
                                               * target.model.config.hidden_size))
    ids_all = np.zeros((int(offsets[-1]), TOP_K), dtype=np.int32)
    probs_all = np.zeros((int(offsets[-1]), TOP_K), dtype=np.float16)
    order = sorted(range(len(rows)), key=lambda i: lengths[i])  # similar lengths share a batch: little padding
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > BATCH_TOKENS:
            batches.append(cur)
            cur = []
        cur.append(i)
    batches.append(cur)
    for batch in tqdm(batches, desc=f"features {stem.name}"):
        t = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), t, dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, :lengths[i]] = torch.tensor(rows[i]["ids"])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            aux, top_ids, top_probs = target.features(ids, [lengths[i] for i in batch],
                                                      [rows[i]["response_start"] for i in batch])
        for r, i in enumerate(batch):
            lo, n = offsets[i], lengths[i]
            aux_all[lo:lo + n] = aux[r, :n].view(torch.int16).numpy().view(np.uint16)
            ids_all[lo:lo + n] = top_ids[r, :n].numpy()
            probs_all[lo:lo + n] = top_probs[r, :n].numpy()
    aux_all.flush()
    del aux_all
    np.save(f"{stem}.topk_ids.npy", ids_all)
    np.save(f"{stem}.topk_probs.npy", probs_all)
    Path(f"{stem}.aux.tmp.npy").rename(f"{stem}.aux.npy")  # last: its presence marks the chunk done


def chunk_done(stem: Path) -> bool:
    return Path(f"{stem}.aux.npy").is_file()


class FeatureStore:
    """Per-sequence views into the memmapped chunks."""

    def __init__(self, chunks: list[tuple[Path, list[dict[str, Any]]]]):
        self.rows: list[dict[str, Any]] = []
        self._where: list[tuple[int, int, int]] = []  # (chunk, offset, length)
        self._arrays = []
        for c, (stem, rows) in enumerate(chunks):
            self._arrays.append((np.load(f"{stem}.aux.npy", mmap_mode="r"),
                                 np.load(f"{stem}.topk_ids.npy", mmap_mode="r"),
                                 np.load(f"{stem}.topk_probs.npy", mmap_mode="r")))
            off = 0
            for r in rows:
                self.rows.append(r)
                self._where.append((c, off, len(r["ids"])))
                off += len(r["ids"])

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> aux [T, A*H] bf16, top-k ids [T, k] int64, top-k probs [T, k] float32."""
        c, off, n = self._where[i]
        aux, ids, probs = self._arrays[c]
        aux_t = torch.from_numpy(np.array(aux[off:off + n]).view(np.int16)).view(torch.bfloat16)
        return aux_t, torch.from_numpy(np.array(ids[off:off + n])).long(), \
            torch.from_numpy(np.array(probs[off:off + n])).float()
