"""Which replicated-PCP steps split their keys (worker/pcp_hooks.py's splits_keys): the global batch decides, so
every rank agrees; prompt rows that see two keys a query or more split, short prompts and decodes do not."""

from __future__ import annotations

import numpy as np
import torch

from tandem.worker.pcp_hooks import splits_keys


class _Batch:
    """The fields splits_keys reads of an InputBatch: rows of (queries, keys seen, is a prompt row)."""

    def __init__(self, rows: list[tuple[int, int, bool]]):
        self.query_start_loc_np = np.concatenate([[0], np.cumsum([q for q, _, _ in rows])]).astype(np.int32)
        self.seq_lens_cpu = torch.tensor([s for _, s, _ in rows], dtype=torch.int32)
        self.is_prefill_cpu = torch.tensor([p for _, _, p in rows], dtype=torch.bool)


def test_a_chunk_behind_its_prefix_splits_and_a_fresh_prompt_does_not():
    assert not splits_keys(_Batch([(2048, 2048, True)]))  # a prompt's first chunk: its own keys only
    assert splits_keys(_Batch([(2048, 4096, True)]))  # the next chunk reads the first's keys too
    assert splits_keys(_Batch([(40, 4040, True), (1, 300, False)]))  # a short chunk behind a long cached prefix
    assert not splits_keys(_Batch([(100, 100, True)] * 20 + [(1, 90, False)] * 12))  # GSM8K-sized prompts
    assert not splits_keys(_Batch([(1, 9000, False), (4, 500, False)]))  # decode and verification rows attend locally
