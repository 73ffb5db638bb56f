"""EAGLE-3 drafter: K draft tokens per sampling row from a trained head (models/eagle3.py) fed by the target's
residual streams at three layers. Scope: capturing those streams and the head's own KV; the draft passes are MTP's.

EAGLE-3 takes MTP's rows of DESIGN §4-5: step 0 runs over every token of the step with ids shifted left by one
(its own paged KV covers the whole context), steps 1..K-1 are one-token decodes that feed back the head's pre-norm
output. So MTPProposer drives it unchanged; what differs is what step 0 reads of the target (the concatenated aux
states, [T, 3 H_t], instead of the final-normed hidden state) and that the head's KV cache is its own:

    sharded      step 0 on the rank's PCP segments: the rank-local aux states, the target's local metadata
    replicated   step 0 over the global batch: aux states restored to global order once a step (one all-gather)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem.attention.backend import AttentionBackend
from tandem.models.eagle3 import Eagle3Head
from tandem.spec_decode.layer_capture import LayerCapture
from tandem.spec_decode.mtp_proposer import MTPProposer
from tandem.spec_decode.proposer import TargetStep
from tandem.worker.input_batch import InputBatch
from tandem.worker.kv_cache import allocate_kv_caches, attention_modules, bytes_per_block


class Eagle3Proposer(MTPProposer):
    def __init__(self, head: Eagle3Head, target: nn.Module, backends: dict[str, type[AttentionBackend]],
                 block_size: int, max_model_len: int, probabilistic: bool, sharded: bool,
                 target_backends: dict[str, type[AttentionBackend]],
                 padded_size: Callable[[int], int] = lambda n: n, defers: bool = False,
                 kv_dtype: torch.dtype | None = None):
        super().__init__(head, backends, block_size, max_model_len, probabilistic, sharded, target_backends,  # type: ignore[arg-type]
                         padded_size, defers)
        self.head = head
        self.kv_dtype = kv_dtype  # the head's cache dtype when it differs from the target's (draft_dtype)
        assert head.cfg.aux_layer_ids is not None
        self.layer_ids = head.cfg.aux_layer_ids
        # the stream entering layer i is the output of layer i - 1 (of the embedding for i = 0)
        self.capture = LayerCapture({i: target.model.embed_tokens if i == 0 else target.model.layers[i - 1]
                                     for i in set(self.layer_ids)})
        self._local: torch.Tensor | None = None  # [T_r, n_aux * H_t] this step's aux states
        self._global: torch.Tensor | None = None  # [T(+padding), n_aux * H_t] the same in global order

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return bytes_per_block(self.head, self.backends, block_size, self.kv_dtype or dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: str) -> None:
        """The head's cache over the same block pool as the target: a token's slot is the target's."""
        allocate_kv_caches(self.head, self.backends, num_blocks, block_size, self.kv_dtype or dtype, device)

    def kv_layers(self) -> list[nn.Module]:
        return list(attention_modules(self.head))

    def _take(self, step: TargetStep) -> None:
        """This step's aux states from the target forward that just ran (a stale capture is never reused)."""
        aux = self.capture.take(self.layer_ids)  # [T_r, n_aux * H_t]
        self._local, self._global = step.pcp.mask_padding(aux, step.batch), None

    def observe(self, step: TargetStep) -> None:
        self._take(step)
        super().observe(step)

    def warmup(self, step: TargetStep, k: int) -> None:
        self._take(step)
        super().warmup(step, k)

    def sample(self, h_logits: torch.Tensor, spec_step_idx: int, batch: InputBatch,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.probabilistic:  # q over the whole target vocabulary, zero off the draft vocabulary
            return super().sample(h_logits, spec_step_idx, batch, positions)
        # greedy: the argmax over the draft vocabulary, mapped to its target id (no [S, V] logits to fill)
        return self.head.greedy_draft(h_logits), None

    def local_states(self, step: TargetStep) -> torch.Tensor:
        assert self._local is not None, "observe() takes the step's aux states before any draft pass"
        return self._local

    def global_states(self, step: TargetStep) -> torch.Tensor:
        if self._global is None:
            self._global = step.pcp.maybe_restore(self.local_states(step))
        return self._global
