"""Job records in Redis: layout, atomic state transitions, and the job resource the API returns.

Layout (every key starts with ``Settings.redis_prefix``, written ``{p}`` below):

- ``{p}job:{id}``: one hash per job (``state``, ``owner``, ``scopes`` (JSON: the URI prefixes of the
  owner's key, ``null`` for every location), ``kind``, ``request`` JSON, ``progress``,
  ``result``, ``error``, timestamps in ms, ``attempts``, ``cancel_requested``, ``delivery_tag``).
  It is not a Celery result: it never expires with Celery's result backend; a finished job keeps
  it for ``job_retention_seconds``. The worker also mirrors the finished record as JSON beside the
  outputs (``<target>.ckptconv-job.json``), so a lost Redis does not lose what was produced.
- ``{p}jobs:o:{owner}`` (all of an owner's jobs), ``…:s:{state}``, ``…:k:{kind}``, ``…:l:{k}={v}``:
  sorted sets for listing and filtering, ordered by job id (= creation time, see ``list``);
  ``{p}jobs:s:{state}``, scored by the time of the last change, counts jobs by state for the metrics.
- ``{p}events:{id}``: a capped stream of progress and state events (server-sent events replay it).
- ``{p}lease:{id}``: which worker runs the job; ``{p}idem:{owner}:{hash}``: Idempotency-Key records.
- ``{p}target:{hash}``: the reservation of a target URI (value: the job id). Taken by the submit
  script when the job is accepted (``SET NX`` semantics: a second job for the same target is refused
  with ``target_taken``) and deleted by ``transition`` when the job reaches a final state. The job's
  hash names it in ``target_key``. A reservation whose job is gone or final is stale and is taken over.

Every change of state goes through one Lua function (``transition``) that checks the current
state, moves the job between index sets, appends the event and, for a final state, counts it in
``{p}stats``: there is no moment where the hash and its indexes disagree. Lua scripts compute
index keys from the prefix, so this layout assumes one Redis (not a cluster).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from datetime import UTC, datetime
from typing import Any

STATES = ("queued", "running", "cancelling", "succeeded", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
EVENTS_MAXLEN = 500
DURATION_BUCKETS = (1, 5, 15, 60, 300, 900, 3600, 14400, 86400)


def now_ms() -> int:
    return int(time.time() * 1000)


def new_job_id() -> str:
    """Time-ordered, unguessable: 12 hex digits of milliseconds, then 80 random bits."""
    return f"job_{now_ms():012x}{secrets.token_hex(10)}"


def target_identity(uri: str) -> str:
    """What two requests must agree on to name the same target: the canonical URI (as the API
    records it) without trailing slashes, so that ``s3://b/out`` and ``s3://b/out/`` are one target."""
    return uri.rstrip("/") or uri


def iso(ms: str | int | None) -> str | None:
    if ms in (None, ""):
        return None
    dt = datetime.fromtimestamp(int(ms) / 1000, UTC)
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class RedisKeys:
    """Names of every Redis key ckptconv uses, under one prefix."""

    def __init__(self, prefix: str, broker_prefix: str | None = None) -> None:
        self.p = prefix
        self.broker = broker_prefix if broker_prefix is not None else prefix + "q:"

    def job(self, job_id: str) -> str:
        return f"{self.p}job:{job_id}"

    def events(self, job_id: str) -> str:
        return f"{self.p}events:{job_id}"

    def lease(self, job_id: str) -> str:
        return f"{self.p}lease:{job_id}"

    def target(self, uri: str) -> str:
        """The reservation key of a target URI (see :func:`target_identity`)."""
        return f"{self.p}target:{hashlib.sha256(target_identity(uri).encode()).hexdigest()[:40]}"

    def owner_index(self, owner: str) -> str:
        return f"{self.p}jobs:o:{owner}"

    def state_index(self, owner: str, state: str) -> str:
        return f"{self.p}jobs:o:{owner}:s:{state}"

    def kind_index(self, owner: str, kind: str) -> str:
        return f"{self.p}jobs:o:{owner}:k:{kind}"

    def label_index(self, owner: str, key: str, value: str) -> str:
        return f"{self.p}jobs:o:{owner}:l:{key}={value}"

    def global_state(self, state: str) -> str:
        return f"{self.p}jobs:s:{state}"

    def idempotency(self, owner: str, key_hash: str) -> str:
        return f"{self.p}idem:{owner}:{key_hash}"

    def api_key(self, key_hash: str) -> str:
        return f"{self.p}apikey:{key_hash}"

    @property
    def api_keys(self) -> str:
        return f"{self.p}apikeys"

    def rate(self, owner: str) -> str:
        return f"{self.p}rate:{owner}"

    def streams(self, owner: str) -> str:
        return f"{self.p}streams:{owner}"

    @property
    def stats(self) -> str:
        return f"{self.p}stats"

    def reply(self, token: str) -> str:
        return f"{self.p}reply:{token}"

    def queue(self, name: str) -> str:
        """The Redis list kombu keeps a queue's messages in (priority 0)."""
        return self.broker + name

    @property
    def unacked_index(self) -> str:
        return self.broker + "unacked_index"


