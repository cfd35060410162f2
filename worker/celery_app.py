"""The Celery application of the workers: ``celery -A worker.celery_app worker`` (or ``ckptconv worker``).

Two queues: ``jobs`` (conversions, long) and ``interactive`` (dry runs, inspections, webhook
deliveries: short). Messages are acknowledged late (after the task ends), one message is reserved at
a time, and a message whose worker died is re-delivered by the broker after
``visibility_timeout_seconds`` — while a job runs, its worker keeps pushing that deadline forward
(heartbeat; see ``worker/tasks.py``), so a running job is never delivered twice.

Importing this module configures nothing and connects nowhere: the application is built on first
use of ``app`` from the environment's settings, so importing it stays cheap and side-effect free.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import worker_init, worker_process_init, worker_ready
from kombu import Exchange, Queue

from ckptconv.core.jobstore import REDIS_RETRIES, JobStore, RedisKeys, redis_backoff
from ckptconv.core.scopes import NOTHING
from ckptconv.core.settings import Settings, get_settings
from ckptconv.formats.memory import bound_allocator
from ckptconv.storage import scratch
from ckptconv.storage.confined import set_default_scopes
from worker.reaper import Reaper


def make_celery(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    app = Celery("ckptconv", broker=settings.redis_url, include=["worker.tasks"])
    restore_every = max(1, min(10, int(settings.visibility_timeout_seconds // 3)))
    app.conf.update(
        broker_transport_options={
            # All of Celery's keys live under our prefix: deployments sharing a Redis stay apart.
            "global_keyprefix": settings.broker_prefix,
            "visibility_timeout": settings.visibility_timeout_seconds,
            # Scan for messages of lost workers every few seconds, not every 100 s (kombu's default
            # interval x throttle), so a job whose worker died is taken over soon after the timeout.
            "unacked_restore_interval": restore_every,
            "unacked_restore_throttle": 1,
        },
        broker_connection_retry_on_startup=True,
        # One direct exchange per queue: a task published by Celery (webhooks) reaches one queue only.
        task_queues=[
            Queue(q, Exchange(q, type="direct"), routing_key=q)
            for q in (settings.jobs_queue, settings.interactive_queue)
        ],
        task_default_queue=settings.interactive_queue,
        task_routes={"ckptconv.run_job": {"queue": settings.jobs_queue}},
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # A task that failed on an infrastructure error (handlers catch everything else) is not
        # acknowledged, so the broker delivers it again and the job is taken over.
        task_acks_on_failure_or_timeout=False,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        worker_send_task_events=False,
        task_send_sent_event=False,
    )
    app.conf.ckptconv_settings = settings
    # Each process that runs jobs bounds its allocator first (see ckptconv.formats.memory): the pool's
    # children, or the worker itself with the solo and thread pools.
    worker_init.connect(_bound_allocator, weak=False, dispatch_uid="ckptconv-allocator")
    worker_process_init.connect(_bound_allocator, weak=False, dispatch_uid="ckptconv-allocator-child")
    worker_init.connect(_sweep_scratch, weak=False, dispatch_uid="ckptconv-scratch")
    worker_ready.connect(_start_reaper, weak=False, dispatch_uid="ckptconv-reaper")
    # Storage opened outside a job's scope reaches nothing (see ckptconv.storage.confined).
    worker_init.connect(_confine_storage, weak=False, dispatch_uid="ckptconv-confine")
    worker_process_init.connect(_confine_storage, weak=False, dispatch_uid="ckptconv-confine-child")
    return app


def _start_reaper(**_: Any) -> None:
    """Each worker's main process runs the reaper (see worker/reaper.py) beside its consumer."""
    Reaper(store(), settings()).start()


def _bound_allocator(**_: Any) -> None:
    bound_allocator()


def _sweep_scratch(**_: Any) -> None:
    # Workers killed with SIGKILL on this host left their scratch files: remove them at start.

    scratch.sweep()


def _confine_storage(**_: Any) -> None:
    set_default_scopes(NOTHING)


_app: Celery | None = None
_store: JobStore | None = None
_store_pid: int | None = None


def settings() -> Any:
    """The settings the application was built with."""
    return __getattr__("app").conf.ckptconv_settings


def store() -> JobStore:
    """One Redis client per process (created after a prefork fork, never shared across one)."""
    global _store, _store_pid
    if _store is None or _store_pid != os.getpid():
        import redis
        from redis.retry import Retry

        s = settings()
        # The API's retry policy: a state transition that meets a dropped connection is sent again
        # (its scripts are safe to resend) rather than failing the attempt, whose message would
        # then be requeued and its work done again.
        client = redis.Redis.from_url(
            s.redis_url,
            decode_responses=True,
            socket_connect_timeout=5,
            socket_timeout=30,
            health_check_interval=30,
            retry=Retry(redis_backoff(), REDIS_RETRIES),
            retry_on_error=[redis.exceptions.ConnectionError],
        )
        _store = JobStore(client, RedisKeys(s.redis_prefix, s.broker_prefix), retention_seconds=s.job_retention_seconds)
        _store_pid = os.getpid()
    return _store


def __getattr__(name: str) -> Any:
    # ``celery -A worker.celery_app`` looks up ``app`` (then ``celery``) on this module.
    global _app
    if name in ("app", "celery"):
        if _app is None:
            _app = make_celery()
        return _app
    raise AttributeError(name)
