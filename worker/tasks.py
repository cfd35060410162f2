"""Celery tasks: run a job, answer a dry run or an inspection, deliver a completion webhook.

How a job runs exactly once although workers die (heartbeat + lease)
--------------------------------------------------------------------

The task message carries only the job id; everything else is in the job record in Redis.
Messages are acknowledged late (when the task returns) and the broker re-delivers a message that
was not acknowledged within ``visibility_timeout_seconds``. A conversion can run for hours, far
longer than any visibility timeout short enough to recover quickly from a dead worker, so:

- **Lease.** Before running, a worker takes ``{p}lease:{job}`` (``SET NX PX``, value = its token)
  for ``3 x heartbeat_seconds``.
- **Heartbeat.** While the job runs, a thread renews the lease every ``heartbeat_seconds`` *and*
  moves the message's entry in kombu's unacked index to "now" (the message's ``delivery_tag`` is
  the job id, set by the API). The broker therefore never sees a running job's message as
  abandoned and does not re-deliver it. The same beat reads the job's cancel flag.
- **Worker lost** (``kill -9``, a lost machine): the beats stop; ``visibility_timeout`` later the
  broker re-delivers the message, the lease has expired, and the new worker takes over: it runs the
  handler again with the same job id. The engine is idempotent per job id (a published manifest with
  this id is returned as is; a staged, verified output is published; otherwise staging starts
  afresh), so the job ends ``succeeded`` with exactly one set of outputs, and nothing partial ever
  appears at the target (outputs are staged and published with the manifest last).
- **Duplicate delivery while the holder lives** (should not happen, but brokers are at-least-once):
  the second worker finds a fresh lease held by someone else and does not run the job; it waits,
  keeping its own delivery alive, until the job ends (then it acknowledges and drops the message)
  or the holder's lease expires (then it takes over as above).
- **Lease lost while running** (the process stalled longer than the lease and another worker took
  over): the next beat notices, the handler is told to stop (``cancelled()`` returns True), and this
  worker leaves the record alone: the new holder owns it.

Per-stage tasks were the alternative (plan, convert, verify, publish as separate messages); they
do not help here because the long stage (converting) is one stream that cannot be cut into
short-lived messages without resumable sinks.

Time limits: ``max_runtime_seconds`` counts from the job's first start. The handler's
``cancelled()`` turns true at that deadline (this works in every pool); with the prefork pool the
message also carries Celery soft/hard limits as a backstop for a handler stuck in I/O.
"""

from __future__ import annotations

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

from celery.exceptions import SoftTimeLimitExceeded

from ckptconv import __version__, jobs
from ckptconv.core import webhooks
from ckptconv.core.errors import Cancelled, CkptconvError, TimeLimitExceeded, WebhookRefused, WorkerLost
from ckptconv.core.jobstore import TERMINAL, JobStore, RedisKeys, encode_field, iso, job_resource, now_ms
from ckptconv.core.webhooks import sign
from ckptconv.engine.convert import inspect as inspect_checkpoint
from worker.celery_app import app

log = logging.getLogger("ckptconv.worker")

CANCEL_POLL_SECONDS = 0.5  # how often cancelled() reads the flag itself, between heartbeats
REPLY_TTL_SECONDS = 60
MIRROR_SUFFIX = ".ckptconv-job.json"

_store: JobStore | None = None
_store_pid: int | None = None


def settings() -> Any:
    return app.conf.ckptconv_settings


