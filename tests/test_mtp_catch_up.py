"""Deferred MTP step 0 (spec_decode/mtp_catch_up.py): which deferred tokens a row extends back over, where the
extended batch puts every token, the bound on deferring, and which prompt rows defer. The end-to-end check (drafts
after K = 0 steps equal MTP recomputed from scratch, in both draft modes) is test_spec_policy.py's
test_drafts_after_k0_steps_equal_plain_recomputation."""

from __future__ import annotations

import torch

from tandem.spec_decode.mtp_catch_up import MAX_DEFERRED_TOKENS, DeferredStep0, DeferredTokens
from tandem.step_plan import RowSampling, ScheduledRow, StepPlan
from tandem.worker.input_batch import prepare_inputs

BLOCK = 4
GREEDY = RowSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, num_logprobs=None)


def _deferred(start: int, n: int, hidden: int = 3) -> DeferredTokens:
    entry = DeferredTokens(start)
    entry.append(torch.arange(start, start + n), torch.arange(start, start + n).float()[:, None].repeat(1, hidden))
    return entry


def test_a_row_takes_the_deferred_tokens_right_before_it():
    entry = _deferred(10, 5)  # positions 10..14
    assert entry.before(15) is entry
    trimmed = entry.before(13)  # a resumed request whose row starts inside them: only 10..12 are still missing
    assert trimmed is not None and trimmed.num_tokens == 3 and trimmed.ids == [10, 11, 12]
    assert entry.before(10) is None, "a row recomputing them (a preempted prompt) takes none"
    assert entry.before(16) is None, "after a gap the tokens do not lie right before the row"


def _decode_plan(rows: list[tuple[str, int, int]]) -> StepPlan:
    """(request id, num_computed_tokens, drafts): decode rows [last, d1 .. dK] over enough blocks."""
    plan_rows = []
    for b, (rid, computed, k) in enumerate(rows):
        blocks = [b * 16 + j for j in range(16)]
        plan_rows.append(ScheduledRow(rid, [5] * (k + 1), computed, blocks, False, GREEDY, num_draft_tokens=k))
    return StepPlan(plan_rows)


