"""A job's record: its states, ids and timestamps, the Redis hash fields, and the job resource.

The record is one Redis hash (``{p}job:{id}``, see ``ckptconv.core.jobstore`` for the layout);
this module turns a new job into its fields (``new_record``), fields back into text (``decode``,
``as_str``), values into fields (``encode_field``) and a stored record into the resource the API
returns (``job_resource``). It talks to no Redis.
"""

from __future__ import annotations

import functools
import json
import secrets
import time
from datetime import UTC, datetime
from typing import Any

from ckptconv.core.webhooks import DELIVERY_ERRORS

STATES = ("queued", "running", "cancelling", "succeeded", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
EVENTS_MAXLEN = 500
DURATION_BUCKETS = (1, 5, 15, 60, 300, 900, 3600, 14400, 86400)


# json.dumps(..., separators=(",", ":"), sort_keys=True) without a JSONEncoder built per call (the
# API creates a record per submission).
_ENCODE_SORTED = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode


def now_ms() -> int:
    return int(time.time() * 1000)


def new_job_id() -> str:
    """Time-ordered, unguessable: 12 hex digits of milliseconds, then 80 random bits."""
    return f"job_{now_ms():012x}{secrets.token_hex(10)}"


def target_identity(uri: str) -> str:
    """What two requests must agree on to name the same target: the canonical URI (as the API
    records it) without trailing slashes, so that ``s3://b/out`` and ``s3://b/out/`` are one target."""
    return uri.rstrip("/") or uri


def enclosing_targets(uri: str) -> list[str]:
    """The identities of every target that holds ``uri``'s target (a directory above it, on segment
    boundaries: ``s3://b/x`` holds ``s3://b/x/m.mdl`` but not ``s3://b/x2``), outermost first."""
    identity = target_identity(uri)
    scheme, sep, path = identity.rpartition("://")
    head = scheme + sep
    parts = path.split("/")
    # A local path's leading "/" leaves an empty first part: "/" itself is its outermost directory.
    enclosing = (head + ("/".join(parts[:i]) or "/") for i in range(1, len(parts)))
    return [e for e in enclosing if e != identity]


@functools.lru_cache(maxsize=4096)
def iso(ms: str | int | None) -> str | None:
    # Cached: a job's timestamps are formatted again for every read of it (polling reads it often).
    if ms in (None, ""):
        return None
    dt = datetime.fromtimestamp(int(ms) / 1000, UTC)
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def decode(raw: dict[Any, Any]) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in raw.items()
    }


def _json(rec: dict[str, str], field: str) -> Any:
    value = rec.get(field)
    return json.loads(value) if value else None


def job_resource(rec: dict[str, str]) -> dict[str, Any]:
    """The public view of a job record (``GET /v1/jobs/{id}``); never includes secrets or owner."""
    req = json.loads(rec["request"])
    state = rec["state"]
    job_id = rec["id"]
    webhook = req.get("webhook")
    return {
        "id": job_id,
        "kind": rec["kind"],
        "state": state,
        "done": state in TERMINAL,
        "source": req["source"],
        "target": req.get("target"),
        "options": req.get("options") or {},
        "labels": req.get("labels") or {},
        "webhook": _webhook_view(webhook, _json(rec, "webhook_delivery")) if webhook else None,
        "max_runtime_seconds": req["max_runtime_seconds"],
        "progress": _json(rec, "progress"),
        "result": _json(rec, "result"),
        "error": _json(rec, "error"),
        "attempts": int(rec.get("attempts") or 0),
        "created_at": iso(rec.get("created_ms")),
        "started_at": iso(rec.get("started_ms")),
        "updated_at": iso(rec.get("updated_ms")),
        "finished_at": iso(rec.get("finished_ms")),
        "links": {
            "self": f"/v1/jobs/{job_id}",
            "events": f"/v1/jobs/{job_id}/events",
            "cancel": f"/v1/jobs/{job_id}/cancel",
        },
    }


def _known_delivery_error(error: Any, status: Any) -> str | None:
    if error is None or error in DELIVERY_ERRORS:
        return error
    return "http_status" if status is not None else "transport_error"


def _webhook_view(webhook: dict[str, Any], delivery: dict[str, Any] | None) -> dict[str, Any]:
    delivery = delivery or {}
    return {
        "url": webhook["url"],
        "attempts": int(delivery.get("attempts", 0)),
        "last_status": delivery.get("last_status"),
        # Only a known code is shown: a record written before the codes held exception text.
        "last_error": _known_delivery_error(delivery.get("last_error"), delivery.get("last_status")),
        "delivered_at": iso(delivery.get("delivered_ms")),
    }


def new_record(
    job_id: str,
    *,
    owner: str,
    kind: str,
    request: dict[str, Any],
    webhook_secret: str | None,
    created: int,
    target_claim: list[str] | None = None,
    scopes: list[str] | None,
) -> dict[str, str]:
    """A new job's record. ``scopes`` are the URI prefixes of the owner's key (None: every location),
    which the worker's storage enforces on everything the job touches. ``target_claim`` is the
    reservation keys of its target (``RedisKeys.target_claim``)."""
    rec = {
        "id": job_id,
        "owner": owner,
        "scopes": json.dumps(scopes),
        "kind": kind,
        "state": "queued",
        "request": _ENCODE_SORTED(request),
        "created_ms": str(created),
        "updated_ms": str(created),
        "attempts": "0",
        "delivery_tag": job_id,
    }
    if webhook_secret:
        rec["webhook_secret"] = webhook_secret
    if target_claim:
        rec["target_key"] = target_claim[0]
        rec["target_claim"] = " ".join(target_claim)
    return rec


def as_str(value: Any) -> str:
    """A Redis reply (bytes or not) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def encode_field(value: Any) -> str:
    """How a value is stored in a job's Redis hash: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
