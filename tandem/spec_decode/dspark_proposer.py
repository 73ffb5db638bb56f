"""DSpark drafter: K draft tokens per sampling row from one block of the semi-autoregressive drafter (models/dspark.py).
Scope: capture of the target's layer outputs, the drafter's context K/V every step, block proposal and Markov sampling.

Every step, `observe` turns the target's captured layer outputs into each draft layer's context K/V for every
target token of the step, prompt chunks and rejected drafts included (a rejected position is simply overwritten
when it is recomputed); under PCP each rank projects its own rows and all-gathers the K/V (dspark_context.py).
`propose` then runs one block per sampling row:

    decode row [t9 d1 d2] at positions 9..11, the target accepted d1 and emitted x:
    P = 10 (d1, the last valid token), block = [x, noise, .., noise] at positions 11 .. 10+B,
    keys = context K/V 0..10 + the block's own; slot j is sampled at position P+2+j = 12+j.

DSpark always runs replicated (DESIGN §5): every rank holds the whole context cache and proposes for every row.

Under "auto" K at PCP size 1 a step that proposes nothing (K = 0) defers its context write (`DeferredContext`): the
writes of such steps wait, in order, and the next step that drafts writes them all in one projection before its
block reads the cache (or a step writes them once MAX_DEFERRED_CONTEXT_TOKENS wait). Nothing reads the cache in
between, and the writes land in the order they would have, so the drafts are the same (a slot written twice
keeps its later value). At batch 32 the per-step write cost ~0.6 ms of a ~28 ms step at K = 0 (2%); a request that
finishes at K = 0 still has its context written at the next flush (its blocks may serve a prefix-cache hit).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.dspark import ContextPrefix, DSparkDrafter
from tandem.spec_decode.draft_sampling import pack_drafts, sample_draft
from tandem.spec_decode.dspark_context import make_context_kv_writer
from tandem.spec_decode.layer_capture import LayerCapture
from tandem.spec_decode.proposer import Proposal, TargetStep
from tandem.step_plan import STEP0_DEFERRED
from tandem.worker.input_batch import InputBatch

MAX_DEFERRED_CONTEXT_TOKENS = 4096  # target tokens whose context write may wait (their layer outputs are kept)


class DeferredContext:
    """The context writes of K = 0 steps, oldest first: each step's target layer outputs, positions and slots."""

    def __init__(self) -> None:
        self.pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.num_tokens = 0

    def append(self, aux: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # aux: [T, n * H_t]; positions, slot_mapping: [T] (copies: the runner reuses its input buffers)
        self.pieces.append((aux, positions.clone(), slot_mapping.clone()))
        self.num_tokens += aux.shape[0]

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(aux [N, n * H_t], positions [N], slots [N]) of every waiting write, each slot once with its latest
        value (a freed block handed to another request, or a recomputed prompt, is written twice; one indexed
        write with repeated slots would keep either), or None."""
        if not self.pieces:
            return None
        aux, positions, slots = (torch.cat(t) for t in zip(*self.pieces, strict=True))
        self.pieces, self.num_tokens = [], 0
        unique, inverse = torch.unique(slots, return_inverse=True)
        if unique.shape[0] < slots.shape[0]:
            order = torch.arange(slots.shape[0], device=slots.device)
            last = torch.full_like(unique, -1).scatter_reduce_(0, inverse, order, "amax")  # [U] latest index
            aux, positions, slots = aux[last], positions[last], slots[last]
        return aux, positions, slots


class DSparkProposer:
    def __init__(self, drafter: DSparkDrafter, target: nn.Module, block_size: int, probabilistic: bool,
                 defers: bool = False):
        self.drafter, self.target, self.block_size, self.probabilistic = drafter, target, block_size, probabilistic
        self.layer_ids = drafter.config.target_layer_ids
        self.capture = LayerCapture({i: target.model.layers[i] for i in set(self.layer_ids)})
        self.last_confidence = torch.empty(0)  # [S, K] confidence of each draft of the last proposal
        self.context = make_context_kv_writer(drafter)
        # PCP size 1 under "auto": a K = 0 step's context write waits for the next step that drafts
        self.defers, self.deferred = defers, DeferredContext()

    def take_aux_hidden(self) -> torch.Tensor:
        """[T_local, len(target_layer_ids) * target_hidden]: the captured outputs of the target's last forward,
        concatenated in target_layer_ids order (one tensor, so PCP restores them in one collective)."""
        return self.capture.take(self.layer_ids)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elems = sum(torch.Size(a.kv_cache_shape(1, block_size)).numel() for a in self.drafter.attention_layers())
        return elems * torch.finfo(dtype).bits // 8

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: str) -> None:
        """One cache per draft layer over the same block pool as the target: a token's slot is the target's."""
        for attn in self.drafter.attention_layers():
            attn.kv_cache = torch.zeros(attn.kv_cache_shape(num_blocks, block_size), dtype=dtype, device=device)

    def kv_layers(self) -> list[nn.Module]:
        return []  # its context attention stores at scale 1 (docs/kv_cache_dtype.md)

    def free(self, request_ids: list[str]) -> None:
        pass

    @torch.inference_mode()
    def observe(self, step: TargetStep) -> None:
        """DSpark's context K/V covers every target token, so it is written on every step, sampling or not (where
        the proposer defers, propose writes it: now or, at K = 0, with the next step that drafts)."""
        if self.defers:
            batch = step.batch
            real = batch.num_tokens - batch.num_padding  # graph padding rows write nothing
            self.deferred.append(self.take_aux_hidden()[:real], batch.positions[:real], batch.slot_mapping[:real])
        else:
            self.context.write(step, self.take_aux_hidden())

    def _write_deferred(self, step: TargetStep) -> dict[str, float]:
        """Every waiting context write, in one projection; the stats name the tokens of earlier steps it took."""
        step_tokens = step.batch.num_tokens - step.batch.num_padding
        earlier = self.deferred.num_tokens - step_tokens
        waiting = self.deferred.take()
        if waiting is not None:
            self.drafter.write_context(*waiting)
        return {"catch_up_tokens": float(earlier)} if earlier > 0 else {}

    @torch.inference_mode()
    def warmup(self, step: TargetStep, k: int) -> None:
        """Padding only, on the rank's own rows (no row writes, so nothing crosses ranks)."""
        batch = step.batch
        self.drafter.write_context(torch.zeros_like(self.take_aux_hidden()), batch.positions, batch.slot_mapping)

    @torch.inference_mode()
    def propose(self, step: TargetStep, emitted: list[list[int]], k: int) -> Proposal:
        """K drafts per sampling row (and for probabilistic drafting each row's draft distributions [K, V]) from
        the layer outputs written by observe(); the target's final states are not read."""
        batch = step.batch
        stats = {"context_gather_bytes": float(self.context.take_gathered_bytes())}
        if self.defers:
            if (k == 0 or not emitted) and self.deferred.num_tokens <= MAX_DEFERRED_CONTEXT_TOKENS:
                return Proposal(stats=stats | {STEP0_DEFERRED: float(batch.num_tokens - batch.num_padding)})
            stats |= self._write_deferred(step)
        if k == 0 or not emitted:
            return Proposal(stats=stats)
        b = self.drafter.config.block_size
        last_pos = batch.positions[last_valid_indices(batch, emitted)]  # [S] P of each row
        anchors = torch.tensor([e[-1] for e in emitted], device=last_pos.device)  # [S] token at P + 1
        block_ids = torch.full((len(emitted), b), self.drafter.config.noise_token_id, device=last_pos.device)
        block_ids[:, 0] = anchors  # [S, B]
        positions = last_pos[:, None] + 1 + torch.arange(b, device=last_pos.device)  # [S, B]: P+1 .. P+B
        prefix = ContextPrefix.build(batch.block_table[batch.sample_rows], last_pos + 1, self.block_size, b)
        h = self.drafter(self.target.model.embed_tokens(block_ids.flatten()), positions.flatten(), prefix)
        h = h.view(len(emitted), b, -1)[:, :k]  # [S, K, hidden]: only the slots that become drafts
        logits = self.target.compute_logits(h.flatten(0, 1)).view(len(emitted), k, -1)  # [S, K, V] float32
        self.last_confidence = self.drafter.confidence(h.flatten(0, 1)).view(len(emitted), k)  # [S, K]
        drafts, probs, prev = [], [], anchors
        for j in range(k):  # left to right: the Markov head conditions slot j on the token drafted at j - 1
            prev, q = sample_draft(logits[:, j] + self.drafter.markov_head(prev), batch.sampling, last_pos + 2 + j,
                                   self.probabilistic)
            drafts.append(prev)
            probs.append(q)
        token_ids, q_rows = pack_drafts(drafts, probs, self.probabilistic)
        stats |= {"confidence_sum": float(self.last_confidence.sum()), "num_confidences": self.last_confidence.numel()}
        return Proposal(token_ids, q_rows, stats)


def last_valid_indices(batch: InputBatch, emitted: list[list[int]]) -> list[int]:
    """Token index of each sampling row's last valid target token: its last token less the rejected drafts.

    Example: decode row [t9 d1 d2] at token indices 4..6 with 2 drafts, emitted [d1, x] (d1 accepted):
    6 - 2 + (2 - 1) = 5, the index of d1; a prompt chunk (no drafts, emitted [x]) gives its last token.
    """
    qsl = batch.query_start_loc_np
    return [int(qsl[i + 1]) - 1 - k + len(e) - 1
            for i, k, e in zip(batch.sample_rows, batch.num_draft_tokens, emitted, strict=True)]
