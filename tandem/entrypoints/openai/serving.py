"""Responses of /v1/completions and /v1/chat/completions from the AsyncEngine's deltas: the whole JSON body, or
server-sent events. Scope: response shapes, incremental text, logprobs; validation lives in api_server.py.

One HTTP request may carry several prompts (completions' `prompt` as a list) and ask for `n` choices each: every
prompt becomes one engine request (its n choices are the engine's parallel-sampling children), all submitted at
once, and choice `j` of prompt `i` is numbered `i * n + j`, as OpenAI and vLLM number them.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tandem.entrypoints.openai.async_engine import AsyncEngine, Delta, EngineStopped
from tandem.entrypoints.openai.text_stream import TextStream
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.entrypoints.openai.tool_calls import ToolRequest


class BadRequest(Exception):
    pass


class _Logprobs:
    """OpenAI's logprobs shapes from the engine's per-token {token_id: logprob} (top-n plus the sampled token):
    completions' parallel lists with text offsets, or chat's `content` entries. Tokens are named by their text,
    or `bytes:\\xNN` when they hold part of a UTF-8 character (OpenAI's convention)."""

    def __init__(self, engine: AsyncEngine, chat: bool, num_top: int):
        self.tokenizer, self.chat, self.num_top = engine.tokenizer, chat, num_top
        # completions' text offsets: characters decoded so far, fed one token's bytes at a time (O(1) a token)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0

    def entries(self, token_ids: list[int], logprobs: list[dict[int, float] | None]) -> dict[str, Any]:
        """A None entry (an echoed prompt's first token) has no logprob and no alternatives."""
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)
                                if lp is not None]}
        offsets = []
        for t in token_ids:
            offsets.append(self.offset)
            # a special token (BOS) decodes to nothing in the text, so it takes no characters
            raw = self.tokenizer.token_bytes(t) if self.tokenizer.decode([t]) else b""
            self.offset += len(self.utf8.decode(raw))
        name = self.tokenizer.token_text
        return {"tokens": [name(t) for t in token_ids],
                "token_logprobs": [None if lp is None else lp.get(t)
                                   for t, lp in zip(token_ids, logprobs, strict=True)],
                "top_logprobs": [None if lp is None else {name(k): v for k, v in lp.items()} for lp in logprobs],
                "text_offset": offsets}

    def _chat_entry(self, token: int, logprobs: dict[int, float]) -> dict[str, Any]:
        def one(t: int, value: float) -> dict[str, Any]:
            return {"token": self.tokenizer.token_text(t), "logprob": value,
                    "bytes": list(self.tokenizer.token_bytes(t))}

        top = sorted(logprobs.items(), key=lambda kv: -kv[1])[: self.num_top]
        return one(token, logprobs[token]) | {"top_logprobs": [one(t, v) for t, v in top]}


def _usage(finals: list[RequestOutput]) -> dict[str, int]:
    num_prompt = sum(len(f.prompt_token_ids) for f in finals)
    num_out = sum(len(o.token_ids) for f in finals for o in f.outputs)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out}