def store() -> JobStore:
    """One Redis client per process (created after a prefork fork, never shared across one)."""
    global _store, _store_pid
    if _store is None or _store_pid != os.getpid():
        import redis

        s = settings()
        client = redis.Redis.from_url(
            s.redis_url, decode_responses=True, socket_connect_timeout=5, socket_timeout=30, health_check_interval=30
        )
        _store = JobStore(client, RedisKeys(s.redis_prefix, s.broker_prefix), retention_seconds=s.job_retention_seconds)
        _store_pid = os.getpid()
    return _store


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
        self.cancel_requested = threading.Event()
        self.lease_lost = threading.Event()
        self.stopped = threading.Event()
        self.deadline = float("inf")
        self._last_cancel_poll = 0.0

    # -- lifecycle

    def execute(self) -> None:
        rec = self.store.get(self.job_id)
        if rec is None:
            log.warning("job %s has no record (expired or unknown): dropping its message", self.job_id)
            return
        if rec["state"] in TERMINAL:
            return  # e.g. cancelled while queued, or a late duplicate of a finished job
        if not self._claim(rec):
            return
        try:
            self._run_claimed()
        finally:
            self.stopped.set()
            self.store.release_lease(self.job_id, self.token)

    def _claim(self, rec: dict[str, str]) -> bool:
        """Take the job's lease; while another live worker holds it, wait (see module docstring)."""
        request = json.loads(rec["request"])
        give_up = time.monotonic() + request["max_runtime_seconds"] + self.settings.visibility_timeout_seconds
        while not self.store.acquire_lease(self.job_id, self.token, self.settings.lease_seconds):
            holder = self.store.lease_holder(self.job_id)
            log.info("job %s is running on %s: waiting in case that worker is lost", self.job_id, holder)
            if time.monotonic() > give_up:
                return False
            self.store.touch_delivery(rec.get("delivery_tag") or self.job_id)
            time.sleep(self.settings.heartbeat_seconds)
            rec = self.store.get(self.job_id) or {"state": "succeeded"}
            if rec["state"] in TERMINAL:
                return False
        return True

    def _run_claimed(self) -> None:
        rec = self.store.get(self.job_id)
        if rec is None or rec["state"] in TERMINAL:
            return
        request = json.loads(rec["request"])
        started = int(rec.get("started_ms") or now_ms())
        self.deadline = started / 1000 + request["max_runtime_seconds"]
        try:
            ctx = jobs.context_from_request(
                {"kind": rec["kind"], **request}, self.job_id, progress=self._progress, cancelled=self._cancelled
            )
            module = jobs.handler(ctx.kind)
        except Exception as e:  # e.g. a kind this worker's version does not know
            error = e if isinstance(e, CkptconvError) else CkptconvError(f"cannot run this job: {type(e).__name__}")
            self._finish("failed", {"error": error.to_problem()})
            return
        if rec["state"] == "cancelling":
            # Cancel was requested while a worker that is now lost ran the job: finish the cancel.
            self._cleanup(module, ctx)
            self._finish("cancelled", {"error": Cancelled("cancelled by request").to_problem()})
            return
        attempts = int(rec.get("attempts") or 0)
        if attempts >= self.settings.max_attempts:
            # Each attempt ended with its worker lost (killed, out of memory): do not loop forever.
            lost = WorkerLost(f"the job's worker was lost {attempts} times; not trying again")
            self._cleanup(module, ctx)
            self._finish("failed", {"error": lost.to_problem()})
            return
        moved, previous = self.store.transition(
            self.job_id,
            ("queued", "running"),
            "running",
            {
                "started_ms": str(started),
                "attempts": str(attempts + 1),
                "worker": self.token,
                "heartbeat_ms": str(now_ms()),
            },
        )
        if not moved:
            if previous == "cancelling":
                self._finish("cancelled", {"error": Cancelled("cancelled by request").to_problem()})
            return
        if previous == "running":
            log.warning("job %s: taking over from a lost worker", self.job_id)
        beat = threading.Thread(target=self._beat, args=(rec.get("delivery_tag") or self.job_id,), daemon=True)
        beat.start()
        try:
            if time.time() > self.deadline:
                raise TimeLimitExceeded(f"the job ran past max_runtime_seconds={request['max_runtime_seconds']}")
            result = module.run(ctx)
        except Cancelled as e:
            if self.lease_lost.is_set():
                log.warning("job %s: lease lost to another worker; leaving the job to it", self.job_id)
                return
            if self.cancel_requested.is_set() or self._cancel_flag():
                self._finish("cancelled", {"error": e.to_problem()})
            else:
                limit = TimeLimitExceeded(f"the job ran past max_runtime_seconds={request['max_runtime_seconds']}")
                self._finish("failed", {"error": limit.to_problem()})
        except SoftTimeLimitExceeded:
            limit = TimeLimitExceeded(f"the job ran past max_runtime_seconds={request['max_runtime_seconds']}")
            self._finish("failed", {"error": limit.to_problem()})
        except CkptconvError as e:
            log.info("job %s failed: %s", self.job_id, e)
            self._finish("failed", {"error": e.to_problem()})
        except Exception as e:
            log.exception("job %s failed unexpectedly", self.job_id)
            self._finish("failed", {"error": CkptconvError(f"internal error: {type(e).__name__}: {e}").to_problem()})
        else:
            if self.lease_lost.is_set():
                return
            self._finish("succeeded", {"result": result}, nbytes=int(result.get("bytes") or 0))
        finally:
            self.stopped.set()
            beat.join(timeout=5)

    def _finish(self, state: str, fields: dict[str, Any], nbytes: int = 0) -> None:
        fields = {**fields, "finished_ms": str(now_ms())}
        rec = self.store.get(self.job_id)
        if rec is None or rec["state"] in TERMINAL:
            log.warning("job %s: could not record %s (state is %s)", self.job_id, state, rec and rec["state"])
            return
        # The record goes beside the outputs before the state turns terminal, so a client that sees
        # the final state finds the mirror already there.
        self._mirror({**rec, **{k: encode_field(v) for k, v in fields.items()}, "state": state})
        moved, previous = self.store.transition(
            self.job_id, ("queued", "running", "cancelling"), state, fields, nbytes=nbytes
        )
        if not moved:
            # Someone else finished the job in between: the mirror must tell what they recorded.
            log.warning("job %s: could not record %s (state is %s)", self.job_id, state, previous)
            final = self.store.get(self.job_id)
            if final is not None and final["state"] in TERMINAL:
                self._mirror(final)
            return
        if json.loads(rec["request"]).get("webhook"):
            deliver_webhook.apply_async(args=[self.job_id], queue=self.settings.interactive_queue)

    def _cleanup(self, module: Any, ctx: jobs.JobContext) -> None:
        if hasattr(module, "cleanup"):
            try:
                module.cleanup(ctx)
            except Exception:
                log.exception("job %s: cleanup failed", self.job_id)

    # -- callbacks and the heartbeat

    def _beat(self, delivery_tag: str) -> None:
        while not self.stopped.wait(self.settings.heartbeat_seconds):
            try:
                mine, cancel = self.store.heartbeat(self.job_id, self.token, self.settings.lease_seconds, delivery_tag)
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
            self.store.progress(self.job_id, doc)
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
            from ckptconv.storage import open_storage

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
        doc = {"ok": False, "problem": e.to_problem()}
    except Exception as e:
        log.exception("interactive task failed")
        doc = {"ok": False, "problem": CkptconvError(f"internal error: {type(e).__name__}: {e}").to_problem()}
    r = store().r
    pipe = r.pipeline(transaction=False)
    pipe.rpush(reply_key, json.dumps(doc, default=str))
    pipe.expire(reply_key, REPLY_TTL_SECONDS)
    pipe.execute()


