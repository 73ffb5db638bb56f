"""What one client may ask of `tandem serve`: an API key on /v1/*, a request-body size, choices and prompts per
request. Checked at the edge (an ASGI middleware for the key and the size, before the body is read or parsed),
so an oversized or unauthenticated request costs nothing. Unhandled errors become a short 500 in OpenAI's shape
with the traceback in the log."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tandem import envs

logger = logging.getLogger("tandem")
API_KEY_ENV = "TANDEM_API_KEY"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class ServerLimits:
    max_n: int = 128  # OpenAI's bound on n
    max_prompts_per_request: int = 256  # completions' prompt as a list
    max_request_bytes: int = 8 << 20
    api_key: str | None = None  # None: no key; the CLI falls back to $TANDEM_API_KEY

    def __post_init__(self) -> None:
        for name in ("max_n", "max_prompts_per_request", "max_request_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed: a positive integer")
        from tandem.sampling_params import MAX_N

        if self.max_n > MAX_N:
            raise ValueError(f"max_n={self.max_n} is not allowed: at most {MAX_N}")

    @staticmethod
    def with_env_key(api_key: str | None, **kwargs: Any) -> ServerLimits:
        return ServerLimits(api_key=api_key or envs.api_key(), **kwargs)


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            413: "RequestTooLargeError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "code": status}}


class EdgeGuard:
    """ASGI middleware: 401 on /v1/* without `Authorization: Bearer KEY`; 413 for a body over the limit, from
    Content-Length before anything is read, or while reading a chunked body (it is buffered up to the limit and
    replayed to the app; later receives, such as http.disconnect, pass through)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limits: ServerLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.limits.api_key is not None and scope["path"].startswith("/v1/") \
                and not _key_matches(headers.get("authorization", ""), self.limits.api_key):
            return await _reply(send, 401, "invalid or missing API key: send the header "
                                           "'Authorization: Bearer <key>' with the server's --api-key")
        limit = self.limits.max_request_bytes
        too_big = f"the request body is larger than the server's limit of {limit} bytes (--max-request-bytes)"
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return await _reply(send, 413, too_big)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away while sending
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await _reply(send, 413, too_big)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _key_matches(header: str, key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


async def _reply(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(message, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_guards(app: FastAPI, limits: ServerLimits) -> None:
    """The edge middleware, 404 for an unknown model, and a short 500 for anything unexpected."""
    from tandem.entrypoints.openai.protocol import NotFound

    app.add_middleware(EdgeGuard, limits=limits)

    @app.exception_handler(NotFound)
    async def _not_found(_request: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 404), status_code=404)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error ({type(exc).__name__}); see the server log", 500),
                            status_code=500)
