"""Rank 0's per-token work: append a step's emitted tokens to their requests, apply the stop rules, keep logprobs,
and build the RequestOutputs. O(1) a token: stop strings are searched only in the text each token adds (decoded
incrementally) plus the few characters before it that a stop string could span; the full text is decoded once,
when the request finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine.metrics import EngineStats
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.step_plan import StepOutput, StepPlan
from tandem.tokenizer import Tokenizer


@dataclass
class StopStringWatch:
    """A request's incrementally decoded output, for stop strings: the text so far (as pieces) and a tail window
    long enough that a stop string ending in the newest piece is found whole."""

    decode: Callable[[int], str]
    max_stop_len: int
    pieces: list[str] = field(default_factory=list)
    num_chars: int = 0
    tail: str = ""

    def add(self, token_id: int, stops: list[str]) -> tuple[str, int] | None:
        """Feed one token; -> (stop string, its start in the whole text) when one is now complete."""
        piece = self.decode(token_id)
        if not piece:
            return None
        old_tail = len(self.tail)
        window = self.tail + piece
        start = self.num_chars - old_tail  # window's offset in the whole text
        self.pieces.append(piece)
        self.num_chars += len(piece)
        self.tail = window[-(self.max_stop_len - 1):] if self.max_stop_len > 1 else ""
        # only a match ending inside the new piece is new; the earliest such match wins
        found = [(at, stop) for stop in stops
                 if (at := window.find(stop, max(0, old_tail - len(stop) + 1))) >= 0]
        if not found:
            return None
        at, stop = min(found)
        return stop, start + at

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, stats: EngineStats, max_model_len: int):
        self.tokenizer, self.scheduler, self.stats, self.max_model_len = tokenizer, scheduler, stats, max_model_len
        self._stop_watch: dict[str, StopStringWatch] = {}

    def append(self, req: Request, emitted: list[int], logprobs: list[dict[int, float] | None] | None) -> None:
        """Append a step's emitted tokens until a stop rule fires (tokens after a stop are dropped)."""
        for i, token in enumerate(emitted):
            self._append_token(req, token, logprobs[i] if logprobs is not None else None)
            if req.finished:
                self._stop_watch.pop(req.request_id, None)
                return

    def _append_token(self, req: Request, token: int, logprobs: dict[int, float] | None) -> None:
        sp = req.sampling_params
        req.output_token_ids.append(token)
        req.last_token_time = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = req.last_token_time
        self.stats.num_generation_tokens += 1
        if logprobs is not None and sp.logprobs is not None:  # a batch-mate may have asked; this request did not
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.append(trim_logprobs(logprobs, token, sp.logprobs or 0))
        num_out = len(req.output_token_ids)
        reason, stop_reason = None, None
        if sp.structured_outputs is not None and token in self.tokenizer.eos_token_ids:
            reason = "stop"  # the grammar has ended: EOS was the only token it allowed
        elif num_out >= sp.min_tokens:
            if not sp.ignore_eos and token in self.tokenizer.eos_token_ids:
                reason = "stop"
            elif token in sp.stop_token_ids:
                reason, stop_reason = "stop", token
        if isinstance(sp.stop, list) and sp.stop:
            hit = self._watch(req).add(token, sp.stop)  # every token is fed, so the decoded text stays whole
            if reason is None and hit is not None and num_out >= sp.min_tokens:
                stop, at = hit
                text = self._watch(req).text
                req.output_text = text[: at + len(stop)] if sp.include_stop_str_in_output else text[:at]
                reason, stop_reason = "stop", stop
        if reason is None and ((sp.max_tokens is not None and num_out >= sp.max_tokens)
                               or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            req.finished_time = req.last_token_time
            self.scheduler.finish(req, reason, stop_reason)
            self.stats.num_requests_finished += 1

    def _watch(self, req: Request) -> StopStringWatch:
        watch = self._stop_watch.get(req.request_id)
        if watch is None:
            sp = req.sampling_params
            watch = StopStringWatch(self.tokenizer.decode_stream(sp.skip_special_tokens),
                                    max(len(s) for s in sp.stop or [""]))
            self._stop_watch[req.request_id] = watch
        return watch

    def forget(self, request_id: str) -> None:
        """An aborted request's decoding state is dropped with it."""
        self._stop_watch.pop(request_id, None)

    def make_output(self, req: Request) -> RequestOutput:
        sp = req.sampling_params
        text = req.output_text if req.stop_reason in (sp.stop or []) else \
            self.tokenizer.decode_output(req.output_token_ids, sp.skip_special_tokens)
        completion = CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason, req.stop_reason,
                                      req.logprobs)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished=True,
                             num_cached_tokens=max(req.num_cached_tokens, 0), metrics=req.metrics(),
                             prompt_logprobs=req.prompt_logprobs)

    @staticmethod
    def record_prompt_logprobs(plan: StepPlan, output: StepOutput, requests: dict[str, Request]) -> None:
        """Entry j of a row is the logprob of prompt token num_computed_tokens + j + 1; a position already
        recorded (a request recomputed after preemption) is kept, a position past the prompt is dropped."""
        if not output.prompt_logprobs:
            return
        for row in plan.rows:
            entries = output.prompt_logprobs.get(row.request_id)
            req = requests.get(row.request_id)
            if entries is None or req is None or req.prompt_logprobs is None:
                continue
            for j, entry in enumerate(entries):
                target = row.num_computed_tokens + j + 1
                if target == len(req.prompt_logprobs) and target < len(req.prompt_token_ids):
                    req.prompt_logprobs.append(trim_logprobs(entry, req.prompt_token_ids[target],
                                                             req.sampling_params.prompt_logprobs or 0))


def trim_logprobs(logprobs: dict[int, float], token: int, num: int) -> dict[int, float]:
    top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:num]
    return dict(top) | {token: logprobs[token]}
