"""The one exception handler: every error leaves the API as an RFC 9457 problem document.

Whatever was raised (a ckptconv error, a request validation error, Starlette's 404/405 for unknown
routes, a lost Redis connection, a bug) is first turned into a
:class:`~ckptconv.core.errors.CkptconvError` and then rendered by its ``to_problem``, so clients can
always branch on ``code``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckptconv.core import errors
from service.schemas.common import PROBLEM_JSON

log = logging.getLogger("ckptconv.api")

_BY_STATUS: dict[int, type[errors.CkptconvError]] = {
    400: errors.InvalidRequest,
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    405: errors.MethodNotAllowed,
    408: errors.BodyTimeout,  # the only 408 raised as an HTTPException (service.edges)
    409: errors.Conflict,
    413: errors.PayloadTooLarge,
    422: errors.InvalidRequest,
    429: errors.RateLimited,
    503: errors.ServiceUnavailable,
}


def as_error(exc: BaseException, method: str, path: str) -> errors.CkptconvError:
    if isinstance(exc, errors.CkptconvError):
        return exc
    if isinstance(exc, RequestValidationError):
        problems = [_validation_item(e) for e in exc.errors()]
        first = problems[0] if problems else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"]) or "request"
        return errors.InvalidRequest(f"{where}: {first['msg']}", errors=problems)
    if isinstance(exc, StarletteHTTPException):
        klass = _BY_STATUS.get(exc.status_code)
        if exc.status_code == 404:
            return errors.NotFound(f"no such resource: {method} {path}")
        if exc.status_code == 405:
            return errors.MethodNotAllowed(f"{method} is not allowed on {path}")
        if klass is not None:
            return klass(str(exc.detail))
    if is_redis_error(exc):
        error: errors.CkptconvError = errors.ServiceUnavailable(f"Redis did not answer: {type(exc).__name__}: {exc}")
    else:
        error = errors.CkptconvError(f"unhandled {type(exc).__name__}: {exc}")
    error.__cause__ = exc  # logged with its traceback (problem_response)
    return error


def _validation_item(e: dict[str, Any]) -> dict[str, Any]:
    return {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}


def is_redis_error(exc: BaseException) -> bool:
    import redis.exceptions

    return isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError)


def problem_response(
    error: errors.CkptconvError, path: str | None = None, headers: dict[str, str] | None = None, method: str = ""
) -> JSONResponse:
    """The problem document of ``error`` with the headers its status calls for; a server error (5xx)
    is logged and answered with a correlation id only (``CkptconvError.public``)."""
    headers = dict(headers or {})
    retry_after = getattr(error, "retry_after", None)
    error = error.public(log, f"{method} {path or ''}".strip())
    if "correlation_id" in error.details:
        headers["Correlation-Id"] = str(error.details["correlation_id"])
    doc = error.to_problem(instance=path)
    if error.http_status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="ckptconv"'
    if error.http_status in (429, 503):
        headers["Retry-After"] = str(retry_after or 5)
    return JSONResponse(doc, status_code=error.http_status, media_type=PROBLEM_JSON, headers=headers)


async def handle(request: Request, exc: Exception) -> JSONResponse:
    # Starlette's own errors carry headers that must survive (405's Allow).
    headers = dict(getattr(exc, "headers", None) or {}) if isinstance(exc, StarletteHTTPException) else {}
    if isinstance(exc, StarletteHTTPException) and exc.status_code == 405:
        headers["Allow"] = ", ".join(_allowed_methods(request))
    return problem_response(as_error(exc, request.method, request.url.path), request.url.path, headers, request.method)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route offers at this path (Starlette names only the first route's)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE and getattr(route, "methods", None):
            methods |= set(route.methods)
    return sorted(methods)


def install(app: FastAPI) -> None:
    """Route every exception type to :func:`handle`."""
    for klass in (errors.CkptconvError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(klass, handle)
