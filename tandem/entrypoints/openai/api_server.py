"""`tandem serve`: OpenAI-compatible completions and chat completions (streamed or not), /v1/models, /health and
Prometheus /metrics, over the AsyncEngine. Scope: HTTP, request validation and response shapes.

Errors follow OpenAI's shape, `{"error": {"message", "type", "code"}}`, with status 400 for a bad request
(malformed JSON, unknown model, invalid sampling parameters, a prompt that does not fit the context).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.async_engine import AsyncEngine, EngineStopped, short_error
from tandem.entrypoints.openai.chat_template import ChatTemplate, ChatTemplateError
from tandem.entrypoints.openai.limits import ServerLimits, install_guards
from tandem.entrypoints.openai.prometheus import render_metrics
from tandem.entrypoints.openai.protocol import NotFound, chat_messages, check_unicode, reject_unsupported
from tandem.entrypoints.openai.serving import BadRequest, respond
from tandem.entrypoints.openai.structured import compile_before_submit, structured_outputs_of
from tandem.entrypoints.openai.tokenize import add_tokenizer_routes
from tandem.entrypoints.openai.tool_calls import ToolServing, tool_request
from tandem.sampling_params import MAX_LOGPROBS, SamplingParams
from tandem.structured_output.compiler import grammar_compiler


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # extras are checked: unimplemented ones are a 400 (protocol.py)

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
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object or json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or a batch of them
    logprobs: int | None = None  # top alternatives per token (the sampled token is always included)
    echo: bool = False  # the completion text starts with the prompt


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # chat: no limit but the context, as OpenAI and vLLM (completions: 16)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None


def _error(message: str, status: int = 400) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def build_app(engine: AsyncEngine, served_model_name: str, model_path: str,
              limits: ServerLimits | None = None, chat_template: str | None = None,
              tool_serving: ToolServing | None = None) -> FastAPI:
    app = FastAPI(title="tandem")
    limits = limits or ServerLimits()
    install_guards(app, limits)
    template = ChatTemplate(model_path, chat_template)
    grammars = grammar_compiler(engine.engine.config)
    tool_serving = tool_serving or ToolServing()
    add_tokenizer_routes(app, engine, served_model_name, model_path, template)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}")

    @app.exception_handler(EngineStopped)
    async def _stopped(_request: Request, exc: EngineStopped) -> JSONResponse:
        return _error(str(exc), 500)

    @app.exception_handler(BadRequest)
    async def _bad(_request: Request, exc: BadRequest) -> JSONResponse:
        return _error(str(exc))

    @app.get("/health")
    async def health() -> Any:
        return _error(f"engine stopped: {short_error(engine.error)}", 500) if engine.error else PlainTextResponse("ok")

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

    def params_of(req: _Sampling, max_tokens: int | None, logprobs: int | None = None,
                  prompt_logprobs: int | None = None, logprobs_name: str = "logprobs",
                  max_tokens_name: str = "max_tokens") -> SamplingParams:
        if req.model is not None and req.model != served_model_name:
            raise NotFound(f"model {req.model!r} does not exist: this server serves {served_model_name!r}")
        check_unicode(req.model_dump())
        reject_unsupported(req.model_extra)
        if not 1 <= req.n <= limits.max_n:
            raise BadRequest(f"n={req.n} is not allowed: from 1 to {limits.max_n} choices (--max-n)")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"{logprobs_name}={logprobs} is not allowed: between 0 and {MAX_LOGPROBS}")
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"{max_tokens_name}={max_tokens} is not allowed: at least 1")
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        try:
            return SamplingParams(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                  min_p=req.min_p, max_tokens=max_tokens, stop=stop, seed=req.seed,
                                  ignore_eos=req.ignore_eos, logprobs=logprobs,
                                  stop_token_ids=req.stop_token_ids or [], min_tokens=req.min_tokens,
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  skip_special_tokens=req.skip_special_tokens, prompt_logprobs=prompt_logprobs,
                                  structured_outputs=structured_outputs_of(req.response_format,
                                                                           req.structured_outputs))
        except ValueError as e:  # named as the request names the field
            message = str(e).removeprefix("SamplingParams.")
            for internal, public in (("max_tokens=", f"{max_tokens_name}="), ("logprobs=", f"{logprobs_name}=")):
                if message.startswith(internal):
                    message = public + message.removeprefix(internal)
            raise BadRequest(message) from e

    async def check_prompt(prompt: str | list[int]) -> list[int]:
        """The prompt's token ids; a long text takes a while to tokenize, so that runs off the event loop."""
        if isinstance(prompt, str) and not prompt:
            raise BadRequest("prompt is empty")
        ids = await asyncio.to_thread(engine.tokenizer.encode_off_gil, prompt) if isinstance(prompt, str) else prompt
        if len(ids) >= engine.max_model_len:
            raise BadRequest(f"the prompt has {len(ids)} tokens, but the model's context (max_model_len) is "
                             f"{engine.max_model_len}: the prompt plus at least one generated token must fit")
        return ids

    def respond_to(req: _Sampling, params: SamplingParams, prompts: list[str | list[int]], chat: bool,
                   raw: Request, echo: bool = False, prompt_ids: list[list[int]] | None = None) -> Any:
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        return respond(engine, params, prompts, served_model_name, chat, req.stream, include_usage, raw, echo,
                       prompt_ids)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        score_prompt = req.echo and req.logprobs is not None
        if score_prompt and req.stream:
            raise BadRequest("echo with logprobs is answered non-streamed only (the prompt tokens' logprobs "
                             "come with the final result): set stream to false")
        params = params_of(req, req.max_tokens, req.logprobs, req.logprobs if score_prompt else None)
        if not req.prompt:
            raise BadRequest("prompt is empty")
        batch = isinstance(req.prompt, list) and not isinstance(req.prompt[0], int)
        prompts: list[str | list[int]] = list(req.prompt) if batch else [req.prompt]  # type: ignore[list-item]
        if len(prompts) > limits.max_prompts_per_request:
            raise BadRequest(f"prompt holds {len(prompts)} prompts: at most {limits.max_prompts_per_request} per "
                             "request (--max-prompts-per-request)")
        prompt_ids = [await check_prompt(prompt) for prompt in prompts]
        await compile_before_submit(grammars, params)
        return await respond_to(req, params, prompts, chat=False, raw=raw, echo=req.echo, prompt_ids=prompt_ids)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true")
        top = (req.top_logprobs or 0) if req.logprobs else None
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = params_of(req, limit, top, logprobs_name="top_logprobs",
                           max_tokens_name="max_completion_tokens" if req.max_completion_tokens is not None
                           else "max_tokens")
        messages = chat_messages(req.messages)
        tools = tool_request(req.tools, req.tool_choice, tool_serving)
        forced = tools.constraint() if tools is not None else None
        if forced is not None:
            if params.structured_outputs is not None:
                raise BadRequest(f"tool_choice={tools.mode!r} forces the output's shape: drop response_format / "
                                 "structured_outputs")
            params.structured_outputs = forced
        try:
            prompt = template.render(messages, tools=req.tools or None)
        except ChatTemplateError as e:
            raise BadRequest(str(e)) from e
        ids = await check_prompt(prompt)
        await compile_before_submit(grammars, params)
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        return await respond(engine, params, [prompt], served_model_name, True, req.stream, include_usage, raw,
                             prompt_ids=[ids], tools=tools)

    return app


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(0)


def run_server(args: EngineArgs, host: str, port: int, served_model_name: str | None,
               limits: ServerLimits | None = None, chat_template: str | None = None,
               tool_serving: ToolServing | None = None) -> None:
    import signal

    import uvicorn

    from tandem.assets import default_model
    from tandem.entrypoints.openai.graceful import GracefulServer

    model = args.model or default_model() or ""
    engine = AsyncEngine(args)
    name = served_model_name or Path(model).name
    app = build_app(engine, name, model, limits, chat_template, tool_serving)
    # uvicorn catches SIGINT/SIGTERM, drains, then re-raises the signal once it has stopped; with these
    # handlers in place that re-raise becomes SystemExit, so the `finally` below still stops the ranks.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_cleanly)
    server = GracefulServer(engine, uvicorn.Config(app, host=host, port=port, log_level="info",
                                                   timeout_graceful_shutdown=10))
    # As vLLM does, a dead engine (a rank gone) takes the server down, so a supervisor sees the process exit;
    # the open streams have already received the error.
    engine.on_error = lambda _e: setattr(server, "should_exit", True)
    try:
        server.run()
    finally:
        engine.shutdown()
    if engine.error is not None:
        raise SystemExit(f"tandem serve: engine stopped: {short_error(engine.error)}")