# --- Lua -------------------------------------------------------------------------------------

_LUA_COMMON = """
local TERMINAL = {succeeded=true, failed=true, cancelled=true}
local BUCKETS = {__BUCKETS__}

local function finish_stats(p, job_key, to, now, nbytes)
  local stats = p .. 'stats'
  redis.call('HINCRBY', stats, 'finished:' .. to, 1)
  local started = redis.call('HGET', job_key, 'started_ms')
  if started then
    local d = (now - tonumber(started)) / 1000
    for _, le in ipairs(BUCKETS) do
      if d <= le then redis.call('HINCRBY', stats, 'duration_bucket:' .. le, 1) end
    end
    redis.call('HINCRBY', stats, 'duration_bucket:+Inf', 1)
    redis.call('HINCRBYFLOAT', stats, 'duration_sum', d)
    redis.call('HINCRBY', stats, 'duration_count', 1)
  end
  if nbytes > 0 then redis.call('HINCRBY', stats, 'bytes_converted', nbytes) end
end

-- Move job `id` from its current state to `to` if the current state is in `allowed`.
local function transition(p, job_key, events_key, id, allowed, to, now, retention, nbytes, fields)
  local meta = redis.call('HMGET', job_key, 'state', 'owner')
  local cur = meta[1]
  if not cur then return {'missing', ''} end
  if not allowed[cur] then return {'refused', cur} end
  if cur ~= to then
    local o = p .. 'jobs:o:' .. meta[2]
    redis.call('ZREM', o .. ':s:' .. cur, id)
    redis.call('ZADD', o .. ':s:' .. to, 0, id)
    redis.call('ZREM', p .. 'jobs:s:' .. cur, id)
    redis.call('ZADD', p .. 'jobs:s:' .. to, now, id)
  end
  redis.call('HSET', job_key, 'state', to, 'updated_ms', now)
  if #fields > 0 then redis.call('HSET', job_key, unpack(fields)) end
  local event = cjson.encode({state=to, previous=cur, at=now})
  redis.call('XADD', events_key, 'MAXLEN', '~', __MAXLEN__, '*', 'type', 'state', 'data', event)
  if TERMINAL[to] and not TERMINAL[cur] then
    finish_stats(p, job_key, to, now, nbytes)
    local target_key = redis.call('HGET', job_key, 'target_key')
    if target_key and redis.call('GET', target_key) == id then redis.call('DEL', target_key) end
    if retention > 0 then
      redis.call('PEXPIRE', job_key, retention)
      redis.call('PEXPIRE', events_key, retention)
      redis.call('ZREMRANGEBYSCORE', p .. 'jobs:s:' .. to, '-inf', now - retention)
    end
  end
  return {'ok', cur}
end

local function set_of(csv)
  local s = {}
  for name in string.gmatch(csv, '[^,]+') do s[name] = true end
  return s
end
""".replace("__BUCKETS__", ", ".join(str(b) for b in DURATION_BUCKETS)).replace("__MAXLEN__", str(EVENTS_MAXLEN))

