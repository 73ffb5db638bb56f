"""DSpark's context K/V under PCP: which rank projects which target rows, and what crosses the PCP group.
Scope: the per-step context write into the drafter's replicated cache (docs/dspark.md, step 2); no proposal.

Both layouts leave the same replicated drafter cache (every rank holds every token's context K/V):
    sharded (default)  each rank projects only the rows it holds (its PCP segments, plus the decode rows that
                       every rank holds), all-gathers the resulting K/V and writes them in global order
    replicated         the target's captured layer outputs are restored to global order (all-gather) and every
                       rank projects every token
`TANDEM_DSPARK_CONTEXT_KV=replicated` selects the replicated layout (the benchmark and the parity tests compare
the two). At PCP size 1 both are the same computation on the same rows.

Worked example, P = 2, the global batch of worker/pcp.py [A B | c0 .. c7], T_r = 6 on both ranks:
    sharded     rank0 projects [A B c0 c1 c6 c7], rank1 [A B c2 c3 c4 c5] -> kv_local [6, L, 2, Hkv, D]
                all_gather -> [12, L, 2, Hkv, D] -> restore -> [A B c0 .. c7] (A, B rank 0's copies) -> cache
    replicated  aux_local [6, n * H_t] -> all_gather -> [12, n * H_t] -> restore -> [10, n * H_t];
                both ranks project all 10 rows -> cache

Bytes every rank receives from the step's all-gather (P ranks, rows padded to m = max_r T_r):
    replicated  P * m * n * H_t * e_act             n = len(target_layer_ids), H_t = target_hidden_size,
                                                    e_act = bytes per element of the target's dtype
    sharded     P * m * L * 2 * Hkv * D * e_cache   L = draft layers, Hkv * D = one layer's K (or V) width,
                                                    e_cache = bytes per element of the drafter cache's dtype
Sharded moves less whenever L * 2 * Hkv * D < n * H_t: the bundled drafter 1 * 2 * 2 * 64 = 256 against
2 * 256 = 512 elements a token (0.5x); a DeepSeek-V3-sized one (n = 3, H_t = 7168, L = 1, Hkv = 8, D = 128)
2,048 against 21,504 (0.095x). Each rank's projection work falls from T_global rows to T_r rows
(fc: n * H_t * H multiply-adds a row, then 2 * Hkv * D * H a row per draft layer).

The projection is row-wise, so the two layouts compute the same values; a GEMM over T_r rows and one over
T_global rows agree bit for bit except where the BLAS picks a different kernel for very few rows (on one MKL
thread, fewer than 4), where they differ by float rounding. The parity tests pin equal drafts and tokens.
"""

from __future__ import annotations

import math

import torch

from tandem import envs
from tandem.models.dspark import DSparkDrafter
from tandem.spec_decode.proposer import TargetStep

CONTEXT_KV_ENV = "TANDEM_DSPARK_CONTEXT_KV"


class ContextKVWriter:
    """Writes every target token of a step into the drafter's cache; counts the bytes its all-gathers hand
    each rank (`take_gathered_bytes`: since the last call)."""

    layout = ""

    def __init__(self, drafter: DSparkDrafter):
        self.drafter = drafter
        self._gathered_bytes = 0

    def write(self, step: TargetStep, aux_local: torch.Tensor) -> None:
        """aux_local: [T_r, n * H_t] the target's captured layer outputs at this rank's tokens."""
        raise NotImplementedError

    def take_gathered_bytes(self) -> int:
        num, self._gathered_bytes = self._gathered_bytes, 0
        return num

    def _count(self, step: TargetStep, rows: torch.Tensor) -> None:
        # rows: [T_r, ...] what this rank contributes to the all-gather
        self._gathered_bytes += step.pcp.num_gathered_rows() * math.prod(rows.shape[1:]) * rows.element_size()


class ShardedContextKV(ContextKVWriter):
    layout = "sharded"

    def write(self, step: TargetStep, aux_local: torch.Tensor) -> None:
        kv_local = self.drafter.context_kv(aux_local, step.local.positions)  # [T_r, L, 2, Hkv, D]
        self._count(step, kv_local)
        kv = step.pcp.maybe_restore(kv_local)  # [T_global(+padding), L, 2, Hkv, D], padding rows zero
        self.drafter.write_context_kv(kv, step.batch.slot_mapping)


class ReplicatedContextKV(ContextKVWriter):
    layout = "replicated"

    def write(self, step: TargetStep, aux_local: torch.Tensor) -> None:
        self._count(step, aux_local)
        aux = step.pcp.maybe_restore(aux_local)  # [T_global(+padding), n * H_t]
        batch = step.batch
        if batch.num_padding:  # at PCP size 1 the padding rows ran with the batch; they write nothing anyway
            aux = aux.masked_fill(batch.is_padding[:, None], 0)
        self.drafter.write_context(aux, batch.positions, batch.slot_mapping)


WRITERS: dict[str, type[ContextKVWriter]] = {"sharded": ShardedContextKV, "replicated": ReplicatedContextKV}


def make_context_kv_writer(drafter: DSparkDrafter) -> ContextKVWriter:
    """The layout named by $TANDEM_DSPARK_CONTEXT_KV (read once, when the proposer is built), sharded if unset."""
    return WRITERS[envs.dspark_context_kv(tuple(WRITERS))](drafter)
