"""Shared dependencies of the routes: the application's state and the calling principal."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Header, Request

from ckptconv.core.auth import DEV_PRINCIPAL, KeyRegistry, Principal
from ckptconv.core.jobstore import AsyncJobStore, RedisKeys
from ckptconv.core.settings import Settings
from service.limits import RateLimiter, StreamSlots
from service.queue import TaskMessages


@dataclass
class AppState:
    settings: Settings
    redis: Any  # redis.asyncio.Redis (decode_responses=True)
    keys: RedisKeys
    store: AsyncJobStore
    auth: KeyRegistry
    messages: TaskMessages
    limiter: RateLimiter
    streams: StreamSlots
    # What blocks (event streams' XREAD, dry-run waits' BLPOP) has its own bounded pool, so that it
    # can never take the connections of the short commands.
    blocking_redis: Any
    open_streams: int = 0


async def app_state(request: Request) -> AppState:
    # async: FastAPI runs plain functions in a thread pool, which costs more than this whole call.
    return request.app.state.ckptconv


State = Annotated[AppState, Depends(app_state)]

# The bearer scheme is declared in the OpenAPI document by service.app.build_openapi; the header is
# read here directly, which is cheaper than FastAPI's security classes on the hot path.
BEARER_SCHEME = {"type": "http", "scheme": "bearer", "description": "an API key: `Authorization: Bearer ckc_...`"}


CALLER = "ckptconv.caller"  # the scope entry service.edges hands the authenticated principal over in


def bearer_token(scope: dict[str, Any]) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


async def authenticate(state: AppState, scope: dict[str, Any]) -> Principal:
    if state.settings.auth_disabled:
        return DEV_PRINCIPAL
    return await state.auth.authenticate(bearer_token(scope))


async def principal(request: Request) -> Principal:
    # service.edges authenticated the request already (before its body was read).
    return request.scope.get(CALLER) or await authenticate(request.app.state.ckptconv, request.scope)


@dataclass(frozen=True)
class Call:
    """What an authenticated route needs: the application's state and who is calling."""

    state: AppState
    caller: Principal


async def authorized(request: Request) -> Call:
    """The state and caller of an authenticated route. Routes call it first thing rather than
    declaring it a dependency: FastAPI's resolution of a dependency costs more than this call (about
    9 us per request, measured), and a route whose every request pays it is on the hot path."""
    return Call(request.app.state.ckptconv, await principal(request))


IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        description="repeat a request safely: the same key with the same body replays the first response",
    ),
]


# json.dumps(..., sort_keys=True, separators=(",", ":"), default=str), without a JSONEncoder built per
# call. The text is stored with each Idempotency-Key: it must not change.
_FINGERPRINT_ENCODE = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str).encode


def fingerprint(method: str, path: str, body: Any) -> str:
    """What makes two requests "the same" for Idempotency-Key: method, path and the validated body."""
    doc = _FINGERPRINT_ENCODE([method, path, body])
    return hashlib.sha256(doc.encode()).hexdigest()


def idempotency_record_key(state: AppState, caller: Principal, key: str) -> str:
    return state.keys.idempotency(caller.id, hashlib.sha256(key.encode()).hexdigest())
