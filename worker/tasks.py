"""Celery tasks: run a job, answer a dry run or an inspection, deliver a completion webhook.

How a job runs exactly once although workers die (heartbeat + lease)
--------------------------------------------------------------------

The task message carries only the job id; everything else is in the job record in Redis.
Messages are acknowledged late (when the task returns) and the broker re-delivers a message that
was not acknowledged within ``visibility_timeout_seconds``. A conversion can run for hours, far
longer than any visibility timeout short enough to recover quickly from a dead worker, so:

- **Attempt and lease.** Before running, a worker starts an attempt: one script takes
  ``{p}lease:{job}`` (value = its token, for ``3 x heartbeat_seconds``) and increments the job's
  ``attempts``, so each attempt number has exactly one holder. Every later change the attempt makes
  is fenced by that number (``ckptconv.core.fencing``): state transitions and progress compare it in
  Redis, staging paths contain it, and publication checks it before each file and the manifest.
- **Heartbeat.** While the job runs, a thread renews the lease every ``heartbeat_seconds`` *and*
  moves the message's entry in kombu's unacked index to "now" (the message's ``delivery_tag`` is
  the job id, set by the API). The broker therefore never sees a running job's message as
  abandoned and does not re-deliver it. The same beat reads the job's cancel flag. A lease that
  lapsed (Redis slow or away for longer than the lease) is taken again when nobody else holds it
  and the job is still in this attempt.
- **Worker lost** (``kill -9``, a lost machine): the beats stop; ``visibility_timeout`` later the
  broker re-delivers the message, the lease has expired, and the new worker starts the next
  attempt: it runs the handler again with the same job id. The engine is idempotent per job id (a
  published manifest with this id is returned as is; a staged, verified output of any attempt is
  published; a fanned-out job carries on the earlier attempt's fan-out and its recorded parts
  when the plan is the same, see ``ckptconv.engine.fanout``; otherwise staging starts afresh,
  and the earlier attempts' staging areas and uploads are removed), so the job ends
  ``succeeded`` with exactly one set of outputs, and nothing partial ever appears at the target
  (outputs are staged and published create-only with the manifest last). After
  ``max_attempts`` the job fails with ``worker_lost``.
- **Duplicate delivery while the holder lives** (brokers are at-least-once): the second worker
  finds a live lease held by someone else, does not run the job, and drops its copy.
- **Lease lost while running** (the process stalled, another worker took over): the next beat or
  fence check notices, the handler is told to stop (``cancelled()`` returns True, publication
  raises ``LeaseLost``), and this worker records nothing: the new attempt owns the job.
- **Redis errors** (an infrastructure failure, not the job's): a command that met a dropped
  connection is first sent again under the API's retry policy (``worker.celery_app.store``; the
  scripts are safe to resend); past it, the message is put back at the head of its queue after a
  backoff (``Reject(requeue=True)``), never acknowledged as done; if even that fails the broker
  restores it after the visibility timeout.
- **Nothing else covers it**: the reaper (``worker/reaper.py``) queues again any job that is not
  final yet has no lease and no message.

Per-stage tasks were the alternative (plan, convert, verify, publish as separate messages); they
do not help here because the long stage (converting) is one stream that cannot be cut into
short-lived messages without resumable sinks.

Time limits: ``max_runtime_seconds`` counts from the job's first start. The handler's
``cancelled()`` turns true at that deadline (this works in every pool) and the job fails with
``time_limit_exceeded`` after removing its staging; the deadline is not consulted during
publication, which is short and either completes (manifest last) or removes what it placed. With
the prefork pool the message also carries Celery soft and hard limits, later by a grace period
(``service/queue.py``), as a backstop for a handler stuck in I/O.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery.exceptions import Reject, SoftTimeLimitExceeded
from redis.exceptions import RedisError

from ckptconv import __version__, jobs
from ckptconv.core import webhooks
from ckptconv.core.errors import (
    Cancelled,
    CkptconvError,
    LeaseLost,
    StorageError,
    TimeLimitExceeded,
    WebhookRefused,
    WorkerLost,
)
from ckptconv.core.fencing import Attempt, attempt_scope
from ckptconv.core.job_records import TERMINAL, encode_field, iso, job_resource, now_ms
from ckptconv.core.jobstore import JobStore
from ckptconv.core.scopes import record_scopes
from ckptconv.core.webhooks import sign
from ckptconv.engine.convert import inspect as inspect_checkpoint
from ckptconv.storage import open_storage
from ckptconv.storage.confined import scoped
from ckptconv.storage.retry import persistent
from worker.celery_app import app, settings, store
from worker.parts import RedisPartRunner

log = logging.getLogger("ckptconv.worker")

CANCEL_POLL_SECONDS = 0.5  # how often cancelled() reads the flag itself, between heartbeats
REPLY_TTL_SECONDS = 60
MIRROR_SUFFIX = ".ckptconv-job.json"
INFRA_BACKOFF_MAX_SECONDS = 30.0
_infra_failures = 0  # consecutive Redis failures of this process's jobs: their requeue backs off

# --- jobs --------------------------------------------------------------------------------------


@app.task(name="ckptconv.run_job", bind=True)
def run_job(self: Any, job_id: str) -> None:
    JobRun(store(), settings(), job_id).execute()


class JobRun:
    """One attempt at one job on this worker (see the module docstring)."""

    def __init__(self, store: JobStore, settings: Any, job_id: str) -> None:
        self.store = store
        self.settings = settings
        self.job_id = job_id
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.attempt = 0
        self.cancel_requested = threading.Event()
        self.lease_lost = threading.Event()
        self.stopped = threading.Event()
        self.deadline = float("inf")
        self._last_cancel_poll = 0.0

    # -- lifecycle

    def execute(self) -> None:
        """Run the job, or requeue its message when Redis fails us (never ack work left undone)."""
        global _infra_failures
        try:
            self._execute()
        except RedisError as e:
            _infra_failures += 1
            backoff = min(INFRA_BACKOFF_MAX_SECONDS, 0.5 * 2 ** min(_infra_failures, 8)) * (0.5 + random.random())
            log.warning("job %s: Redis failed (%s); message requeued after %.1f s", self.job_id, e, backoff)
            self.stopped.set()
            with contextlib.suppress(Exception):
                self.store.release_lease(self.job_id, self.token)
            time.sleep(backoff)
            # Back at the head of its queue; if Redis cannot take even that, the message stays
            # unacknowledged and the broker restores it after the visibility timeout.
            raise Reject(f"Redis failed: {type(e).__name__}", requeue=True) from None
        _infra_failures = 0

    def _execute(self) -> None:
        rec = self.store.get(self.job_id)
        if rec is None:
            log.warning("job %s has no record (expired or unknown): dropping its message", self.job_id)
            return
        if rec["state"] in TERMINAL:
            return  # e.g. cancelled while queued, or a late duplicate of a finished job
        outcome = self.store.start_attempt(
            self.job_id, self.token, self.settings.lease_seconds, self.settings.max_attempts
        )
        if outcome[0] == "held":
            # A duplicate delivery while the holder lives: it runs the job. If it dies, its lease
            # lapses and the reaper queues the job again; this message is not needed for that.
            log.info("job %s is running on %s: dropping this duplicate delivery", self.job_id, outcome[1])
            return
        if outcome[0] == "exhausted":
            # Each attempt ended with its worker lost (killed, out of memory): do not loop forever.
            self.attempt = int(outcome[1])
            with scoped(record_scopes(rec)):
                self._fail_for_good(rec, WorkerLost(f"the job's worker was lost {outcome[1]} times; not trying again"))
            return
        if outcome[0] != "started":
            return  # final or gone meanwhile
        self.attempt = int(outcome[1])
        try:
            # Everything the job touches in storage, from its request or from files, stays in its owner's scopes.
            with scoped(record_scopes(rec)), attempt_scope(Attempt(self.job_id, self.attempt, self._fence)):
                self._run_attempt(self.store.get(self.job_id) or rec, previous=outcome[2])
        finally:
            self.stopped.set()
            self.store.release_lease(self.job_id, self.token)

    def _fail_for_good(self, rec: dict[str, str], error: CkptconvError) -> None:
        request = json.loads(rec["request"])
        try:
            ctx = jobs.context_from_request({"kind": rec["kind"], **request}, self.job_id)
            module = jobs.handler(ctx.kind)
        except Exception:
            self._finish("failed", {"error": error.to_problem()})
            return
        self._end_unpublished(module, ctx, "failed", {"error": error.to_problem()})

    def _run_attempt(self, rec: dict[str, str], previous: str) -> None:
        request = json.loads(rec["request"])
        started = int(rec.get("started_ms") or now_ms())
        self.deadline = started / 1000 + request["max_runtime_seconds"]
        limit = TimeLimitExceeded(f"the job ran past max_runtime_seconds={request['max_runtime_seconds']}")
        try:
            ctx = jobs.context_from_request(
                {"kind": rec["kind"], **request},
                self.job_id,
                progress=self._progress,
                cancelled=self._cancelled,
                parts=RedisPartRunner(self.store, self.settings, self.job_id, self.attempt),
            )
            module = jobs.handler(ctx.kind)
        except Exception as e:  # e.g. a kind this worker's version does not know
            error = e if isinstance(e, CkptconvError) else CkptconvError(f"cannot run this job: {type(e).__name__}")
            self._finish("failed", {"error": error.to_problem()})
            return
        if previous == "cancelling":
            # Cancel was requested while a worker that is now lost ran the job: finish the cancel
            # (or the job, if that worker's publication had finished).
            self._end_unpublished(module, ctx, "cancelled", {"error": Cancelled("cancelled by request").to_problem()})
            return
        if previous == "running":
            log.warning("job %s: taking over from a lost worker (attempt %d)", self.job_id, self.attempt)
        beat = threading.Thread(target=self._beat, args=(rec.get("delivery_tag") or self.job_id,), daemon=True)
        beat.start()
        try:
            if time.time() > self.deadline:
                raise limit
            result = module.run(ctx)
        except LeaseLost:
            self.lease_lost.set()
        except Cancelled as e:
            if self.lease_lost.is_set():
                pass
            elif self.cancel_requested.is_set() or self._cancel_flag():
                self._end_unpublished(module, ctx, "cancelled", {"error": e.to_problem()})
            else:
                self._end_unpublished(module, ctx, "failed", {"error": limit.to_problem()})
        except SoftTimeLimitExceeded:
            self._end_unpublished(module, ctx, "failed", {"error": limit.to_problem()})
        except RedisError:
            raise  # infrastructure: the message is requeued (see execute)
        except TimeLimitExceeded as e:
            self._end_unpublished(module, ctx, "failed", {"error": e.to_problem()})
        except CkptconvError as e:
            log.info("job %s failed: %s", self.job_id, e)
            # The run discarded its own staging, but not what an earlier attempt left when it failed
            # before reaching it (a publication killed mid-copy: its staged output, and an upload at
            # a final key). After a storage error, the store just failed at the budget: trying harder.
            error = e.public(log, f"job {self.job_id}").to_problem()
            with persistent() if isinstance(e, StorageError) else contextlib.nullcontext():
                self._end_unpublished(module, ctx, "failed", {"error": error})
        except Exception as e:
            error = CkptconvError(f"unexpected {type(e).__name__}: {e}").logged(log, f"job {self.job_id}", e)
            self._end_unpublished(module, ctx, "failed", {"error": error.to_problem()})
        else:
            if not self.lease_lost.is_set():
                self._finish("succeeded", {"result": result}, nbytes=int(result.get("bytes") or 0))
        finally:
            self.stopped.set()
            beat.join(timeout=5)
        if self.lease_lost.is_set():
            log.warning("job %s: attempt %d lost the job to another worker; leaving it", self.job_id, self.attempt)

    def _fence(self) -> None:
        """Raise LeaseLost unless this attempt still owns the job (called before each publication step)."""
        if self.lease_lost.is_set() or not self.store.is_current(self.job_id, self.attempt, self.token):
            self.lease_lost.set()
            raise LeaseLost(f"job {self.job_id}: attempt {self.attempt} is no longer current")

    def _finish(self, state: str, fields: dict[str, Any], nbytes: int = 0) -> None:
        fields = {**fields, "finished_ms": str(now_ms())}
        rec = self.store.get(self.job_id)
        if rec is None or rec["state"] in TERMINAL:
            log.warning("job %s: could not record %s (state is %s)", self.job_id, state, rec and rec["state"])
            return
        if str(self.attempt) != rec.get("attempts"):
            log.warning("job %s: attempt %d is stale; not recording %s", self.job_id, self.attempt, state)
            return
        # The record goes beside the outputs before the state turns terminal, so a client that sees
        # the final state finds the mirror already there.
        self._mirror({**rec, **{k: encode_field(v) for k, v in fields.items()}, "state": state})
        moved, previous = self.store.transition(
            self.job_id, ("queued", "running", "cancelling"), state, fields, nbytes=nbytes, attempt=self.attempt
        )
        if not moved:
            final = self.store.get(self.job_id)
            # This very transition, sent again after its reply was lost (the retry policy), finds
            # the job final by it: what it recorded (its finish time, its attempt) tells it.
            ours = final is not None and final["state"] == state and final.get("attempts") == str(self.attempt)
            if not (ours and final is not None and final.get("finished_ms") == fields["finished_ms"]):
                # Someone else finished the job in between: the mirror must tell what they recorded.
                log.warning("job %s: could not record %s (state is %s)", self.job_id, state, previous)
                if final is not None and final["state"] in TERMINAL:
                    self._mirror(final)
                return
        if json.loads(rec["request"]).get("webhook"):
            deliver_webhook.apply_async(args=[self.job_id], queue=self.settings.interactive_queue)

    def _end_unpublished(self, module: Any, ctx: jobs.JobContext, state: str, fields: dict[str, Any]) -> None:
        """Record ``state`` (cancelled, failed) for a job this attempt did not publish, once what its
        attempts left is removed; or ``succeeded`` when a lost worker's publication had finished
        (its manifest is at the target): a job never ends unpublished with its output in place."""
        result = self._cleanup(module, ctx)
        if result is not None:
            log.info("job %s: a lost worker's publication had finished; the job succeeded", self.job_id)
            self._finish("succeeded", {"result": result}, nbytes=int(result.get("bytes") or 0))
        else:
            self._finish(state, fields)

    def _cleanup(self, module: Any, ctx: jobs.JobContext) -> dict[str, Any] | None:
        """Remove what the job's attempts left (staging, a killed publication's uploads) before it
        ends unpublished; only while this attempt owns the job: a stale one would remove the
        staging, and abort the publication, of the attempt that took the job over. Returns the
        job's result when its publication had finished (see ``ckptconv.jobs``)."""
        if not hasattr(module, "cleanup"):
            return None
        try:
            if self.lease_lost.is_set() or not self.store.is_current(self.job_id, self.attempt, self.token):
                log.warning("job %s: attempt %d no longer owns the job; not cleaning up", self.job_id, self.attempt)
                return None
            return module.cleanup(ctx)
        except CkptconvError as e:
            # A known cause (the source cannot be read any more, which is often why the job failed;
            # the store refusing a removal): one line, not a second traceback after the job's own
            # error. What a lost worker staged may be left behind.
            log.warning("job %s: no cleanup: [%s] %s", self.job_id, e.code, e.message)
            return None
        except Exception:
            log.exception("job %s: cleanup failed", self.job_id)
            return None

    # -- callbacks and the heartbeat

    def _beat(self, delivery_tag: str) -> None:
        while not self.stopped.wait(self.settings.heartbeat_seconds):
            try:
                mine, cancel = self.store.heartbeat(
                    self.job_id, self.token, self.settings.lease_seconds, delivery_tag, self.attempt
                )
            except Exception as e:  # Redis unreachable: keep trying; the lease decides who owns the job
                log.warning("job %s: heartbeat failed: %s", self.job_id, e)
                continue
            if not mine:
                self.lease_lost.set()
                return
            if cancel:
                self.cancel_requested.set()

    def _cancel_flag(self) -> bool:
        try:
            return bool(self.store.r.hget(self.store.keys.job(self.job_id), "cancel_requested"))
        except Exception:
            return False

    def _cancelled(self) -> bool:
        if self.cancel_requested.is_set() or self.lease_lost.is_set() or time.time() > self.deadline:
            return True
        now = time.monotonic()
        if now - self._last_cancel_poll >= CANCEL_POLL_SECONDS:
            self._last_cancel_poll = now
            if self._cancel_flag():
                self.cancel_requested.set()
                return True
        return False

    def _progress(self, progress: Any) -> None:
        doc = progress.to_dict() if hasattr(progress, "to_dict") else dict(progress)
        total = doc.get("bytes_total") or 0
        if total or "fraction" not in doc:  # a training run reports its own (steps, not bytes)
            doc["fraction"] = round(doc.get("bytes_done", 0) / total, 4) if total else None
        try:
            self.store.progress(self.job_id, doc, attempt=self.attempt or None)
        except Exception as e:  # progress is advisory: never fail a conversion over it
            log.warning("job %s: progress not recorded: %s", self.job_id, e)

    def _mirror(self, rec: dict[str, str]) -> None:
        """Write the finished record as JSON beside the outputs (``<target>.ckptconv-job.json``)."""
        target = (json.loads(rec["request"]).get("target") or {}).get("uri")
        if not target:
            return
        uri = target.rstrip("/") + MIRROR_SUFFIX
        doc = {"ckptconv_version": __version__, **job_resource(rec)}
        try:
            storage = open_storage(uri)
            if storage.exists(uri):
                try:
                    previous = json.loads(storage.read_all(uri))
                except ValueError:
                    return  # not a record of ours: never replace it
                if not isinstance(previous, dict) or "id" not in previous:
                    return
                if previous["id"] != rec["id"] and rec["state"] != "succeeded":
                    return  # a job that produced nothing never hides another job's record
            storage.write_bytes(uri, json.dumps(doc, indent=2).encode(), overwrite=True)
        except Exception as e:
            log.warning("job %s: could not mirror the record to %s: %s", self.job_id, uri, e)


