"""``/v1/jobs``: long-running operations (create, get, list, cancel, follow).

Shaped after Google's long-running operations (a resource with ``done``, ``error`` or ``result``,
``:cancel`` as ``POST …/cancel``) and SageMaker compilation jobs (states, failure reason,
timestamps, output locations). The hot paths are one Redis round trip each: creating a job is one
script (record + indexes + Idempotency-Key record + queue message), reading one is one HGETALL;
the caller's API key is resolved from an in-process cache.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from ckptconv.core import webhooks
from ckptconv.core.auth import Principal
from ckptconv.core.errors import (
    Cancelled,
    Conflict,
    InvalidRequest,
    NotFound,
    ServiceUnavailable,
    StorageUnavailable,
    TargetTaken,
)
from ckptconv.core.job_records import TERMINAL, job_resource, new_job_id, new_record, now_ms
from ckptconv.engine.staging import sibling_holders
from ckptconv.jobs.kinds import get_kind
from service.deps import AppState, IdempotencyKey, authorized, fingerprint, idempotency_record_key
from service.idempotency import replay
from service.schemas.common import problem_responses
from service.schemas.jobs import JOB_EVENT, Job, JobList, JobRequest, JobState, KindName
from service.scopes import check_staging, scoped_refs
from service.targets import refuse_existing_target

router = APIRouter(prefix="/v1", tags=["jobs"])

JOB_ID = re.compile(r"^job_[0-9a-f]{32}$")
JobId = Annotated[str, Path(description="a job id (job_…)")]
SSE_KEEPALIVE_MS = 15_000


# One encoder for every document: json.dumps with other than its default arguments builds a new
# JSONEncoder per call, a microsecond of a submission's CPU (two per job).
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def _json(doc: Any) -> bytes:
    return _ENCODE(doc).encode()


async def _owned(state: AppState, caller: Principal, job_id: str) -> dict[str, str]:
    rec = await state.store.get(job_id) if JOB_ID.match(job_id) else None
    if rec is None or rec.get("owner") != caller.id:
        raise NotFound(f"no job {job_id}")
    return rec


@router.post(
    "/jobs",
    status_code=202,
    response_model=Job,
    summary="Submit a job",
    responses={
        202: {"headers": {"Location": {"description": "the job's URL", "schema": {"type": "string"}}}},
        **problem_responses(401, 403, 409, 422, 503),
    },
)
async def create_job(body: JobRequest, request: Request, idempotency_key: IdempotencyKey = None) -> Response:
    call = await authorized(request)
    return await submit(call.state, call.caller, body, idempotency_key)


async def submit(state: AppState, caller: Principal, body: Any, idempotency_key: str | None) -> Response:
    """``create_job``'s answer to a validated request: 202 with the new job, or a replayed response."""
    created = await create(state, caller, body, idempotency_key)
    if isinstance(created, Response):
        return created
    job_id, document = created
    return Response(
        document, status_code=202, media_type="application/json", headers={"Location": f"/v1/jobs/{job_id}"}
    )


async def create(
    state: AppState, caller: Principal, body: Any, idempotency_key: str | None
) -> tuple[str, bytes] | Response:
    """Create the job of a validated request: its id and its document (JSON), or the response an
    ``Idempotency-Key`` seen before replays (``submit``; ``service.hot`` sends the pair itself)."""
    settings = state.settings
    kind = get_kind(body.kind)
    source, target_doc = scoped_refs(caller, body)
    max_runtime = body.max_runtime_seconds or settings.default_max_runtime_seconds
    if max_runtime > settings.max_runtime_limit_seconds:
        raise InvalidRequest(
            f"max_runtime_seconds={max_runtime} exceeds this service's limit of {settings.max_runtime_limit_seconds}"
        )

    if body.webhook is not None:
        await webhooks.check_at_submit(body.webhook.url, settings.webhook_allow_private_networks)
    record_key = idempotency_record_key(state, caller, idempotency_key) if idempotency_key else None
    if target_doc is not None and kind.new_target:
        check_staging(caller, target_doc["uri"])
        try:
            await refuse_existing_target(target_doc, settings.target_check_timeout_seconds)
        except (TargetTaken, StorageUnavailable):
            # A retried request whose job was created answers from its record (the script below
            # replays it), even though that job may have written the target since or the store is
            # failing now. Asked only here, so that a new submission pays no Redis round trip for it.
            if not (record_key and await state.redis.exists(record_key)):
                raise
    job_id = new_job_id()
    created = now_ms()
    request_doc = {
        "source": source,
        "target": target_doc,
        "options": body.options.model_dump(mode="json", exclude_none=True),
        "labels": body.labels,
        "webhook": {"url": body.webhook.url} if body.webhook else None,
        "max_runtime_seconds": max_runtime,
    }
    rec = new_record(
        job_id,
        owner=caller.id,
        kind=kind.name,
        request=request_doc,
        webhook_secret=body.webhook.secret if body.webhook else None,
        created=created,
        target_claim=state.keys.target_claim(target_doc["uri"], sibling_holders(target_doc["uri"]))
        if target_doc
        else None,
        scopes=caller.scopes.to_record(),
    )
    response_body = _json(job_resource(rec))
    fp = fingerprint("POST", "/v1/jobs", body.model_dump(mode="json")) if record_key else ""
    outcome = await state.store.submit(
        rec,
        labels=body.labels,
        idem_key=record_key,
        fingerprint=fp,
        idem_ttl_seconds=settings.idempotency_ttl_seconds,
        response_body=response_body.decode(),
        queue=settings.jobs_queue,
        message=state.messages.run_job(job_id, queue=settings.jobs_queue, max_runtime_seconds=max_runtime),
    )
    if outcome[0] == "target_taken":
        _, holder, holder_owner = outcome
        mine = f" ({holder})" if holder_owner == caller.id else ""
        raise TargetTaken(f"another job{mine} is writing {target_doc['uri'] if target_doc else 'this target'}")
    if outcome[0] != "created":
        return replay(outcome, fp)
    return job_id, response_body