# Fenced: with a non-empty `attempt`, the change is refused ('fenced') unless it is still the job's
# current attempt (a worker that lost the job to another attempt changes nothing).
# KEYS: job, events. ARGV: prefix, id, allowed (csv), to, now_ms, retention_ms, bytes, attempt (or ''),
#       field, value, ...
TRANSITION_LUA = (
    _LUA_COMMON
    + """
if ARGV[8] ~= '' and redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[8] then
  return {'fenced', redis.call('HGET', KEYS[1], 'state') or ''}
end
local fields = {}
for i = 9, #ARGV do fields[#fields + 1] = ARGV[i] end
return transition(ARGV[1], KEYS[1], KEYS[2], ARGV[2], set_of(ARGV[3]), ARGV[4], tonumber(ARGV[5]),
                  tonumber(ARGV[6]), tonumber(ARGV[7]), fields)
"""
)

# A worker starts an attempt: take the lease and count the attempt in one step, so that each
# attempt number has exactly one holder. Refused while another token holds a live lease.
# KEYS: lease, job, events. ARGV: prefix, id, token, lease_ms, now_ms, max_attempts
# Returns {'started', attempt, previous state} | {'held', holder} | {'terminal', state}
#       | {'exhausted', attempts} | {'missing', ''}
START_LUA = (
    _LUA_COMMON
    + """
local meta = redis.call('HMGET', KEYS[2], 'state', 'attempts', 'started_ms')
local state = meta[1]
if not state then return {'missing', ''} end
if TERMINAL[state] then return {'terminal', state} end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[3] then return {'held', holder} end
local attempts = tonumber(meta[2] or '0')
if attempts >= tonumber(ARGV[6]) then return {'exhausted', tostring(attempts)} end
local attempt = tostring(attempts + 1)
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
local fields = {'attempts', attempt, 'worker', ARGV[3], 'heartbeat_ms', ARGV[5]}
if not meta[3] then fields[#fields + 1] = 'started_ms'; fields[#fields + 1] = ARGV[5] end
local to = state == 'cancelling' and 'cancelling' or 'running'
transition(ARGV[1], KEYS[2], KEYS[3], ARGV[2], {queued=true, running=true, cancelling=true}, to,
           tonumber(ARGV[5]), 0, 0, fields)
return {'started', attempt, state}
"""
)

# The reaper gives a job whose owner is gone its message again (the one the API queued), if it is
# still in the same attempt, has no live lease and is not final.
# KEYS: job, lease, queue. ARGV: attempt, now_ms
REQUEUE_LUA = """
local meta = redis.call('HMGET', KEYS[1], 'state', 'attempts', 'message')
if not meta[1] or meta[1] == 'succeeded' or meta[1] == 'failed' or meta[1] == 'cancelled' then return 0 end
if (meta[2] or '0') ~= ARGV[1] or redis.call('EXISTS', KEYS[2]) == 1 or not meta[3] then return 0 end
redis.call('LPUSH', KEYS[3], meta[3])
redis.call('HSET', KEYS[1], 'requeued_ms', ARGV[2])
return 1
"""

# KEYS: job, events. ARGV: prefix, id, owner, now_ms, retention_ms, error_json
CANCEL_LUA = (
    _LUA_COMMON
    + """
local meta = redis.call('HMGET', KEYS[1], 'state', 'owner')
if not meta[1] or meta[2] ~= ARGV[3] then return {'missing', ''} end
local now = tonumber(ARGV[4])
if meta[1] == 'queued' then
  transition(ARGV[1], KEYS[1], KEYS[2], ARGV[2], {queued=true}, 'cancelled', now, tonumber(ARGV[5]), 0,
             {'finished_ms', ARGV[4], 'error', ARGV[6], 'cancel_requested', '1'})
  return {'cancelled', 'queued'}
elseif meta[1] == 'running' then
  transition(ARGV[1], KEYS[1], KEYS[2], ARGV[2], {running=true}, 'cancelling', now, 0, 0, {'cancel_requested', '1'})
  return {'cancelling', 'running'}
end
return {'unchanged', meta[1]}
"""
)