# --- dry runs and inspections --------------------------------------------------------------------


def _reply(reply_key: str, compute: Callable[[], Any]) -> None:
    try:
        doc = {"ok": True, "value": compute()}
    except CkptconvError as e:
        doc = {"ok": False, "problem": e.public(log, "interactive task").to_problem()}
    except Exception as e:
        error = CkptconvError(f"unexpected {type(e).__name__}: {e}").logged(log, "interactive task", e)
        doc = {"ok": False, "problem": error.to_problem()}
    r = store().r
    pipe = r.pipeline(transaction=False)
    pipe.rpush(reply_key, json.dumps(doc, default=str))
    pipe.expire(reply_key, REPLY_TTL_SECONDS)
    pipe.execute()


@app.task(name="ckptconv.plan")
def plan(reply_key: str, payload: dict[str, Any]) -> None:
    with scoped(record_scopes(payload)):
        _reply(reply_key, lambda: jobs.plan(jobs.context_from_request(payload)))


@app.task(name="ckptconv.inspect")
def inspect(reply_key: str, payload: dict[str, Any]) -> None:
    with scoped(record_scopes(payload)):
        _reply(reply_key, lambda: inspect_checkpoint(payload["uri"], source_format=payload.get("format")))


# --- webhooks --------------------------------------------------------------------------------