@app.task(name="ckptconv.plan")
def plan(reply_key: str, payload: dict[str, Any]) -> None:
    _reply(reply_key, lambda: jobs.plan(jobs.context_from_request(payload)))


@app.task(name="ckptconv.inspect")
def inspect(reply_key: str, payload: dict[str, Any]) -> None:
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
    if not hook or delivery.get("delivered_ms"):
        return  # a duplicate of a delivered event
    attempt = int(delivery.get("attempts", 0)) + 1
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
    error: str | None = None
    final = False
    try:
        status = webhooks.post(
            hook["url"],
            body,
            headers,
            timeout=s.webhook_timeout_seconds,
            allow_private=s.webhook_allow_private_networks,
        )
        if not 200 <= status < 300:
            error = f"HTTP {status}"
    except WebhookRefused as e:
        error, final = str(e), True
    except (webhooks.Unresolvable, httpx.HTTPError) as e:  # DNS, connect errors, timeouts: retried
        error = f"{type(e).__name__}: {e}"
    delivery = {"attempts": attempt, "last_status": status, "last_error": error}
    if error is None:
        delivery["delivered_ms"] = now_ms()
    st.set_fields(job_id, {"webhook_delivery": delivery})
    if error is None:
        return
    if final or status == 410 or attempt >= s.webhook_max_attempts:
        log.warning("job %s: giving up on webhook %s after %d attempts: %s", job_id, hook["url"], attempt, error)
        return
    countdown = min(3600.0, s.webhook_backoff_seconds * 2 ** (attempt - 1)) * (1 + random.random() / 4)
    raise self.retry(countdown=countdown)