async def _watch_disconnect(raw: Request, engine: AsyncEngine, request_ids: list[str]) -> None:
    """Abort the requests as soon as their client hangs up (uvicorn reports http.disconnect on receive)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            for request_id in request_ids:
                engine.abort(request_id)
            return


async def respond(engine: AsyncEngine, params: SamplingParams, prompts: list[str | list[int]], model: str,
                  chat: bool, stream: bool, include_usage: bool, raw: Request, echo: bool = False,
                  prompt_ids: list[list[int]] | None = None, tools: ToolRequest | None = None) -> Any:
    """echo (completions): each choice's text starts with its prompt's text. prompt_ids: the prompts already
    tokenized (off the event loop), which the engine then takes instead of tokenizing on its own thread. tools
    (chat): the output is read for tool calls; streamed, the message then comes whole in the last chunk (a call
    is only known once its text is complete)."""
    kind = "chat.completion" if chat else "text_completion"
    echoed = [(p if isinstance(p, str) else engine.tokenizer.decode(p)) if echo else "" for p in prompts]
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    created, n = int(time.time()), params.n
    watcher = asyncio.create_task(_watch_disconnect(raw, engine, ids))
    inputs: list[str | list[int]] = list(prompt_ids) if prompt_ids is not None else prompts
    streams = [engine.generate(p, params, request_id) for p, request_id in zip(inputs, ids, strict=True)]

    async def close() -> None:
        watcher.cancel()
        for s in streams:
            await s.aclose()  # aborts a request that has not finished

    # Every prompt is submitted before any is awaited; a prompt rejected at once becomes a 400 for the request.
    firsts: list[Delta] = await asyncio.gather(*(anext(s) for s in streams))
    for first in firsts:
        if first.final is not None and first.final.error is not None:
            await close()
            _raise_for(first.final)

    if not stream:
        async def drain(s: AsyncIterator[Delta], delta: Delta) -> RequestOutput:
            while delta.final is None:
                delta = await anext(s)
            return delta.final

        try:
            finals = await asyncio.gather(*(drain(s, f) for s, f in zip(streams, firsts, strict=True)))
        finally:
            await close()
        for final in finals:
            if final.error is not None:
                _raise_for(final)
        choices = [_choice(engine, params, chat, i * n + out.index, out, echoed[i], final, tools)
                   for i, final in enumerate(finals) for out in final.outputs]
        return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices,
                "usage": _usage(finals)}

    def chunk(index: int, text: str | None, finish: str | None, role: bool = False,
              logprobs: dict[str, Any] | None = None) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
            if logprobs is not None:
                choice["logprobs"] = logprobs
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        body = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created, "model": model,
                "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    def tool_chunk(index: int, delta: dict[str, Any], finish: str | None) -> str:
        body = {"id": rid, "object": f"{kind}.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n"

    # One queue merges the prompts' delta streams: (prompt index, delta).
    merged: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()

    async def pump(i: int) -> None:
        delta = firsts[i]
        while True:
            await merged.put((i, delta))
            if delta.final is not None:
                return
            delta = await anext(streams[i])

    async def events() -> AsyncIterator[str]:
        pumps = [asyncio.create_task(pump(i)) for i in range(len(streams))]
        try:
            async for event in _events():
                yield event
        finally:
            # A pump may be inside anext() of its stream: cancel it and let it unwind before closing the streams,
            # or aclose() meets a generator that is still running (a client hanging up mid-stream).
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await close()

    async def _events() -> AsyncIterator[str]:
        num_choices = len(prompts) * n
        texts = [TextStream(engine.tokenizer, params) for _ in range(num_choices)]
        logprobs = [_Logprobs(engine, chat, params.logprobs or 0) for _ in range(num_choices)]
        calls = [tools.stream() for _ in range(num_choices)] if tools is not None else []
        for index in range(num_choices):
            if chat:
                yield chunk(index, None, None, role=True)
            elif echoed[index // n]:
                yield chunk(index, echoed[index // n], None)
        finals: list[RequestOutput] = []
        while len(finals) < len(streams):
            i, delta = await merged.get()
            if delta.final is not None:
                if not delta.final.outputs:  # the engine failed mid-stream
                    yield f"data: {json.dumps({'error': {'message': delta.final.error, 'code': 500}})}\n\n"
                    break
                finals.append(delta.final)
                for out in delta.final.outputs:
                    index = i * n + out.index
                    if calls:
                        yield tool_chunk(index, *calls[index].finish(out.text, out.finish_reason))
                    else:
                        yield chunk(index, texts[index].finish(out.text), out.finish_reason)
                continue
            index = i * n + delta.index
            new = texts[index].push(delta.token_ids)
            if calls:
                if new and (settled := calls[index].push(new)) is not None:
                    yield tool_chunk(index, settled, None)
                continue
            entries = logprobs[index].entries(delta.token_ids, delta.logprobs) \
                if delta.logprobs is not None and params.logprobs is not None else None
            if new or entries is not None:
                yield chunk(index, new, None, logprobs=entries)
        else:
            if include_usage:
                body = {"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                        "usage": _usage(finals)}
                yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _raise_for(final: RequestOutput) -> None:
    """A failed request is the client's fault (400) unless it has no outputs: the engine stopped, or the server is
    shutting down (500)."""
    if not final.outputs:
        raise EngineStopped(final.error)
    raise BadRequest(final.error)


def _choice(engine: AsyncEngine, params: SamplingParams, chat: bool, index: int, out: Any,
            echoed: str = "", final: RequestOutput | None = None, tools: ToolRequest | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "finish_reason": out.finish_reason}
    if chat and tools is not None:
        choice["message"], choice["finish_reason"] = tools.message(out.text, out.finish_reason)
    elif chat:
        choice["message"] = {"role": "assistant", "content": out.text}
    else:
        choice["text"] = echoed + out.text
    if params.logprobs is not None or not chat:
        # the engine may carry logprobs for a request that did not ask (a batch where another did): not shown
        if out.logprobs is None or params.logprobs is None:
            choice["logprobs"] = None
        else:
            ids, lps = list(out.token_ids), list(out.logprobs)
            if echoed and final is not None and final.prompt_logprobs is not None:
                # echo: the prompt's tokens first (the first has no logprob: its entry is None), then the completion's
                ids, lps = final.prompt_token_ids + ids, final.prompt_logprobs + lps
            choice["logprobs"] = _Logprobs(engine, chat, params.logprobs or 0).entries(ids, lps)
    return choice