@router.get("/jobs/{job_id}", response_model=Job, summary="Get a job", responses=problem_responses(401, 404, 503))
async def get_job(job_id: JobId, request: Request) -> Response:
    call = await authorized(request)
    return Response(await job_document(call.state, call.caller, job_id), media_type="application/json")


async def job_document(state: AppState, caller: Principal, job_id: str) -> bytes:
    """The job resource of ``get_job`` as JSON (also served by ``service.hot``)."""
    rec = await _owned(state, caller, job_id)
    # A job is polled: between two changes of its record every read renders the same document. A
    # document is kept with the whole record it was rendered from (every field, name and value) and
    # served while a read finds that record again, so a change is never missed. The records are
    # compared, not hashed: a read's strings are new, and hashing them all (the record as a key)
    # cost more than comparing them with the kept ones.
    kept = _documents.get(job_id)
    if kept is not None and kept[0] == rec:
        return kept[1]
    doc = _json(job_resource(rec))
    if len(doc) <= DOCUMENT_CACHE_MAX_BYTES:
        if len(_documents) >= DOCUMENT_CACHE_ENTRIES and job_id not in _documents:
            _documents.clear()
        _documents[job_id] = (rec, doc)
    return doc


# Job documents rendered lately, by job id, with the record each was rendered from (see job_document).
DOCUMENT_CACHE_ENTRIES = 512
DOCUMENT_CACHE_MAX_BYTES = 16 * 1024
_documents: dict[str, tuple[dict[str, str], bytes]] = {}


