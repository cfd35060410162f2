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
- ``{p}target:{hash}``: the reservation of a target URI (value: the job id), and
  ``{p}target-under:{hash}``: the live jobs whose targets lie under that URI. Taken by the submit
  script when the job is accepted: a second job for the same target, for one under it or for one
  holding it (a directory target and a file in it publish to the same keys; so do a TF bundle's
  prefix and a file target named as its ``.index``, see ``engine.staging.sibling_holders``) is
  refused with ``target_taken``. The job's hash names them in ``target_key`` and ``target_claim``; ``transition``
  releases them when the job reaches a final state. A reservation (or set member) whose job is gone
  or final is stale: it is taken over (dropped).

Every change of state goes through one Lua function (``transition``) that checks the current
state, moves the job between index sets, appends the event and, for a final state, counts it in
``{p}stats``: there is no moment where the hash and its indexes disagree. Lua scripts compute
index keys from the prefix, so this layout assumes one Redis (not a cluster).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from typing import Any

from redis.backoff import EqualJitterBackoff

from ckptconv.core.job_records import (
    EVENTS_MAXLEN,
    TERMINAL,
    as_str,
    decode,
    enclosing_targets,
    encode_field,
    now_ms,
    target_identity,
)
from ckptconv.core.job_scripts import (
    CANCEL_LUA,
    HEARTBEAT_LUA,
    IDEM_CLAIM_LUA,
    IDEM_COMPLETE_LUA,
    IDEM_RELEASE_LUA,
    PROGRESS_LUA,
    RELEASE_LUA,
    REQUEUE_LUA,
    START_LUA,
    SUBMIT_LUA,
    TRANSITION_LUA,
)

# The one retry policy of every Redis client ckptconv makes (the API's pooled and multiplexed
# commands, ``service.limits.redis_retry``, and each worker's, ``worker.celery_app.store``): a command
# that met a lost connection is sent again up to REDIS_RETRIES times, after 50-100 ms, 100-200 ms,
# 200-400 ms. Every script a command runs is safe to send again after its reply was lost.
REDIS_RETRIES = 3


def redis_backoff() -> EqualJitterBackoff:
    """The waits of the Redis retry policy (:data:`REDIS_RETRIES`).

    Jittered: when Redis drops every client at once (a restart, ``CLIENT KILL TYPE normal``), the
    processes and the commands of each would otherwise reconnect and resend in lockstep, one burst
    per step. Equal jitter (half fixed, half random) rather than full jitter keeps the total wait at
    350 ms or more, so that a Redis restart still costs no error.
    """
    return EqualJitterBackoff(cap=0.5, base=0.05)


