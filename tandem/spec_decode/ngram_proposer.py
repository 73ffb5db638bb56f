"""n-gram (prompt lookup) as a proposer: each rank keeps every running request's token history from the rows
it runs, so drafts are found where the other drafters are, in the model runner, with no token lists sent per step.

History of a request = its tokens at positions [0, n). A row of the step puts its non-draft tokens at positions
num_computed_tokens.. (rejected drafts and a preempted request's old tokens are cut off first); a sampling row
then appends its emitted tokens. A request admitted with a prefix-cache hit sends the tokens before its first
row once (`ScheduledRow.prefix_token_ids`). Example: history [5 6 7 8], decode row at num_computed_tokens 3 with
tokens [8, d1, d2] and emitted [d1, x] -> cut to [5 6 7], + [8] + [d1, x] = [5 6 7 8 d1 x]. Per step the work is
O(tokens of the step) plus the lookup itself.
"""

from __future__ import annotations

from tandem.config import SpeculativeConfig
from tandem.spec_decode import ngram
from tandem.spec_decode.proposer import NoProposer, Proposal, TargetStep


class NgramProposer(NoProposer):
    """No weights and no KV of its own (NoProposer's no-op sizing, allocation and warmup)."""

    def __init__(self, spec: SpeculativeConfig):
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max
        self.history: dict[str, list[int]] = {}  # request id -> its tokens so far
        # request id -> the same as one character a token (ngram.as_text), kept beside the list so the lookup does
        # not rebuild it each step (~55 us a row at 1,100 tokens); None for ids that are no code point
        self.text: dict[str, str | None] = {}

    def observe(self, step: TargetStep) -> None:
        for row in step.plan.rows:
            tokens = self.history.setdefault(row.request_id, [])
            text = self.text.get(row.request_id, "")
            if row.prefix_token_ids is not None:
                tokens[:] = row.prefix_token_ids
                text = ngram.as_text(tokens)
            del tokens[row.num_computed_tokens:]
            kept = row.token_ids[:len(row.token_ids) - row.num_draft_tokens]
            tokens.extend(kept)
            self.text[row.request_id] = self._extend(text, row.num_computed_tokens, kept)

    def propose(self, step: TargetStep, emitted: list[list[int]], k: int) -> Proposal:
        drafts = []
        for i, new in zip(step.batch.sample_rows, emitted, strict=True):
            rid = step.plan.rows[i].request_id
            tokens = self.history[rid]
            tokens.extend(new)
            text = self.text[rid] = self._extend(self.text.get(rid), len(tokens) - len(new), new)
            if k:  # looked up through the module, so a test can swap in a drafter of known drafts
                drafts.append(ngram.propose_ngram(tokens, k, self.min_n, self.max_n, text))
        return Proposal(drafts)

    @staticmethod
    def _extend(text: str | None, keep: int, new: list[int]) -> str | None:
        """text cut to its first `keep` tokens, then `new` appended."""
        added = ngram.as_text(new)
        return None if text is None or added is None else text[:keep] + added

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.history.pop(rid, None)
            self.text.pop(rid, None)
