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
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None


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
        if req.n != 1:
            raise BadRequest(f"n={req.n} is not supported: tandem returns one choice per request (n=1)")
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"max_tokens={max_tokens} is not allowed: at least 1")
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        try:
            return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                                  max_tokens=max_tokens, stop=stop, seed=req.seed, ignore_eos=req.ignore_eos,
                                  logprobs=logprobs)
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
        params = params_of(req, req.max_completion_tokens or req.max_tokens)
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
        self.hold = max((len(s) for s in params.stop or []), default=1) - 1

    def push(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        text = self.tokenizer.decode(self.ids)
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
        out = final.outputs[0]
        usage = {"prompt_tokens": len(final.prompt_token_ids), "completion_tokens": len(out.token_ids),
                 "total_tokens": len(final.prompt_token_ids) + len(out.token_ids)}
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
            choice["logprobs"] = None if out.logprobs is None else {
                "tokens": [engine.tokenizer.decode([t]) for t in out.token_ids],
                "token_logprobs": [lp.get(t) for t, lp in zip(out.token_ids, out.logprobs, strict=True)],
                "top_logprobs": [{engine.tokenizer.decode([k]): v for k, v in lp.items()} for lp in out.logprobs]}
        return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice], "usage": usage}

    include_usage = bool((req.stream_options or {}).get("include_usage"))
    stream = engine.generate(prompt, params, rid)
    first = await anext(stream)  # a request rejected at once becomes a 400, not a broken stream
    if first.final is not None and first.final.error is not None:
        watcher.cancel()
        raise BadRequest(first.final.error)

    def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
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
        text = _TextStream(engine, params)
        if chat:
            yield chunk(None, None, role=True)
        delta = first
        while True:
            if delta.final is not None:
                out = delta.final.outputs[0] if delta.final.outputs else None
                if out is None:  # the engine failed mid-stream
                    yield f"data: {json.dumps({'error': {'message': delta.final.error, 'code': 500}})}\n\n"
                    break
                yield chunk(text.finish(out.text), out.finish_reason)
                if include_usage:
                    n_prompt, n_out = len(delta.final.prompt_token_ids), len(out.token_ids)
                    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
                    yield f"data: {json.dumps({'id': rid, 'object': kind, 'created': created, 'model': model, 'choices': [], 'usage': usage})}\n\n"  # noqa: E501
                break
            new = text.push(delta.token_ids)
            if new:
                yield chunk(new, None)
            delta = await anext(stream)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def run_server(args: EngineArgs, host: str, port: int, served_model_name: str | None) -> None:
    import uvicorn

    from tandem.assets import default_model

    model = args.model or default_model() or ""
    engine = AsyncEngine(args)
    name = served_model_name or Path(model).name
    app = build_app(engine, name, model)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        engine.shutdown()
