"""What every request passes before a route reads it: the API key, the key's rate limit, the body size.

- Routes that need an API key (everything under ``/v1/`` except the catalog) answer 401 before a
  byte of the body is read, and 429 (with Retry-After) when the key is over its rate limit
  (``service.limits``). The principal found here is handed to the route (``service.deps``), so a
  request is authenticated once.
- A body larger than ``max_body_bytes`` answers 413: at once when ``Content-Length`` says so, else
  (chunked bodies) as soon as the bytes received pass the limit; the rest is never read.

A plain ASGI middleware (no per-request objects beyond a closure): it sits on the hot path. It also
hands the two hottest requests (submit a job, get a job) to ``service.hot``, which answers them
without FastAPI's per-request machinery.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException

from ckptconv.core.errors import CkptconvError, PayloadTooLarge
from service.deps import CALLER, authenticate
from service.hot import HotPaths
from service.problems import as_error, problem_response

# Under /v1/, only these answer without a key (what the service converts, not whose data).
PUBLIC_PREFIXES = ("/v1/formats", "/v1/kinds", "/v1/models")


def needs_key(path: str) -> bool:
    return path.startswith("/v1/") and not path.startswith(PUBLIC_PREFIXES)


def content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class Edges:
    def __init__(self, app: Any, hot: HotPaths | None = None) -> None:
        self.app = app
        self.hot = hot

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope["app"].state.ckptconv
        limit = state.settings.max_body_bytes
        try:
            if needs_key(scope["path"]):
                scope[CALLER] = caller = await authenticate(state, scope)
                await state.limiter.take(caller.id)
            length = content_length(scope)
            if length is not None and length > limit:
                raise PayloadTooLarge(f"the request body has {length} bytes; this service accepts at most {limit}")
        except Exception as e:
            error = e if isinstance(e, CkptconvError) else as_error(e, scope["method"], scope["path"])
            await problem_response(error, scope["path"], method=scope["method"])(scope, receive, send)
            return
        handler = self.hot.handler(scope) if self.hot is not None else None
        if handler is not None:
            await handler(scope, _bounded(receive, limit), send, self.app)
            return
        await self.app(scope, _bounded(receive, limit), send)


def _bounded(receive: Any, limit: int) -> Any:
    seen = 0

    async def bounded_receive() -> dict[str, Any]:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                # FastAPI passes HTTPException through its body parsing; service.problems renders it.
                raise HTTPException(413, detail=f"the request body exceeds this service's limit of {limit} bytes")
        return message

    return bounded_receive