def test_extended_batch_places_deferred_tokens_before_their_rows():
    """Two decode rows, the second with 3 deferred tokens: its row becomes 4 consecutive positions, written to the
    slots of its own blocks, and its sampling index moves by 3; the first row moves by nothing."""
    plan = _decode_plan([("a", 20, 0), ("b", 9, 0)])
    batch = prepare_inputs(plan, BLOCK, "cpu")
    deferred = DeferredStep0(BLOCK)
    deferred.deferred["b"] = _deferred(6, 3)
    shifted = torch.tensor([101, 102])
    hidden = torch.tensor([[1.0, 1, 1], [2.0, 2, 2]])
    ext = deferred.extend(plan, batch, shifted, hidden)
    assert ext is not None and not deferred.deferred, "the deferred tokens are taken once"
    assert ext.positions.tolist() == [20, 6, 7, 8, 9]
    assert ext.input_ids.tolist() == [101, 6, 7, 8, 102]
    assert ext.hidden[:, 0].tolist() == [1.0, 6.0, 7.0, 8.0, 2.0]
    assert [ext.sample_index(0, 0), ext.sample_index(1, 1)] == [0, 4]
    # reported with the proposal: 3 tokens caught up at positions 6..8, attending 7 + 8 + 9 keys
    assert ext.stats == {"catch_up_tokens": 3.0}
    block_table = batch.block_table[1].long()
    want_slots = [int(block_table[p // BLOCK]) * BLOCK + p % BLOCK for p in (6, 7, 8, 9)]
    meta = ext.attn_metadata
    assert sorted(meta.write_slots.tolist()) == sorted([int(batch.slot_mapping[0])] + want_slots)


def test_defer_keeps_only_accepted_tokens_and_stops_at_the_bound():
    """A verification row [last, d1, d2] that accepted d1 defers 2 tokens, not 3; a request at the bound runs
    step 0 instead of deferring further."""
    plan = _decode_plan([("a", 30, 2)])
    batch = prepare_inputs(plan, BLOCK, "cpu")
    deferred = DeferredStep0(BLOCK)
    last_idx = [1]  # last valid token: position 31
    assert deferred.can_defer(plan, batch, last_idx)
    deferred.defer(plan, batch, torch.tensor([7, 8, 9]), torch.zeros(3, 2), last_idx)
    entry = deferred.deferred["a"]
    assert (entry.start, entry.num_tokens) == (30, 2)
    entry.num_tokens = MAX_DEFERRED_TOKENS - 1
    assert not deferred.can_defer(plan, batch, last_idx), "two more would exceed MAX_DEFERRED_TOKENS"


def test_a_prompts_last_chunk_defers_and_an_earlier_chunk_does_not():
    """A prompt that ends this step samples and defers like a decode (its tokens from the prefix hit on); a chunk
    that stops short of its prompt's end samples nothing, and a step holding one runs step 0 for every row."""
    deferred = DeferredStep0(BLOCK)
    last = StepPlan([ScheduledRow("p", [1, 2, 3], 4, [0, 1], True, GREEDY)])  # a 4-token prefix hit, 3 new tokens
    batch = prepare_inputs(last, BLOCK, "cpu")
    assert deferred.can_defer(last, batch, [2])
    deferred.defer(last, batch, torch.tensor([2, 3, 9]), torch.ones(3, 2), [2])
    entry = deferred.deferred["p"]
    assert (entry.start, entry.num_tokens, entry.ids) == (4, 3, [2, 3, 9])
    ext = deferred.extend(_decode_plan([("p", 7, 0)]), prepare_inputs(_decode_plan([("p", 7, 0)]), BLOCK, "cpu"),
                          torch.tensor([5]), torch.zeros(1, 2))
    assert ext is not None and ext.positions.tolist() == [4, 5, 6, 7], "the first decode catches the prompt up"
    chunk = StepPlan([ScheduledRow("q", [1, 2, 3], 0, [0], True, None),
                      ScheduledRow("r", [4], 9, [1, 2, 3], False, GREEDY)])
    assert not DeferredStep0(BLOCK).can_defer(chunk, prepare_inputs(chunk, BLOCK, "cpu"), [3]), \
        "a chunk that does not end its prompt runs step 0, and so does the step it is in"


def test_the_decode_fast_path_keeps_what_the_general_path_keeps():
    """defer_decodes (every row one decode token) keeps the same positions, ids and hidden states as can_defer +
    defer over the shifted ids, restarts a row after a gap alike, and declines, keeping nothing, where a row
    verifies drafts or sits at the bound."""
    plan = _decode_plan([("a", 20, 0), ("b", 9, 0)])
    batch = prepare_inputs(plan, BLOCK, "cpu")
    hidden = torch.tensor([[1.0, 1.5], [2.0, 2.5]])
    emitted = [[31], [32]]
    fast, general = DeferredStep0(BLOCK), DeferredStep0(BLOCK)
    for d in (fast, general):
        d.deferred["b"] = _deferred(6, 3, hidden=2)  # right before b's row: extended
        d.deferred["a"] = _deferred(3, 2, hidden=2)  # a gap before a's row: restarted at 20
    assert fast.defer_decodes(plan, emitted, hidden)
    assert general.can_defer(plan, batch, [0, 1])
    general.defer(plan, batch, torch.tensor([31, 32]), hidden, [0, 1])
    for rid in ("a", "b"):
        f, g = fast.deferred[rid], general.deferred[rid]
        assert (f.start, f.num_tokens, f.ids) == (g.start, g.num_tokens, g.ids), rid
        assert torch.equal(torch.cat(f.hidden), torch.cat(g.hidden)), rid
    assert fast.deferred["a"].start == 20 and fast.deferred["b"].ids == [6, 7, 8, 32]
    hidden.fill_(0.0)  # the target's buffer is reused by the next step: what was kept is a copy
    assert torch.cat(fast.deferred["b"].hidden)[-1].tolist() == [2.0, 2.5]
    drafting = _decode_plan([("c", 20, 2)])
    assert not fast.defer_decodes(drafting, [[1, 2]], torch.zeros(3, 2)) and "c" not in fast.deferred
    fast.deferred["a"].num_tokens = MAX_DEFERRED_TOKENS
    assert not fast.defer_decodes(plan, emitted, torch.zeros(2, 2)), "at the bound the step runs step 0"
    assert fast.deferred["b"].num_tokens == 4, "declining keeps nothing for the other rows"
