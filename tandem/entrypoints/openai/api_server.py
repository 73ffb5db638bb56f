"""`tandem serve`: OpenAI-compatible completions and chat completions (streamed or not), /v1/models, /health and
Prometheus /metrics, over the AsyncEngine. Scope: HTTP, request validation and response shapes.

Errors follow OpenAI's shape, `{"error": {"message", "type", "code"}}`, with status 400 for a bad request
(malformed JSON, unknown model, invalid sampling parameters, a prompt that does not fit the context).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.async_engine import AsyncEngine
from tandem.entrypoints.openai.prometheus import render_metrics
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    # vLLM's extra sampling parameters
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = None  # top alternatives per token (the sampled token is always included)


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


MAX_LOGPROBS = 20  # as vLLM's default max_logprobs and OpenAI's top_logprobs bound


class BadRequest(Exception):
    pass


def _error(message: str, status: int = 400) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _chat_template(model: str) -> str | None:
    path = Path(model) / "tokenizer_config.json"
    if not path.is_file():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    return template if isinstance(template, str) else None


def build_app(engine: AsyncEngine, served_model_name: str, model_path: str) -> FastAPI:
    app = FastAPI(title="tandem")
    template_text = _chat_template(model_path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}")

    @app.exception_handler(BadRequest)
    async def _bad(_request: Request, exc: BadRequest) -> JSONResponse:
        return _error(str(exc))

    @app.get("/health")
    async def health() -> Any:
        return _error(f"engine stopped: {engine.error}", 500) if engine.error else PlainTextResponse("ok")

    @app.get("/version")
    async def version() -> Any:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("tandem")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "tandem", "root": model_path,
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        histograms = [engine.ttft, engine.tpot, engine.e2e]
        return PlainTextResponse(render_metrics(engine.metrics(), engine.engine.draft_mode.mode, histograms),
                                 media_type="text/plain; version=0.0.4")

    def params_of(req: _Sampling, max_tokens: int | None, logprobs: int | None = None) -> SamplingParams:
        if req.model is not None and req.model != served_model_name:
            raise BadRequest(f"model {req.model!r} does not exist: this server serves {served_model_name!r}")
        if req.n < 1:
            raise BadRequest(f"n={req.n} is not allowed: at least 1 choice")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs={logprobs} is not allowed: between 0 and {MAX_LOGPROBS}")
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"max_tokens={max_tokens} is not allowed: at least 1")
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        try:
            return SamplingParams(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                  min_p=req.min_p, max_tokens=max_tokens, stop=stop, seed=req.seed,
                                  ignore_eos=req.ignore_eos, logprobs=logprobs,
                                  stop_token_ids=req.stop_token_ids or [], min_tokens=req.min_tokens,
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  skip_special_tokens=req.skip_special_tokens)
        except ValueError as e:
            raise BadRequest(str(e)) from e

    def check_prompt(prompt: str | list[int]) -> None:
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if len(ids) >= engine.max_model_len:
            raise BadRequest(f"the prompt has {len(ids)} tokens, but the model's context (max_model_len) is "
                             f"{engine.max_model_len}: the prompt plus at least one generated token must fit")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        params = params_of(req, req.max_tokens, req.logprobs)
        check_prompt(req.prompt)
        return await _respond(engine, req, params, req.prompt, served_model_name, chat=False, raw=raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true")
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = params_of(req, req.max_completion_tokens or req.max_tokens, top)
        if template_text is None:
            raise BadRequest(f"model {served_model_name!r} has no chat template (tokenizer_config.json "
                             "chat_template); use /v1/completions")
        import jinja2

        prompt = jinja2.Template(template_text).render(messages=req.messages, add_generation_prompt=True,
                                                       bos_token="", eos_token="")
        check_prompt(prompt)
        return await _respond(engine, req, params, prompt, served_model_name, chat=True, raw=raw)

    return app


class _TextStream:
    """Incremental detokenization: decode the whole output, emit what is new, hold back an unfinished UTF-8
    character and anything that could still turn out to be the start of a stop string."""

    def __init__(self, engine: AsyncEngine, params: SamplingParams):
        self.tokenizer, self.ids, self.sent = engine.tokenizer, [], ""
        self.skip_special_tokens = params.skip_special_tokens
        self.hold = max((len(s) for s in params.stop or []), default=1) - 1

    def push(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        text = self.tokenizer.decode(self.ids, self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""
        ready = text[: len(text) - self.hold] if self.hold else text
        new = ready[len(self.sent):] if ready.startswith(self.sent) else ""
        self.sent += new
        return new

    def finish(self, final_text: str) -> str:
        new = final_text[len(self.sent):] if final_text.startswith(self.sent) else ""
        self.sent += new
        return new


async def _watch_disconnect(raw: Request, engine: AsyncEngine, request_id: str) -> None:
    """Abort the request as soon as its client hangs up (uvicorn reports http.disconnect on receive)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            engine.abort(request_id)
            return


