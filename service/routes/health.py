"""``/healthz`` (the process answers), ``/readyz`` (Redis and the object store answer), ``/metrics``."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Response
from pydantic import BaseModel

from ckptconv.core.errors import ServiceUnavailable
from service import metrics
from service.deps import State
from service.schemas.common import problem_responses

router = APIRouter(tags=["health"])

REDIS_PROBE_TIMEOUT = 2.0
STORAGE_PROBE_TIMEOUT = 5.0


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
        "Ready when Redis and the object store (`storage_probe_uri`) answer. Unauthenticated, so it says "
        "ready or not and nothing more: the reason for not ready is logged under the correlation id of the 503."
    ),
    responses=problem_responses(503),
)
async def readyz(state: State) -> Response:
    try:
        await asyncio.wait_for(state.redis.ping(), timeout=REDIS_PROBE_TIMEOUT)
    except Exception as e:
        raise ServiceUnavailable("not ready", reason=f"Redis does not answer: {type(e).__name__}: {e}") from None
    probe = state.settings.storage_probe_uri
    if probe:
        try:
            await asyncio.wait_for(asyncio.to_thread(_probe_storage, probe), timeout=STORAGE_PROBE_TIMEOUT)
        except Exception as e:
            reason = f"the object store does not answer at {probe}: {type(e).__name__}: {e}"
            raise ServiceUnavailable("not ready", reason=reason) from None
    return Response(b'{"status":"ready"}', media_type="application/json")


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
