"""Streamed text of one choice, O(1) a token: tokenizers' DecodeStream gives the text each token adds (nothing
while a UTF-8 character, a byte-fallback sequence or a merge is unfinished); the last characters that could
still begin a stop string are held back until the next token, or the final result, settles them; text from a
completed stop string on is never streamed ahead of the final result."""

from __future__ import annotations

from tandem.sampling_params import SamplingParams
from tandem.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self._decode = tokenizer.decode_stream(params.skip_special_tokens)
        self._stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""  # decoded, not yet sent: at most `_hold` characters between calls
        self._num_sent = 0  # characters sent so far

    def push(self, token_ids: list[int]) -> str:
        self._pending += "".join(self._decode(t) for t in token_ids)
        # A stop string completed in this delta (it starts inside `_pending`, as the held-back tail covers all but
        # its last character) ends the text there; the final result says whether it is included.
        found = [at for stop in self._stops if (at := self._pending.find(stop)) >= 0]
        cut = min(found) if found else max(0, len(self._pending) - self._hold)
        ready, self._pending = self._pending[:cut], self._pending[cut:]
        self._num_sent += len(ready)
        return ready

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (cut before a stop string, or including it, as the request
        asked): what was held back and any tokens of the last step."""
        rest = final_text[self._num_sent:]
        self._num_sent = len(final_text)
        return rest