class _Logprobs:
    """OpenAI's logprobs shapes from the engine's per-token {token_id: logprob} (top-n plus the sampled token):
    completions' parallel lists with text offsets, or chat's `content` entries. Tokens are named by their text,
    or `bytes:\\xNN` when they hold part of a UTF-8 character (OpenAI's convention)."""

    def __init__(self, engine: AsyncEngine, chat: bool, num_top: int):
        self.tokenizer, self.chat, self.num_top = engine.tokenizer, chat, num_top
        self.ids: list[int] = []  # completions: the tokens so far, for text offsets

    def entries(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]}
        offsets = []
        for t in token_ids:
            offsets.append(len(self.tokenizer.decode(self.ids).removesuffix("\ufffd")))
            self.ids.append(t)
        name = self.tokenizer.token_text
        return {"tokens": [name(t) for t in token_ids],
                "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs, strict=True)],
                "top_logprobs": [{name(k): v for k, v in lp.items()} for lp in logprobs],
                "text_offset": offsets}

    def _chat_entry(self, token: int, logprobs: dict[int, float]) -> dict[str, Any]:
        def one(t: int, value: float) -> dict[str, Any]:
            return {"token": self.tokenizer.token_text(t), "logprob": value,
                    "bytes": list(self.tokenizer.token_bytes(t))}

        top = sorted(logprobs.items(), key=lambda kv: -kv[1])[: self.num_top]
        return one(token, logprobs[token]) | {"top_logprobs": [one(t, v) for t, v in top]}


def _usage(final: RequestOutput) -> dict[str, int]:
    num_prompt, num_out = len(final.prompt_token_ids), sum(len(o.token_ids) for o in final.outputs)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out}


async def _respond(engine: AsyncEngine, req: _Sampling, params: SamplingParams, prompt: str | list[int],
                   model: str, chat: bool, raw: Request) -> Any:
    kind = "chat.completion" if chat else "text_completion"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    watcher = asyncio.create_task(_watch_disconnect(raw, engine, rid))
    if not req.stream:
        final = None
        try:
            async for delta in engine.generate(prompt, params, rid):
                final = delta.final or final
        finally:
            watcher.cancel()
        assert final is not None
        if final.error is not None:
            raise BadRequest(final.error)
        choices = []
        for out in final.outputs:
            choice: dict[str, Any] = {"index": out.index, "finish_reason": out.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            if params.logprobs is not None or not chat:
                choice["logprobs"] = None if out.logprobs is None else \
                    _Logprobs(engine, chat, params.logprobs or 0).entries(out.token_ids, out.logprobs)
            choices.append(choice)
        return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices,
                "usage": _usage(final)}

    include_usage = bool((req.stream_options or {}).get("include_usage"))
    stream = engine.generate(prompt, params, rid)
    first = await anext(stream)  # a request rejected at once becomes a 400, not a broken stream
    if first.final is not None and first.final.error is not None:
        watcher.cancel()
        raise BadRequest(first.final.error)

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

    async def events() -> AsyncIterator[str]:
        try:
            async for event in _events():
                yield event
        finally:
            watcher.cancel()
            await stream.aclose()  # aborts the request if it has not finished

    async def _events() -> AsyncIterator[str]:
        texts = [_TextStream(engine, params) for _ in range(params.n)]
        logprobs = [_Logprobs(engine, chat, params.logprobs or 0) for _ in range(params.n)]
        if chat:
            for i in range(params.n):
                yield chunk(i, None, None, role=True)
        delta = first
        while True:
            if delta.final is not None:
                if not delta.final.outputs:  # the engine failed mid-stream
                    yield f"data: {json.dumps({'error': {'message': delta.final.error, 'code': 500}})}\n\n"
                    break
                for out in delta.final.outputs:
                    yield chunk(out.index, texts[out.index].finish(out.text), out.finish_reason)
                if include_usage:
                    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                            "usage": _usage(delta.final)}
                    yield f"data: {json.dumps(body)}\n\n"
                break
            new = texts[delta.index].push(delta.token_ids)
            entries = logprobs[delta.index].entries(delta.token_ids, delta.logprobs) \
                if delta.logprobs is not None and params.logprobs is not None else None
            if new or entries is not None:
                yield chunk(delta.index, new, None, logprobs=entries)
            delta = await anext(stream)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(0)


def run_server(args: EngineArgs, host: str, port: int, served_model_name: str | None) -> None:
    import signal

    import uvicorn

    from tandem.assets import default_model

    model = args.model or default_model() or ""
    engine = AsyncEngine(args)
    name = served_model_name or Path(model).name
    app = build_app(engine, name, model)
    # uvicorn catches SIGINT/SIGTERM, drains, then re-raises the signal once it has stopped; with these
    # handlers in place that re-raise becomes SystemExit, so the `finally` below still stops the ranks.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_cleanly)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        engine.shutdown()
