"""What every request passes before a route reads it: the API key, the key's rate limit, the body size.

- Routes that need an API key (everything under ``/v1/`` except the catalog) answer 401 before a
  byte of the body is read, and 429 (with Retry-After) when the key is over its rate limit
  (``service.limits``). The principal found here is handed to the route (``service.deps``), so a
  request is authenticated once.
- A body larger than ``max_body_bytes`` answers 413: at once when ``Content-Length`` says so, else
  (chunked bodies) as soon as the bytes received pass the limit; the rest is never read, and the
  answer closes the connection (``Connection: close``), as does a 401 or 429 to a request whose
  body is over the limit or of unknown length: the server would otherwise read the whole body to
  find the connection's next request.
- A body not received whole ``body_read_timeout_seconds`` after the request began answers 408 and
  closes the connection (the server waits without limit for a body a client stopped sending).

This is done by the application itself (:class:`EdgesFirst`, the FastAPI app the server runs), in
front of FastAPI's own middleware stack, which each request would otherwise pay for (every layer
wraps the call, ``send`` or ``receive``) before reaching these checks. It then hands the two hottest
requests (submit a job, get a job) to ``service.hot``, which answers them without FastAPI's
per-request machinery, and everything else (other requests, lifespan events) to FastAPI.

What FastAPI's outer layers did for a request answered here, it does the same way: ``scope["app"]``
is set as Starlette sets it, and an unhandled exception gets what Starlette's
``ServerErrorMiddleware`` gives (the application's 500 handler answers, unless the response had
started, and the exception goes on to the server). Not done here: FastAPI's native OpenTelemetry
instrumentation, which is inactive in this service (no OpenTelemetry SDK is installed or configured).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, HTTPException
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.responses import Response

from ckptconv.core.errors import CkptconvError, PayloadTooLarge
from service.deps import CALLER, AppState, authenticate
from service.hot import Handover, HotPaths
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


class EdgesFirst(FastAPI):
    """The service's FastAPI application: the checks above, then ``service.hot`` or FastAPI."""

    def __init__(self, *, hot: HotPaths | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hot = hot
        # The application's state, set by the lifespan with ``app.state.ckptconv`` (which the routes
        # read): a plain attribute here, as Starlette's State finds its entries in its __getattr__,
        # after an AttributeError, which cost more than the rest of the checks of a cached key.
        self.ckptconv: AppState | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan events (and websockets, of which there are none)
            await super().__call__(scope, receive, send)
            return
        if self.root_path:  # as FastAPI sets it
            scope["root_path"] = self.root_path
        scope["app"] = self  # as Starlette sets it (a Request's app: the problem handler reads it)
        started = False
        try:
            state: AppState = self.ckptconv  # type: ignore[assignment]  # None before startup: a 500 below
            limit = state.settings.max_body_bytes
            receive = _bounded(receive, limit, state.settings.body_read_timeout_seconds)
            answer = await _refusal(state, scope, limit)
            if answer is None:
                handler = self.hot.handler(scope) if self.hot is not None else None
                if handler is None:
                    answer = Handover(receive)
                else:
                    answer = await handler(state, scope, receive)
            if type(answer) is tuple:
                status, headers, body = answer
                # The headers Starlette's Response sends, in its order.
                headers.append((b"content-length", str(len(body)).encode()))
                headers.append((b"content-type", b"application/json"))
                started = True
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            if isinstance(answer, Response):
                started = True
                await answer(scope, receive, send)
                return
        except Exception as exc:
            await self._server_error(exc, scope, receive, send, started)
            raise
        # FastAPI answers (with its own server-error handling), reading the body from answer.receive.
        await super().__call__(scope, answer.receive, send)

    async def _server_error(
        self, exc: Exception, scope: dict[str, Any], receive: Any, send: Any, started: bool
    ) -> None:
        """What Starlette's ServerErrorMiddleware, with the handler FastAPI gives it, does for ``exc``
        (it raises ``exc`` again): the same middleware, around a call that raises ``exc``."""
        handler = None
        for key, value in self.exception_handlers.items():  # as FastAPI.build_middleware_stack picks it
            if key in (500, Exception):
                handler = value

        async def reraise(scope: dict[str, Any], receive: Any, send: Any) -> None:
            raise exc

        async def sent_already(message: dict[str, Any]) -> None:
            pass  # the handler still runs (it logs the error), but nothing more is sent

        middleware = ServerErrorMiddleware(reraise, handler=handler, debug=self.debug)
        await middleware(scope, receive, sent_already if started else send)


async def _refusal(state: AppState, scope: dict[str, Any], limit: int) -> Response | None:
    """The problem answer to a request refused here (no key, over its rate limit, too large), or None."""
    length = content_length(scope)
    try:
        if needs_key(scope["path"]):
            scope[CALLER] = caller = await authenticate(state, scope)
            await state.limiter.take(caller.id)
        if length is not None and length > limit:
            raise PayloadTooLarge(f"the request body has {length} bytes; this service accepts at most {limit}")
    except Exception as e:
        error = e if isinstance(e, CkptconvError) else as_error(e, scope["method"], scope["path"])
        response = problem_response(error, scope["path"], method=scope["method"])
        if (length is None and _chunked(scope)) or (length is not None and length > limit):
            # The body is not read: kept open, the connection would make the server read (and
            # throw away) all of a body this large or unbounded before the client's next request.
            response.headers["connection"] = "close"
        return response
    return None


def _chunked(scope: dict[str, Any]) -> bool:
    return any(name == b"transfer-encoding" for name, _ in scope["headers"])


def _bounded(receive: Any, limit: int, seconds: float) -> Any:
    """``receive``, refusing a body of more than ``limit`` bytes (413) or one not received whole
    ``seconds`` from now (408). Once the body is whole, what follows (the client's disconnect, which
    an event stream waits for) is waited for without limit."""
    seen = 0
    whole = False
    deadline = asyncio.get_running_loop().time() + seconds

    async def bounded_receive() -> dict[str, Any]:
        nonlocal seen, whole
        if whole:
            return await receive()
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            # The connection closes after the answer: the rest of the body would be read as the
            # next request, and the client has shown it may never send it.
            raise HTTPException(
                408, detail=f"the request body was not received within {seconds:g} s", headers={"Connection": "close"}
            ) from None
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                # FastAPI passes HTTPException through its body parsing; service.problems renders it.
                # The rest of the body is not read: the connection closes after the answer.
                raise HTTPException(
                    413,
                    detail=f"the request body exceeds this service's limit of {limit} bytes",
                    headers={"Connection": "close"},
                )
            whole = not message.get("more_body", False)
        else:
            whole = True  # the client left
        return message

    return bounded_receive
