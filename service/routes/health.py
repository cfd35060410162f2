"""``/healthz`` (the process answers), ``/readyz`` (Redis and the object store answer, and in
production Redis persists what it holds), ``/metrics``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

from fastapi import APIRouter, Response
from pydantic import BaseModel

from ckptconv.core.errors import ServiceUnavailable
from ckptconv.storage import open_storage
from service import metrics
from service.deps import State
from service.schemas.common import problem_responses

router = APIRouter(tags=["health"])

REDIS_PROBE_TIMEOUT = 2.0
STORAGE_PROBE_TIMEOUT = 5.0
PERSISTENCE_RECHECK_SECONDS = 30.0

log = logging.getLogger("ckptconv.api")
_persistence: dict[int, tuple[float, str | None]] = {}  # id(redis client) -> (checked at, problem)


class Health(BaseModel):
    status: str


@router.get("/healthz", response_model=Health, summary="Liveness")
async def healthz() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


class Readiness(BaseModel):
    status: Literal["ready"]


@router.get(
    "/readyz",
    response_model=Readiness,
    summary="Readiness",
    description=(
        "Ready when Redis and the object store (`storage_probe_uri`) answer and, in production, Redis "
        "persists its data (an append-only file or snapshots: a Redis without either loses every job on a "
        "restart). Unauthenticated, so it says ready or not and nothing more: the reason for not ready is "
        "logged under the correlation id of the 503."
    ),
    responses=problem_responses(503),
)
async def readyz(state: State) -> Response:
    try:
        await asyncio.wait_for(state.redis.ping(), timeout=REDIS_PROBE_TIMEOUT)
    except Exception as e:
        raise ServiceUnavailable("not ready", reason=f"Redis does not answer: {type(e).__name__}: {e}") from None
    if state.settings.environment == "production":
        problem = await _persistence_problem(state.redis)
        if problem:
            raise ServiceUnavailable("not ready", reason=problem)
    probe = state.settings.storage_probe_uri
    if probe:
        try:
            await asyncio.wait_for(asyncio.to_thread(_probe_storage, probe), timeout=STORAGE_PROBE_TIMEOUT)
        except Exception as e:
            reason = f"the object store does not answer at {probe}: {type(e).__name__}: {e}"
            raise ServiceUnavailable("not ready", reason=reason) from None
    return Response(b'{"status":"ready"}', media_type="application/json")


async def _persistence_problem(redis: Any) -> str | None:
    """Why this Redis would lose the jobs it holds on a restart, or None (asked every 30 s).

    ``CONFIG GET appendonly`` and ``save``: neither an append-only file nor snapshot points means a
    restart empties it (every queued and running job, API keys stored there, Idempotency-Keys).
    Snapshots alone lose what changed since the last one; that is ready, with a warning in the log.
    A Redis that refuses CONFIG (managed services rename it) cannot be asked: ready, logged.
    """
    now = time.monotonic()
    cached = _persistence.get(id(redis))
    if cached is not None and now - cached[0] < PERSISTENCE_RECHECK_SECONDS:
        return cached[1]
    problem: str | None = None
    try:
        aof = (await asyncio.wait_for(redis.config_get("appendonly"), REDIS_PROBE_TIMEOUT)).get("appendonly")
        save = (await asyncio.wait_for(redis.config_get("save"), REDIS_PROBE_TIMEOUT)).get("save")
    except Exception as e:
        log.warning("cannot check whether Redis persists its data (CONFIG GET refused: %s); assuming it does", e)
    else:
        if aof != "yes" and not (save or "").strip():
            problem = (
                "Redis has no persistence (appendonly no, no save points): a restart would lose every job; "
                "run it with --appendonly yes (production mode refuses to be ready without it)"
            )
            log.error("not ready: %s", problem)
        elif aof != "yes":
            log.warning("Redis persists by snapshots only (save %s): a restart loses what changed since the last", save)
    _persistence[id(redis)] = (now, problem)
    return problem


def _probe_storage(uri: str) -> None:
    for _ in open_storage(uri).list(uri):
        break


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {metrics.CONTENT_TYPE: {"schema": {"type": "string"}}}}, **problem_responses(503)},
)
async def prometheus_metrics(state: State) -> Response:
    return Response(await metrics.render(state), media_type=metrics.CONTENT_TYPE)
