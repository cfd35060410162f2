"""The two hot paths, ``POST /v1/jobs`` and ``GET /v1/jobs/{id}``, answered without FastAPI's
per-request machinery (routing, the request object, dependency and parameter resolution, body
parsing, the exception middleware), which cost more CPU than everything else these requests do.

The FastAPI routes stay declared (they are the OpenAPI document, and they answer what this module
hands back). A request takes the short way only in its usual shape: ``Content-Type:
application/json``, a body that parses and validates, an ``Idempotency-Key`` of 1 to 255
characters or none. Any other request (no or another content type, an empty, malformed or invalid
body, a client gone mid-body) is handed to the FastAPI route with the bytes already read, so its
answer is FastAPI's own, error for error. The body is validated by the route's own field (the
same pydantic adapter, called as FastAPI calls it), and the job is created by the route's own code
(``service.routes.jobs.submit``): both ways give the same responses.

``service.edges`` calls :meth:`HotPaths.handler` after it authenticated the request, took it from
the key's rate limit and checked its ``Content-Length`` (so the body limit holds here too), and
sends what the handler answers (see :data:`Answer`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ckptconv.core.errors import CkptconvError
from service.deps import CALLER, AppState
from service.problems import handle
from service.routes import jobs
from service.routes.jobs import create, job_document

JOBS = "/v1/jobs"
JOB_PREFIX = "/v1/jobs/"
MAX_IDEMPOTENCY_KEY = 255  # service.deps.IdempotencyKey's max_length; longer ones are FastAPI's 422
# What the FastAPI app's exception middleware answers; anything else goes on up, as it does from a
# route, to the server-error handling (service.edges: the same handler, and the error is logged).
HANDLED = (CkptconvError, HTTPException)


class Handover:
    """An answer that leaves the request to the FastAPI route, whose body it reads from ``receive``."""

    __slots__ = ("receive",)

    def __init__(self, receive: Any) -> None:
        self.receive = receive


# A JSON document as (status, headers, body): sent as raw ASGI messages, with the headers a Starlette
# Response adds (content-length, content-type) after ``headers``; a Starlette Response, sent as it is;
# or a Handover.
Answer = tuple[int, list[tuple[bytes, bytes]], bytes] | Response | Handover
Handler = Callable[[AppState, dict[str, Any], Any], Awaitable[Answer]]


class HotPaths:
    def __init__(self) -> None:
        route = next(r for r in jobs.router.routes if isinstance(r, APIRoute) and r.endpoint is jobs.create_job)
        (self._body,) = route.dependant.body_params  # the request body's field, as FastAPI validates it

    def handler(self, scope: dict[str, Any]) -> Handler | None:
        """The short way for this request, or None (the FastAPI routes answer it)."""
        path, method = scope["path"], scope["method"]
        if method == "POST" and path == JOBS:
            return self._submit
        if method == "GET" and path.startswith(JOB_PREFIX):
            job_id = path[len(JOB_PREFIX) :]
            if job_id and "/" not in job_id:  # the route's {job_id}
                return self._status
        return None

    async def _status(self, state: AppState, scope: dict[str, Any], receive: Any) -> Answer:
        try:
            body = await job_document(state, scope[CALLER], scope["path"][len(JOB_PREFIX) :])
        except HANDLED as e:
            return await _problem(e, scope)
        return 200, [], body

    async def _submit(self, state: AppState, scope: dict[str, Any], receive: Any) -> Answer:
        content_type = idempotency_key = None
        for name, value in scope["headers"]:
            if name == b"content-type" and content_type is None:
                content_type = value
            elif name == b"idempotency-key" and idempotency_key is None:
                idempotency_key = value
        usual = content_type is not None and _is_plain_json(content_type)
        if idempotency_key is not None and not 0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY:
            usual = False
        if not usual:
            return Handover(receive)
        messages: list[dict[str, Any]] = []
        chunks: list[bytes] = []
        try:
            while True:
                message = await receive()  # service.edges bounds it: HTTPException 413 past the limit
                messages.append(message)
                if message["type"] != "http.request":
                    return Handover(_replay(messages, receive))  # the client left: as FastAPI does
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except HTTPException as e:
            return await _problem(e, scope)
        raw = b"".join(chunks)
        body = None
        if raw:
            try:
                doc = json.loads(raw)  # as FastAPI's Request.json()
            except (ValueError, RecursionError):  # RecursionError: arrays or objects nested too deep
                doc = None
            else:
                body, errors = self._body.validate(doc, {}, loc=("body",))
                if errors:
                    body = None
        if body is None:  # FastAPI answers (its own 400 or 422, exactly)
            return Handover(_replay(messages, receive))
        key = idempotency_key.decode("latin-1") if idempotency_key is not None else None
        try:
            created = await create(state, scope[CALLER], body, key)
        except HANDLED as e:
            return await _problem(e, scope)
        if isinstance(created, Response):  # an Idempotency-Key's first response, replayed
            return created
        job_id, document = created
        # What service.routes.jobs.submit answers; Starlette encodes header values as latin-1.
        return 202, [(b"location", (JOB_PREFIX + job_id).encode("latin-1"))], document


def _is_plain_json(content_type: bytes) -> bool:
    """``application/json``, with or without parameters (other spellings are left to FastAPI)."""
    media = content_type.partition(b";")[0].strip().lower()
    return media == b"application/json"


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    """A receive that gives ``messages`` again, then what ``receive`` gives."""
    pending = list(messages)

    async def replay() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


async def _problem(exc: Exception, scope: dict[str, Any]) -> Response:
    """What the exception middleware answers for ``exc`` on the FastAPI route."""
    return await handle(Request(scope), exc)
