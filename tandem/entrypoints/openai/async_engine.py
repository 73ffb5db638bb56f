"""The engine loop beside the event loop: one thread owns the LLMEngine and steps it; HTTP handlers submit
requests and read per-request streams of token deltas. Scope: threading and delivery, no HTTP.

Submissions and aborts go through a queue the engine thread drains between steps, so the engine is only ever
touched from its own thread. After every step each live request's new tokens are pushed to its asyncio queue
with `loop.call_soon_threadsafe`; the final RequestOutput closes the stream.

A request that fails at submission fails alone (its stream gets the error); only a failed step (a dead rank, a
bug) stops the engine, and then every open stream gets a short error while the traceback goes to the log.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.llm_engine import LLMEngine
from tandem.engine.metrics import Counter, Metric
from tandem.engine.parallel_sampling import ParentRequest
from tandem.engine.request import Request
from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.prometheus import Histogram
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger("tandem")


class EngineStopped(RuntimeError):
    """The engine thread has died (a dead rank, a bug); no request can run any more."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Delta]
    choices: list[Request]  # one per choice (n > 1: the children); the engine appends to their outputs
    sent: list[int]  # tokens of each choice already delivered


@dataclass
class Delta:
    token_ids: list[int]  # new tokens of choice `index` since its previous delta
    final: RequestOutput | None = None  # set on the last delta (every choice's tokens delivered before it)
    index: int = 0
    logprobs: list[dict[int, float]] | None = None  # per new token, when the request asked for logprobs


class AsyncEngine:
    def __init__(self, args: EngineArgs):
        self.engine = LLMEngine(args.create_engine_config())
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.config.model_config.max_model_len
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.num_open_streams = 0  # generate() iterations not yet finished (the event loop's side)
        self.on_error: Callable[[BaseException], None] | None = None  # called on the engine thread when it dies
        self._metrics: list[Metric] = self.engine.get_metrics()
        self.num_aborted = 0  # requests whose client hung up (or that the server cut at shutdown) before the end
        # request latencies, observed on the event loop as the deltas arrive
        self.ttft = Histogram("tandem:time_to_first_token_seconds")
        self.tpot = Histogram("tandem:time_per_output_token_seconds")
        self.e2e = Histogram("tandem:e2e_request_latency_seconds")
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()

    # -- called from the event loop ------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[Delta]:
        """Deltas of one request; closing or cancelling the iteration (a client that went away) aborts it."""
        if self.error is not None:
            raise EngineStopped(f"the engine stopped: {short_error(self.error)}")
        request_id = request_id or f"req-{next(self._ids)}"
        out: asyncio.Queue[Delta] = asyncio.Queue()
        self._inbox.put(("add", (request_id, prompt, params, asyncio.get_running_loop(), out)))
        self._wake.set()
        finished = False
        start, first = time.monotonic(), None
        self.num_open_streams += 1
        try:
            while True:
                delta = await out.get()
                now = time.monotonic()
                if first is None and delta.token_ids:
                    first = now
                    self.ttft.observe(now - start)
                if delta.final is not None and delta.final.error is None and first is not None \
                        and all(o.finish_reason != "abort" for o in delta.final.outputs):
                    self.e2e.observe(now - start)
                    num_out = max(len(o.token_ids) for o in delta.final.outputs)
                    if num_out > 1:
                        self.tpot.observe((now - first) / (num_out - 1))
                yield delta
                if delta.final is not None:
                    finished = True
                    return
        finally:
            self.num_open_streams -= 1
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (a no-op once it has finished)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def end_streams(self, reason: str) -> None:
        """Abort every open request and end its stream with `reason` as an error (a server shutting down), so no
        client is cut off without being told."""
        self._inbox.put(("end_streams", reason))
        self._wake.set()

    def metrics(self) -> list[Metric]:
        # the engine's list is refreshed by the engine thread after every step
        return [*self._metrics, Counter("tandem:request_aborted", self.num_aborted)]

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # -- the engine thread -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self._drain_inbox():
                    self._metrics = self.engine.get_metrics()  # aborts change running/waiting and KV usage
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                finished = {o.request_id: o for o in self.engine.step()}
                self._publish(finished)
                self._metrics = self.engine.get_metrics()
        except BaseException as e:  # a dead rank or a bug: fail every open stream instead of hanging it
            logger.exception("the engine stopped")
            self.error = e
            self._fail_streams(f"the engine stopped: {short_error(e)}")
            if self.on_error is not None:
                self.on_error(e)

    def _drain_inbox(self) -> bool:
        """Apply queued submissions and aborts; True when there were any."""
        drained = False
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return drained
            drained = True
            if kind == "add":
                request_id, prompt, params, loop, out = payload
                try:
                    added = self.engine.add_request(prompt, params, request_id)
                except Exception as e:  # noqa: BLE001  a request that cannot be added fails alone
                    logger.warning("request %s rejected: %s", request_id, e)
                    self.engine.abort_request(request_id)
                    added = RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], "error")], finished=True,
                                          error=str(e))
                if isinstance(added, RequestOutput):  # rejected at once (e.g. too long)
                    _deliver(loop, out, Delta([], added))
                else:
                    choices = added.children if isinstance(added, ParentRequest) else [added]
                    self._streams[request_id] = _Stream(loop, out, choices, [0] * len(choices))
            elif kind == "end_streams":
                for request_id in list(self._streams):
                    self.engine.abort_request(request_id)
                    self.num_aborted += 1
                self._fail_streams(payload)
            elif kind == "abort" and payload in self._streams:
                logger.info("request %s aborted (the client went away)", payload)
                self.num_aborted += 1
                st = self._streams.pop(payload)
                self.engine.abort_request(payload)  # frees its KV blocks at once
                # end the stream too, so a reader still waiting on it (a non-streamed request whose client hung
                # up) finishes instead of waiting forever
                aborted = RequestOutput(payload, None, [], [CompletionOutput(i, "", list(r.output_token_ids), "abort")
                                                            for i, r in enumerate(st.choices)], finished=True)
                _deliver(st.loop, st.out, Delta([], aborted))

    def _publish(self, finished: dict[str, RequestOutput]) -> None:
        for request_id, st in list(self._streams.items()):
            for index, req in enumerate(st.choices):
                new = req.output_token_ids[st.sent[index]:]
                if not new:
                    continue
                logprobs = req.logprobs[st.sent[index]:] if req.logprobs is not None else None
                _deliver(st.loop, st.out, Delta(list(new), None, index, logprobs))
                st.sent[index] += len(new)
            final = finished.get(request_id)
            if final is not None:
                _deliver(st.loop, st.out, Delta([], final))
                del self._streams[request_id]

    def _fail_streams(self, message: str) -> None:
        """End every open stream with an error and no outputs (what handlers report as a stopped engine)."""
        for request_id, st in list(self._streams.items()):
            _deliver(st.loop, st.out, Delta([], RequestOutput(request_id, None, [], [], finished=True, error=message)))
        self._streams.clear()


def _deliver(loop: asyncio.AbstractEventLoop, out: asyncio.Queue[Delta], delta: Delta) -> None:
    """Hand a delta to the event loop; once that loop has closed (the server is gone) nobody is reading."""
    try:
        loop.call_soon_threadsafe(out.put_nowait, delta)
    except RuntimeError:  # "Event loop is closed"
        pass


def short_error(e: BaseException) -> str:
    """What a client may see of an engine failure: one line, no traceback or file paths (those go to the log)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if first.startswith("engine stopped: "):  # EngineDeadError: already one line naming the rank(s)
        text = first.removeprefix("engine stopped: ")
    else:
        text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text[:500]
