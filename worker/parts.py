"""The parts of a fanned-out job (``parallelism`` > 1): their tasks, leases and shared counters.

The job's own worker runs the job as usual (``worker/tasks.py``: attempt, lease, heartbeat) and,
inside it, ``ckptconv.engine.fanout``: it prepares the output layout in staging, queues one
``ckptconv.run_part`` message per part on the jobs queue, runs the parts nobody claims, and
commits. This module is the Redis side of that (:class:`RedisPartRunner`) and the part task.

- **A part runs once at a time.** Running a part takes ``{p}part:<job>:<attempt>:<n>`` (the
  process's token, for ``lease_seconds``, renewed every ``heartbeat_seconds``); a second delivery
  of the message finds it held and is dropped. A part whose record is in staging is never run
  again, so a late duplicate does nothing.
- **A lost part is redone.** A part worker killed with SIGKILL stops renewing: its lease lapses
  and its message, never acknowledged, comes back after the visibility timeout; whichever comes
  first, another worker or the job's own worker (which takes over any part left unclaimed for a
  lease's length) runs it again, writing the same bytes.
- **Fenced by the attempt.** A part message names the attempt that queued it. A part runs only
  while the job is ``running`` in that attempt, stops when it is cancelled, taken over or told to
  stop (``stop`` in ``{p}fanout:<job>:<attempt>``), and records nothing once it is not current.
  A takeover sets ``stop`` for the earlier attempts and waits until their part leases are gone
  before it carries on (or removes) their fan-out (:meth:`RedisPartRunner.for_attempt`).
- **Progress and failures** go through the same hash: each part's values and bytes written (the
  job's worker sums them into the job's progress) and the first part failure (the job fails
  with it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Collection, Iterator
from typing import Any

from redis.exceptions import RedisError

from ckptconv import jobs
from ckptconv.core.errors import Cancelled, CkptconvError, LeaseLost
from ckptconv.core.fencing import Attempt, attempt_scope
from ckptconv.core.jobstore import JobStore
from ckptconv.core.scopes import record_scopes
from ckptconv.storage.confined import scoped
from worker.celery_app import app, settings, store

log = logging.getLogger("ckptconv.worker")

PART_TASK = "ckptconv.run_part"
REPORT_INTERVAL_SECONDS = 0.25
STATE_TTL_SECONDS = 7 * 24 * 3600  # the counters outlive any job; they expire by themselves

# Renew / release a lease only while it is still ours.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class RedisPartRunner:
    """:class:`ckptconv.engine.fanout.PartRunner` for one attempt of one job, shared through Redis."""

    def __init__(self, store: JobStore, settings: Any, job_id: str, attempt: int) -> None:
        self.store = store
        self.r = store.r
        self.settings = settings
        self.job_id = job_id
        self.attempt = attempt
        self.hash = f"{store.keys.p}fanout:{job_id}:{attempt}"
        self.lease_prefix = f"{store.keys.p}part:{job_id}:{attempt}:"
        self.grace_seconds = float(settings.lease_seconds)
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lost: set[int] = set()
        self._last_report = 0.0

    def for_attempt(self, attempt: int) -> RedisPartRunner:
        return RedisPartRunner(self.store, self.settings, self.job_id, attempt)

    def dispatch(self, count: int) -> None:
        self.r.expire(self.hash, STATE_TTL_SECONDS)
        for index in range(count):
            app.send_task(PART_TASK, args=[self.job_id, self.attempt, index], queue=self.settings.jobs_queue)

    @contextlib.contextmanager
    def claim(self, index: int) -> Iterator[bool]:
        key = self.lease_prefix + str(index)
        lease_ms = int(self.settings.lease_seconds * 1000)
        # A SET sent again after its reply was lost finds the lease it took: its own token.
        if not self.r.set(key, self.token, nx=True, px=lease_ms) and self.r.get(key) != self.token:
            yield False
            return
        done = threading.Event()

        def renew() -> None:
            while not done.wait(self.settings.heartbeat_seconds):
                try:
                    if not int(self.r.eval(_RENEW, 1, key, self.token, lease_ms)):
                        self.lost.add(index)
                        return
                except RedisError as e:  # keep trying: the lease decides who holds the part
                    log.warning("part %d of job %s: lease renewal failed: %s", index, self.job_id, e)

        beat = threading.Thread(target=renew, name=f"ckptconv-part-{index}", daemon=True)
        beat.start()
        try:
            yield True
        finally:
            done.set()
            beat.join(timeout=5)
            with contextlib.suppress(RedisError):
                self.r.eval(_RELEASE, 1, key, self.token)

    def held(self, indexes: Collection[int]) -> set[int]:
        order = list(indexes)
        if not order:
            return set()
        leases = self.r.mget([self.lease_prefix + str(i) for i in order])
        return {i for i, lease in zip(order, leases, strict=True) if lease is not None}

    def holds(self, index: int) -> bool:
        """Whether this process still holds part ``index``."""
        return index not in self.lost and self.r.get(self.lease_prefix + str(index)) == self.token

    def report(self, index: int, tensors: int, nbytes: int) -> None:
        now = time.monotonic()
        if now - self._last_report < REPORT_INTERVAL_SECONDS:
            return
        self._last_report = now
        with contextlib.suppress(RedisError):  # progress is advisory
            self.r.hset(self.hash, mapping={f"tensors:{index}": tensors, f"bytes:{index}": nbytes})

    def reported(self) -> tuple[int, int]:
        counters = self.r.hgetall(self.hash)
        tensors = sum(int(v) for k, v in counters.items() if k.startswith("tensors:"))
        nbytes = sum(int(v) for k, v in counters.items() if k.startswith("bytes:"))
        return tensors, nbytes

    def failure(self) -> dict[str, Any] | None:
        raw = self.r.hget(self.hash, "error")
        return json.loads(raw) if raw else None

    def fail(self, problem: dict[str, Any]) -> None:
        self.r.hsetnx(self.hash, "error", json.dumps(problem))
        self.r.expire(self.hash, STATE_TTL_SECONDS)

    def stop(self) -> None:
        with contextlib.suppress(RedisError):
            self.r.hset(self.hash, "stop", "1")
            self.r.expire(self.hash, STATE_TTL_SECONDS)

    def stopped(self) -> bool:
        return bool(self.r.hget(self.hash, "stop"))

    def wait_idle(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        keys = [self.lease_prefix + str(i) for i in range(count)]
        while keys and time.monotonic() < deadline:
            with contextlib.suppress(RedisError):
                if not self.r.exists(*keys):
                    return
            time.sleep(0.1)


@app.task(name=PART_TASK)
def run_part(job_id: str, attempt: int, index: int) -> None:
    PartRun(store(), settings(), job_id, int(attempt), int(index)).execute()


class PartRun:
    """One delivery of one part's message (see the module docstring)."""

    def __init__(self, store: JobStore, settings: Any, job_id: str, attempt: int, index: int) -> None:
        self.store = store
        self.job_id = job_id
        self.attempt = attempt
        self.index = index
        self.runner = RedisPartRunner(store, settings, job_id, attempt)
        self._last_check = 0.0
        self._stop = False

    def execute(self) -> None:
        rec = self.store.get(self.job_id)
        if rec is None or not self._current(rec) or self.runner.stopped():
            log.info("part %d of job %s (attempt %d) is not wanted any more", self.index, self.job_id, self.attempt)
            return
        with self.runner.claim(self.index) as mine:
            if not mine:
                log.info("part %d of job %s runs elsewhere: dropping this delivery", self.index, self.job_id)
                return
            request = json.loads(rec["request"])
            try:
                ctx = jobs.context_from_request(
                    {"kind": rec["kind"], **request}, self.job_id, cancelled=self._cancelled, parts=self.runner
                )
                with scoped(record_scopes(rec)), attempt_scope(Attempt(self.job_id, self.attempt, self._fence)):
                    jobs.handler(ctx.kind).run_part(ctx, self.index)
            except (Cancelled, LeaseLost):
                log.info("part %d of job %s stopped", self.index, self.job_id)
            except RedisError:
                raise  # infrastructure: the message is not acknowledged and comes back
            except CkptconvError as e:
                self.runner.fail(e.public(log, f"job {self.job_id} part {self.index}").to_problem())
            except Exception as e:
                error = CkptconvError(f"unexpected {type(e).__name__}: {e}")
                self.runner.fail(error.logged(log, f"job {self.job_id} part {self.index}", e).to_problem())

    def _current(self, rec: dict[str, str]) -> bool:
        return rec.get("state") == "running" and rec.get("attempts") == str(self.attempt)

    def _fence(self) -> None:
        rec = self.store.get(self.job_id)
        if rec is None or not self._current(rec) or self.runner.stopped() or not self.runner.holds(self.index):
            raise LeaseLost(f"part {self.index} of job {self.job_id}: attempt {self.attempt} is no longer current")

    def _cancelled(self) -> bool:
        now = time.monotonic()
        if not self._stop and now - self._last_check >= 0.5:
            self._last_check = now
            try:
                state, attempts, cancel = self.store.r.hmget(
                    self.store.keys.job(self.job_id), "state", "attempts", "cancel_requested"
                )
                self._stop = (
                    state != "running"
                    or attempts != str(self.attempt)
                    or bool(cancel)
                    or self.runner.stopped()
                    or self.index in self.runner.lost
                )
            except RedisError:
                pass
        return self._stop