def _digest(identity: str) -> str:
    return hashlib.sha256(identity.encode()).hexdigest()[:40]


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
        return f"{self.p}target:{_digest(target_identity(uri))}"

    def target_claim(self, uri: str, holders: Iterable[str] = ()) -> list[str]:
        """The keys a job for target ``uri`` reserves it with (see SUBMIT_LUA): its reservation, the
        set of live jobs whose targets lie under it, then for each target that holds it (a directory
        above, see :func:`enclosing_targets`, and ``holders``: the targets that write its name beside
        themselves, e.g. a TF bundle's prefix for its ``.index``) that one's reservation and set of
        jobs under it."""
        identity = target_identity(uri)
        claim = [self.target(identity), f"{self.p}target-under:{_digest(identity)}"]
        for outer in [*enclosing_targets(identity), *(target_identity(h) for h in holders)]:
            claim += [self.target(outer), f"{self.p}target-under:{_digest(outer)}"]
        return claim

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
        return as_str(status) == "ok", as_str(previous)

    def start_attempt(self, job_id: str, token: str, lease_seconds: float, max_attempts: int) -> list[str]:
        """Take the lease and start the next attempt (see START_LUA for the answers)."""
        out = self._start(
            keys=[self.keys.lease(job_id), self.keys.job(job_id), self.keys.events(job_id)],
            args=[self.keys.p, job_id, token, int(lease_seconds * 1000), now_ms(), max_attempts],
        )
        return [as_str(x) for x in out]

    def is_current(self, job_id: str, attempt: int, token: str) -> bool:
        """True while ``attempt`` is the job's current attempt and its lease is held by ``token``
        (or has lapsed with nobody else holding it: the heartbeat takes it again)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(self.keys.job(job_id), "attempts")
        pipe.get(self.keys.lease(job_id))
        current, holder = pipe.execute()
        return current is not None and as_str(current) == str(attempt) and (holder is None or as_str(holder) == token)

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
        return as_str(value) if value is not None else None

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
        return bool(int(mine)), bool(as_str(cancel))

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
            ids.update(as_str(m) for m in self.r.zrangebyscore(self.keys.global_state(state), "-inf", now - quiet_ms))
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
            if leased or unacked is not None or state is None or as_str(state) in TERMINAL:
                continue
            last = max(int(as_str(beat or 0)), int(as_str(updated or 0)))
            if now - last >= quiet_ms:
                found[job_id] = as_str(attempts or "0")
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
                yield as_str(item)
            start += batch

    def release_lease(self, job_id: str, token: str) -> None:
        self._release(keys=[self.keys.lease(job_id)], args=[token])


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
        self._idem_release = client.register_script(IDEM_RELEASE_LUA)
        self._idem_complete = client.register_script(IDEM_COMPLETE_LUA)

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
        or ``["target_taken", holder job id, holder owner]`` when a live job holds the target, one
        under it or one over it."""
        fields = [x for field in rec.items() for x in field]
        claim = rec["target_claim"].split() if rec.get("target_claim") else []
        out = await self._submit(
            keys=[self.keys.job(rec["id"]), idem_key or "", self.keys.queue(queue), *claim],
            args=[
                self.keys.p,
                rec["id"],
                rec["owner"],
                rec["kind"],
                fingerprint,
                idem_ttl_seconds * 1000,
                response_body,
                message,
                len(fields),
                *fields,
                *(x for label in labels.items() for x in label),
            ],
        )
        return [as_str(x) for x in out]

    async def get(self, job_id: str) -> dict[str, str] | None:
        rec = decode(await self.r.hgetall(self.keys.job(job_id)))
        return rec or None

    async def cancel(self, job_id: str, owner: str, error: dict[str, Any], token: str) -> tuple[str, str]:
        """``(outcome, previous state)``: ``cancelled``, ``cancelling``, ``unchanged`` or ``missing``.
        ``token`` is the caller's own (unique per request): the call sent again after its reply was
        lost answers as the first did."""
        status, previous = await self._cancel(
            keys=[self.keys.job(job_id), self.keys.events(job_id)],
            args=[self.keys.p, job_id, owner, now_ms(), self.retention_ms, json.dumps(error), token],
        )
        return as_str(status), as_str(previous)

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
            page = await self.r.zrange(index, start, "-", desc=True, bylex=True, offset=0, num=batch)
            ids = [as_str(m) for m in page]
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

    async def idem_claim(self, key: str, fingerprint: str, pending_seconds: float, token: str) -> list[str]:
        """``["claimed"]``, or ``["exists", fingerprint, status, code, body, location]`` for a key already
        claimed by another call. ``token`` is the caller's own (unique per request): the call sent again
        after its reply was lost finds its own claim and answers ``["claimed"]`` again."""
        args = [fingerprint, int(pending_seconds * 1000), token]
        return [as_str(x) for x in await self._claim(keys=[key], args=args)]

    async def idem_complete(self, key: str, token: str, code: int, body: str, location: str, ttl_seconds: int) -> None:
        """Record the answer of the request whose pending claim holds ``token`` (``idem_claim``); a
        claim another request took after this one's lapsed stays that request's."""
        await self._idem_complete(keys=[key], args=[token, str(code), body, location, ttl_seconds])

    async def idem_release(self, key: str, token: str) -> None:
        """Drop the pending claim ``idem_claim`` made with ``token``; another request's claim stays."""
        await self._idem_release(keys=[key], args=[token])


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