# Create a job, its index entries, its target reservation, its Idempotency-Key record and its queue
# message, atomically. The Idempotency-Key is looked up first (a repeated request gets the first
# answer even while its job holds the target); then the target: held by a live job -> refused.
# KEYS: job, idempotency (or ''), queue, target reservation (or '').
# ARGV: prefix, id, owner, kind, fingerprint, idem_ttl_ms, response_body, message, record (JSON
#       object of the hash's fields), labels (JSON object). JSON rather than one argument per field:
#       redis-py packs each argument in Python, which made packing the costliest part of a submit.
SUBMIT_LUA = """
local p, id, owner, kind = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if KEYS[2] ~= '' then
  local prev = redis.call('HMGET', KEYS[2], 'fp', 'status', 'code', 'body', 'location')
  if prev[1] then
    return {'exists', prev[1], prev[2] or '', prev[3] or '', prev[4] or '', prev[5] or ''}
  end
end
if KEYS[4] ~= '' then
  local holder = redis.call('GET', KEYS[4])
  if holder then
    local held = redis.call('HMGET', p .. 'job:' .. holder, 'state', 'owner')
    if held[1] and held[1] ~= 'succeeded' and held[1] ~= 'failed' and held[1] ~= 'cancelled' then
      return {'target_taken', holder, held[2]}
    end
  end
  redis.call('SET', KEYS[4], id)
end
if KEYS[2] ~= '' then
  redis.call('HSET', KEYS[2], 'fp', ARGV[5], 'status', 'done', 'code', '202', 'body', ARGV[7],
             'location', '/v1/jobs/' .. id)
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
end
local fields = {}
for k, v in pairs(cjson.decode(ARGV[9])) do
  fields[#fields + 1] = k
  fields[#fields + 1] = v
end
redis.call('HSET', KEYS[1], unpack(fields))
-- The queued message, kept so that the reaper can queue it again if it is ever lost.
redis.call('HSET', KEYS[1], 'message', ARGV[8])
local o = p .. 'jobs:o:' .. owner
redis.call('ZADD', o, 0, id)
redis.call('ZADD', o .. ':s:queued', 0, id)
redis.call('ZADD', o .. ':k:' .. kind, 0, id)
for k, v in pairs(cjson.decode(ARGV[10])) do redis.call('ZADD', o .. ':l:' .. k .. '=' .. v, 0, id) end
redis.call('ZADD', p .. 'jobs:s:queued', redis.call('TIME')[1] * 1000, id)
redis.call('LPUSH', KEYS[3], ARGV[8])
return {'created'}
"""

# Idempotency for requests other than job creation: claim, then complete or release.
# KEYS: idempotency. ARGV: fingerprint, pending_ttl_ms
IDEM_CLAIM_LUA = """
local prev = redis.call('HMGET', KEYS[1], 'fp', 'status', 'code', 'body', 'location')
if prev[1] then
  return {'exists', prev[1], prev[2] or '', prev[3] or '', prev[4] or '', prev[5] or ''}
end
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'status', 'pending')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'claimed'}
"""

# Worker heartbeat: renew the lease if still ours, keep the broker from re-delivering the running
# task's message (kombu's unacked index is scored by delivery time), and read the cancel flag.
# A lease that lapsed (Redis slow or unreachable for longer than the lease) is taken again when
# nobody else holds it and the job is still in this attempt: the attempt number is the fence.
# KEYS: lease, job, unacked_index. ARGV: token, lease_ms, now_ms, delivery_tag, now_s, attempt
HEARTBEAT_LUA = """
local holder = redis.call('GET', KEYS[1])
local mine = holder == ARGV[1]
if not holder and redis.call('HGET', KEYS[2], 'attempts') == ARGV[6] then
  local state = redis.call('HGET', KEYS[2], 'state')
  if state == 'running' or state == 'cancelling' then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    mine = true
  end
end
if mine then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('HSET', KEYS[2], 'heartbeat_ms', ARGV[3])
  if ARGV[4] ~= '' then redis.call('ZADD', KEYS[3], 'XX', ARGV[5], ARGV[4]) end
end
local cancel = redis.call('HGET', KEYS[2], 'cancel_requested') or ''
return {mine and 1 or 0, cancel}
"""

# Progress of the current attempt only. KEYS: job, events. ARGV: attempt, data, now_ms, maxlen
PROGRESS_LUA = """
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'progress', ARGV[2], 'updated_ms', ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'type', 'progress', 'data', ARGV[2])
return 1
"""

# KEYS: lease. ARGV: token
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# --- records and resources -------------------------------------------------------------------


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


