"""``POST /v1/plans`` (dry run of a job) and ``GET /v1/inspect`` (a checkpoint's contents), answered by a worker."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from ckptconv.jobs.kinds import get_kind
from service.deps import IdempotencyKey, authorized, fingerprint, idempotency_record_key
from service.idempotency import idempotent
from service.schemas.common import FormatName, problem_responses
from service.schemas.jobs import PlanRequest
from service.schemas.plans import InspectView, Plan
from service.scopes import scoped_refs
from service.worker_calls import call_worker

router = APIRouter(prefix="/v1", tags=["plans"])

WORKER_ERRORS = (401, 403, 404, 408, 409, 422, 500, 502, 503)


@router.post(
    "/plans",
    response_model=Plan,
    summary="Dry run: what a job would write",
    description=(
        "Computed by a worker from the source's metadata (no tensor data is read): outputs, shard "
        "layout, sizes, estimated peak memory and the problems a job would hit. Takes the same body "
        "as POST /v1/jobs (labels, webhook and max_runtime_seconds aside)."
    ),
    responses=problem_responses(*WORKER_ERRORS),
)
async def create_plan(body: PlanRequest, request: Request, idempotency_key: IdempotencyKey = None) -> Response:
    call = await authorized(request)
    state, caller = call.state, call.caller
    kind = get_kind(body.kind)
    source, target = scoped_refs(caller, body)
    payload = {
        "kind": kind.name,
        "source": source,
        "target": target,
        "options": body.options.model_dump(mode="json", exclude_none=True),
        "scopes": caller.scopes.to_record(),
    }

    async def produce() -> Response:
        plan = await call_worker(state, "ckptconv.plan", payload)
        return Response(json.dumps(plan, separators=(",", ":")), media_type="application/json")

    record_key = idempotency_record_key(state, caller, idempotency_key) if idempotency_key else None
    fp = fingerprint("POST", "/v1/plans", body.model_dump(mode="json")) if record_key else ""
    return await idempotent(state, request, record_key, fp, produce)


@router.get(
    "/inspect",
    response_model=InspectView,
    summary="Inspect a checkpoint",
    description="Format, release, key count, bytes, dtypes and every entry, read by a worker from metadata only.",
    responses=problem_responses(*WORKER_ERRORS),
)
async def inspect_checkpoint(
    request: Request,
    uri: Annotated[str, Query(min_length=1, max_length=2048, description="s3://bucket/key or an absolute path")],
    format: Annotated[FormatName | None, Query(description="detected when omitted")] = None,
) -> Response:
    call = await authorized(request)
    canonical = call.caller.check_uri(uri)
    view = await call_worker(
        call.state, "ckptconv.inspect", {"uri": canonical, "format": format, "scopes": call.caller.scopes.to_record()}
    )
    return Response(json.dumps(view, separators=(",", ":")), media_type="application/json")