@app.task(name="ckptconv.deliver_webhook", bind=True, max_retries=None)
def deliver_webhook(self: Any, job_id: str) -> None:
    """POST the finished job to its webhook, signed; retried with exponential backoff and jitter."""
    import httpx

    s = settings()
    st = store()
    rec = st.get(job_id)
    if rec is None:
        return
    hook = json.loads(rec["request"]).get("webhook")
    delivery = json.loads(rec.get("webhook_delivery") or "{}")
    if not hook or delivery.get("delivered_ms") or delivery.get("gave_up"):
        return  # a duplicate of a delivered (or abandoned) event
    attempt = int(delivery.get("attempts", 0)) + 1
    if attempt > s.webhook_max_attempts:
        return  # a copy of a message the broker handed out again: the budget counts on the job
    body = json.dumps(
        {"type": f"job.{rec['state']}", "timestamp": iso(now_ms()), "data": job_resource(rec)},
        separators=(",", ":"),
    ).encode()
    secret = rec.get("webhook_secret") or s.webhook_secret.get_secret_value()
    headers = {
        **sign(secret, f"msg_{job_id}", body),
        "content-type": "application/json",
        "user-agent": f"ckptconv/{__version__}",
    }
    status: int | None = None
    failure: BaseException | None = None
    try:
        status = webhooks.post(
            hook["url"],
            body,
            headers,
            timeout=s.webhook_timeout_seconds,
            allow_private=s.webhook_allow_private_networks,
        )
    except (WebhookRefused, webhooks.Unresolvable, httpx.HTTPError) as e:  # refused: final; the rest retried
        failure = e
    # The job's owner sees a typed reason; the exception text (addresses, endpoints) stays in this log.
    error = webhooks.delivery_error(failure, status)
    give_up = isinstance(failure, WebhookRefused) or status == 410 or attempt >= s.webhook_max_attempts
    delivery = {"attempts": attempt, "last_status": status, "last_error": error}
    if error is None:
        delivery["delivered_ms"] = now_ms()
    elif give_up:
        delivery["gave_up"] = True
    st.set_fields(job_id, {"webhook_delivery": delivery})
    if error is None:
        return
    detail = f"{type(failure).__name__}: {failure}" if failure is not None else f"HTTP {status}"
    if give_up:
        log.warning("job %s: giving up on webhook %s after %d attempts: %s", job_id, hook["url"], attempt, detail)
        return
    log.info("job %s: webhook attempt %d failed (%s): %s", job_id, attempt, error, detail)
    countdown = min(3600.0, s.webhook_backoff_seconds * 2 ** (attempt - 1)) * (1 + random.random() / 4)
    raise self.retry(countdown=countdown)