def _webhook_view(webhook: dict[str, Any], delivery: dict[str, Any] | None) -> dict[str, Any]:
    delivery = delivery or {}
    return {
        "url": webhook["url"],
        "attempts": int(delivery.get("attempts", 0)),
        "last_status": delivery.get("last_status"),
        "last_error": delivery.get("last_error"),
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
    target_key: str | None = None,
    scopes: list[str] | None,
) -> dict[str, str]:
    """A new job's record. ``scopes`` are the URI prefixes of the owner's key (None: every location),
    which the worker's storage enforces on everything the job touches."""
    rec = {
        "id": job_id,
        "owner": owner,
        "scopes": json.dumps(scopes),
        "kind": kind,
        "state": "queued",
        "request": json.dumps(request, separators=(",", ":"), sort_keys=True),
        "created_ms": str(created),
        "updated_ms": str(created),
        "attempts": "0",
        "delivery_tag": job_id,
    }
    if webhook_secret:
        rec["webhook_secret"] = webhook_secret
    if target_key:
        rec["target_key"] = target_key
    return rec


class JobStore:
    """Synchronous access for the worker (the API has its own asynchronous calls in ``service.api_store``)."""

    def __init__(self, client: Any, keys: RedisKeys, *, retention_seconds: int = 0) -> None:
        self.r = client
        self.keys = keys
        self.retention_ms = retention_seconds * 1000
        self._transition = client.register_script(TRANSITION_LUA)
        self._start = client.register_script(START_LUA)
        self._heartbeat = client.register_script(HEARTBEAT_LUA)
        self._progress = client.register_script(PROGRESS_LUA)
        self._requeue = client.register_script(REQUEUE_LUA)
        self._release = client.register_script(RELEASE_LUA)

    def get(self, job_id: str) -> dict[str, str] | None:
        rec = decode(self.r.hgetall(self.keys.job(job_id)))
        return rec or None

    def transition(
        self,
        job_id: str,
        allowed: tuple[str, ...],
        to: str,
        fields: dict[str, Any] | None = None,
        *,
        nbytes: int = 0,
        attempt: int | None = None,
    ) -> tuple[bool, str]:
        """Move the job to ``to`` if its state is one of ``allowed`` (and, given ``attempt``, if that is
        still the job's current attempt); returns (moved, previous state)."""
        flat: list[str] = []
        for k, v in (fields or {}).items():
            flat += [k, encode_field(v)]
        fence = "" if attempt is None else str(attempt)
        status, previous = self._transition(
            keys=[self.keys.job(job_id), self.keys.events(job_id)],
            args=[self.keys.p, job_id, ",".join(allowed), to, now_ms(), self.retention_ms, nbytes, fence, *flat],
        )
        return _s(status) == "ok", _s(previous)

    def start_attempt(self, job_id: str, token: str, lease_seconds: float, max_attempts: int) -> list[str]:
        """Take the lease and start the next attempt (see START_LUA for the answers)."""
        out = self._start(
            keys=[self.keys.lease(job_id), self.keys.job(job_id), self.keys.events(job_id)],
            args=[self.keys.p, job_id, token, int(lease_seconds * 1000), now_ms(), max_attempts],
        )
        return [_s(x) for x in out]

    def is_current(self, job_id: str, attempt: int, token: str) -> bool:
        """True while ``attempt`` is the job's current attempt and its lease is held by ``token``
        (or has lapsed with nobody else holding it: the heartbeat takes it again)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(self.keys.job(job_id), "attempts")
        pipe.get(self.keys.lease(job_id))
        current, holder = pipe.execute()
        return current is not None and _s(current) == str(attempt) and (holder is None or _s(holder) == token)

    def requeue(self, job_id: str, attempt: str, queue: str) -> bool:
        """Queue the job's stored message again if it is still in ``attempt`` with no live lease."""
        return bool(
            self._requeue(
                keys=[self.keys.job(job_id), self.keys.lease(job_id), self.keys.queue(queue)], args=[attempt, now_ms()]
            )
        )

    def touch_delivery(self, delivery_tag: str) -> None:
        """Push back the broker's re-delivery of the message with this tag (kombu's unacked index)."""
        self.r.zadd(self.keys.unacked_index, {delivery_tag: time.time()}, xx=True)

    def set_fields(self, job_id: str, fields: dict[str, Any]) -> None:
        self.r.hset(self.keys.job(job_id), mapping={k: encode_field(v) for k, v in fields.items()})

    def progress(self, job_id: str, progress: dict[str, Any], *, attempt: int | None = None) -> None:
        """Record progress (of ``attempt`` only, when given: a stale worker's progress is dropped)."""
        data = json.dumps(progress, separators=(",", ":"))
        self._progress(
            keys=[self.keys.job(job_id), self.keys.events(job_id)],
            args=["" if attempt is None else str(attempt), data, now_ms(), EVENTS_MAXLEN],
        )

    def acquire_lease(self, job_id: str, token: str, lease_seconds: float) -> bool:
        return bool(self.r.set(self.keys.lease(job_id), token, nx=True, px=int(lease_seconds * 1000)))

    def lease_holder(self, job_id: str) -> str | None:
        value = self.r.get(self.keys.lease(job_id))
        return _s(value) if value is not None else None

    def heartbeat(
        self, job_id: str, token: str, lease_seconds: float, delivery_tag: str, attempt: int = 0
    ) -> tuple[bool, bool]:
        """Renew (or re-take, when it lapsed and nobody else holds it) the lease and the message's
        visibility; returns (lease still ours, cancel requested)."""
        now = time.time()
        mine, cancel = self._heartbeat(
            keys=[self.keys.lease(job_id), self.keys.job(job_id), self.keys.unacked_index],
            args=[token, int(lease_seconds * 1000), int(now * 1000), delivery_tag, repr(now), str(attempt)],
        )
        return bool(int(mine)), bool(_s(cancel))

    def orphans(self, *, quiet_ms: int, queues: tuple[str, ...], now: int | None = None) -> dict[str, str]:
        """Jobs that are not final yet nobody runs or will run: ``{job id: attempts}``.

        An orphan has no lease, no entry in the broker's unacked index (kombu would restore that
        message by itself), no message waiting in ``queues``, and no change for ``quiet_ms``. Queued
        jobs qualify only after ``quiet_ms`` too (a message on its way between the queue and the
        unacked index is in neither for a moment; callers confirm an orphan on a second pass).
        """
        now = now or now_ms()
        ids: set[str] = set()
        for state in ("running", "cancelling", "queued"):
            ids.update(_s(m) for m in self.r.zrangebyscore(self.keys.global_state(state), "-inf", now - quiet_ms))
        if not ids:
            return {}
        ordered = sorted(ids)
        pipe = self.r.pipeline(transaction=False)
        for job_id in ordered:
            pipe.exists(self.keys.lease(job_id))
            pipe.zscore(self.keys.unacked_index, job_id)
            pipe.hmget(self.keys.job(job_id), "state", "attempts", "heartbeat_ms", "updated_ms")
        answers = pipe.execute()
        found: dict[str, str] = {}
        for i, job_id in enumerate(ordered):
            leased, unacked, (state, attempts, beat, updated) = answers[3 * i : 3 * i + 3]
            if leased or unacked is not None or state is None or _s(state) in TERMINAL:
                continue
            last = max(int(_s(beat or 0)), int(_s(updated or 0)))
            if now - last >= quiet_ms:
                found[job_id] = _s(attempts or "0")
        if found:
            for queue in queues:
                for message in self._scan_list(self.keys.queue(queue)):
                    for job_id in [j for j in found if j in message]:
                        del found[job_id]
        return found

    def _scan_list(self, key: str, batch: int = 1000) -> Any:
        start = 0
        while True:
            chunk = self.r.lrange(key, start, start + batch - 1)
            if not chunk:
                return
            for item in chunk:
                yield _s(item)
            start += batch

    def release_lease(self, job_id: str, token: str) -> None:
        self._release(keys=[self.keys.lease(job_id)], args=[token])


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def encode_field(value: Any) -> str:
    """How a value is stored in a job's Redis hash: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


class AsyncJobStore:
    """The API's access: creation, reads, listing, cancellation and Idempotency-Key records.

    Each call is one Redis round trip (a script or a pipeline), except listing, which reads the
    index and then the records of one page.
    """

    def __init__(self, client: Any, keys: RedisKeys, *, retention_seconds: int = 0) -> None:
        self.r = client
        self.keys = keys
        self.retention_ms = retention_seconds * 1000
        self._submit = client.register_script(SUBMIT_LUA)
        self._cancel = client.register_script(CANCEL_LUA)
        self._claim = client.register_script(IDEM_CLAIM_LUA)

    async def submit(
        self,
        rec: dict[str, str],
        *,
        labels: dict[str, str],
        idem_key: str | None,
        fingerprint: str,
        idem_ttl_seconds: int,
        response_body: str,
        queue: str,
        message: str,
    ) -> list[str]:
        """Create the job and enqueue its message; or, for a known Idempotency-Key, the stored outcome;
        or ``["target_taken", holder job id, holder owner]`` when a live job holds the target."""
        out = await self._submit(
            keys=[self.keys.job(rec["id"]), idem_key or "", self.keys.queue(queue), rec.get("target_key", "")],
            args=[
                self.keys.p,
                rec["id"],
                rec["owner"],
                rec["kind"],
                fingerprint,
                idem_ttl_seconds * 1000,
                response_body,
                message,
                json.dumps(rec, separators=(",", ":")),
                json.dumps(labels, separators=(",", ":")),
            ],
        )
        return [_s(x) for x in out]

    async def get(self, job_id: str) -> dict[str, str] | None:
        rec = decode(await self.r.hgetall(self.keys.job(job_id)))
        return rec or None

    async def cancel(self, job_id: str, owner: str, error: dict[str, Any]) -> tuple[str, str]:
        status, previous = await self._cancel(
            keys=[self.keys.job(job_id), self.keys.events(job_id)],
            args=[self.keys.p, job_id, owner, now_ms(), self.retention_ms, json.dumps(error)],
        )
        return _s(status), _s(previous)

    async def list(
        self,
        owner: str,
        *,
        state: str | None,
        kind: str | None,
        labels: dict[str, str],
        after: str | None,
        limit: int,
        scan_limit: int = 1000,
    ) -> tuple[list[dict[str, str]], str | None]:
        """One page of the owner's jobs, newest first, and the id to continue after (or None).

        Index entries all have score 0, so Redis orders them by member: job ids start with their
        creation time in fixed-width hex, which makes that order the creation order, with no ties.
        The most selective index available is scanned (state, then a label, then kind) and the
        other filters are applied to the records; at most ``scan_limit`` index entries are read per
        call, so a sparse filter returns a short page with a cursor rather than scanning forever.
        """
        if state:
            index = self.keys.state_index(owner, state)
        elif labels:
            k, v = next(iter(labels.items()))
            index = self.keys.label_index(owner, k, v)
        elif kind:
            index = self.keys.kind_index(owner, kind)
        else:
            index = self.keys.owner_index(owner)
        found: list[dict[str, str]] = []
        scanned = 0
        position = after
        batch = min(max(limit * 2, 20), 200)
        while len(found) < limit and scanned < scan_limit:
            start = "+" if position is None else "(" + position
            ids = [_s(m) for m in await self.r.zrange(index, start, "-", desc=True, bylex=True, offset=0, num=batch)]
            if not ids:
                return found, None
            pipe = self.r.pipeline(transaction=False)
            for m in ids:
                pipe.hgetall(self.keys.job(m))
            recs = [decode(x) for x in await pipe.execute()]
            gone = []
            for m, rec in zip(ids, recs, strict=True):
                scanned += 1
                position = m
                if not rec:
                    gone.append(m)  # expired record: drop its index entry lazily
                elif _matches(rec, state, kind, labels):
                    found.append(rec)
                    if len(found) == limit:
                        break
            if gone:
                await self.r.zrem(index, *gone)
            if len(ids) < batch and position == ids[-1]:
                return found, None
        return found, position

    async def idem_claim(self, key: str, fingerprint: str, pending_seconds: float) -> list[str]:
        return [_s(x) for x in await self._claim(keys=[key], args=[fingerprint, int(pending_seconds * 1000)])]

    async def idem_complete(self, key: str, code: int, body: str, location: str, ttl_seconds: int) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping={"status": "done", "code": str(code), "body": body, "location": location})
        pipe.expire(key, ttl_seconds)
        await pipe.execute()

    async def idem_release(self, key: str) -> None:
        await self.r.delete(key)


def _matches(rec: dict[str, str], state: str | None, kind: str | None, labels: dict[str, str]) -> bool:
    if state and rec.get("state") != state:
        return False
    if kind and rec.get("kind") != kind:
        return False
    if labels:
        have = (json.loads(rec["request"]).get("labels")) or {}
        if any(have.get(k) != v for k, v in labels.items()):
            return False
    return True
