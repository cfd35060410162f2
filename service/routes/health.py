"""``/healthz`` (the process answers), ``/readyz`` (Redis and the object store answer), ``/metrics``."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Response
from pydantic import BaseModel

from ckptconv.core.errors import ServiceUnavailable
from service import metrics
from service.deps import State
from service.schemas.common import problem_responses

router = APIRouter(tags=["health"])

STORAGE_PROBE_TIMEOUT = 5.0


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    redis_ms: float
    storage: str


@router.get("/healthz", response_model=Health, summary="Liveness")
async def healthz() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


@router.get("/readyz", response_model=Readiness, summary="Readiness", responses=problem_responses(503))
async def readyz(state: State) -> Readiness:
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(state.redis.ping(), timeout=2.0)
    except Exception as e:
        raise ServiceUnavailable(f"Redis does not answer: {type(e).__name__}: {e}") from None
    redis_ms = (time.perf_counter() - t0) * 1000
    probe = state.settings.storage_probe_uri
    storage = "not configured"
    if probe:
        try:
            await asyncio.wait_for(asyncio.to_thread(_probe_storage, probe), timeout=STORAGE_PROBE_TIMEOUT)
        except Exception as e:
            raise ServiceUnavailable(f"the object store does not answer at {probe}: {type(e).__name__}: {e}") from None
        storage = "ok"
    return Readiness(status="ok", redis_ms=round(redis_ms, 2), storage=storage)


def _probe_storage(uri: str) -> None:
    from ckptconv.storage import open_storage

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