@router.get(
    "/jobs",
    response_model=JobList,
    summary="List the caller's jobs, newest first",
    responses=problem_responses(401, 422, 503),
)
async def list_jobs(
    request: Request,
    job_state: Annotated[JobState | None, Query(alias="state")] = None,
    kind: KindName | None = None,
    label: Annotated[list[str], Query(max_length=8, description="k:v, repeatable (all must match)")] = [],  # noqa: B006
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Response:
    call = await authorized(request)
    labels: dict[str, str] = {}
    for item in label:
        k, sep, v = item.partition(":")
        if not sep or not k:
            raise InvalidRequest(f"label filter {item!r} is not k:v")
        labels[k] = v
    after = _decode_cursor(cursor) if cursor else None
    recs, position = await call.state.store.list(
        call.caller.id, state=job_state, kind=kind, labels=labels, after=after, limit=limit
    )
    doc = {"jobs": [job_resource(r) for r in recs], "next_cursor": _encode_cursor(position) if position else None}
    return Response(_json(doc), media_type="application/json")


def _encode_cursor(job_id: str) -> str:
    return base64.urlsafe_b64encode(_json({"after": job_id})).decode().rstrip("=")


def _decode_cursor(cursor: str) -> str:
    try:
        doc = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        job_id = doc["after"]
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise InvalidRequest("invalid cursor", hint="pass next_cursor from the previous page unchanged") from None
    if not isinstance(job_id, str) or not JOB_ID.match(job_id):
        raise InvalidRequest("invalid cursor", hint="pass next_cursor from the previous page unchanged")
    return job_id


@router.post(
    "/jobs/{job_id}/cancel",
    response_model=Job,
    summary="Cancel a job",
    description=(
        "A queued job is cancelled at once (it will not run). A running job moves to `cancelling`; its "
        "worker stops between two tensors, removes what it staged, and the job ends `cancelled`. "
        "Cancelling a cancelled or cancelling job changes nothing; a succeeded or failed job answers 409."
    ),
    responses=problem_responses(401, 404, 409, 503),
)
async def cancel_job(job_id: JobId, request: Request) -> Response:
    call = await authorized(request)
    state, caller = call.state, call.caller
    await _owned(state, caller, job_id)
    error = Cancelled("cancelled by request before the job ran").to_problem()
    outcome, previous = await state.store.cancel(job_id, caller.id, error, uuid.uuid4().hex)
    if outcome == "missing":
        raise NotFound(f"no job {job_id}")
    if outcome == "unchanged" and previous not in ("cancelling", "cancelled"):
        raise Conflict(f"job {job_id} already {previous}; it cannot be cancelled")
    rec = await _owned(state, caller, job_id)
    if outcome == "cancelled" and json.loads(rec["request"]).get("webhook"):
        # A job cancelled before it ran never reaches a worker's completion path.
        msg = state.messages.render("ckptconv.deliver_webhook", [job_id], queue=state.settings.interactive_queue)
        await state.messages.push(state.redis, state.settings.interactive_queue, msg)
    return Response(_json(job_resource(rec)), media_type="application/json")


@router.get(
    "/jobs/{job_id}/events",
    summary="Follow a job (server-sent events)",
    description=(
        "A `text/event-stream`: first a `job` event with the job resource, then `progress` and `state` "
        "events as they happen, and a final `job` event when the job ends, after which the stream closes. "
        "Event ids are stream positions: reconnect with `Last-Event-ID` to resume."
    ),
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {"schema": JOB_EVENT}}, "description": "the event stream"},
        **problem_responses(401, 404, 429, 503),
    },
)
async def job_events(
    job_id: JobId,
    request: Request,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=64)] = None,
) -> StreamingResponse:
    call = await authorized(request)
    state, caller = call.state, call.caller
    await _owned(state, caller, job_id)
    if state.open_streams >= state.settings.redis_blocking_connections:
        raise ServiceUnavailable(f"this API process serves its maximum of {state.open_streams} event streams")
    slot = await state.streams.open(caller.id)
    return StreamingResponse(
        _events(state, caller.id, slot, job_id, last_event_id, request),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _sse(event: str, data: bytes | str, event_id: str | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id else ""
    text = data.decode() if isinstance(data, bytes) else data
    return f"{head}event: {event}\ndata: {text}\n\n".encode()


_STREAM_ID = re.compile(r"^(\d+)-(\d+)$")


def _is_stream_position(value: str) -> bool:
    """A Redis stream id (two unsigned 64-bit numbers): anything else from a client's Last-Event-ID
    is ignored, never handed to XREAD (which would fail mid-stream)."""
    m = _STREAM_ID.match(value)
    return m is not None and all(int(part) < 2**64 for part in m.groups())


async def _events(
    state: AppState, key_id: str, slot: str, job_id: str, last_event_id: str | None, request: Request
) -> AsyncIterator[bytes]:
    state.open_streams += 1
    try:
        async for chunk in _follow(state, key_id, slot, job_id, last_event_id, request):
            yield chunk
    finally:
        state.open_streams -= 1
        with anyio.CancelScope(shield=True):  # runs when the client went away, too
            try:
                await state.streams.close(key_id, slot)
            except Exception:  # the slot expires by itself
                pass


async def _follow(
    state: AppState, key_id: str, slot: str, job_id: str, last_event_id: str | None, request: Request
) -> AsyncIterator[bytes]:
    events_key = state.keys.events(job_id)
    pipe = state.redis.pipeline(transaction=True)
    pipe.hgetall(state.keys.job(job_id))
    pipe.xrevrange(events_key, count=1)
    rec, last = await pipe.execute()
    if not rec:
        return
    position = last[0][0] if last else "0-0"
    yield _sse("job", _json(job_resource(rec)), position)
    if rec["state"] in TERMINAL:
        return
    if last_event_id and _is_stream_position(last_event_id):
        position = last_event_id
    while True:
        if await request.is_disconnected():
            return
        batch = await state.blocking_redis.xread({events_key: position}, count=100, block=SSE_KEEPALIVE_MS)
        if not batch:
            await state.streams.refresh(key_id, slot)
            rec = await state.store.get(job_id)
            if rec is None:
                return
            if rec["state"] in TERMINAL:  # the final event was trimmed or missed: end anyway
                yield _sse("job", _json(job_resource(rec)))
                return
            yield b": keepalive\n\n"
            continue
        for entry_id, fields in batch[0][1]:
            position = entry_id
            yield _sse(fields.get("type", "message"), fields.get("data", "{}"), entry_id)
            if fields.get("type") == "state" and json.loads(fields.get("data", "{}")).get("state") in TERMINAL:
                rec = await state.store.get(job_id)
                if rec is not None:
                    yield _sse("job", _json(job_resource(rec)), entry_id)
                return
