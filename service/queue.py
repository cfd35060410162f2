"""Celery task messages built by the API and pushed in the same Redis round trip as the job record.

Why not ``celery.send_task``: on this kind of machine Celery's publish costs ~0.55 ms of CPU per
job, blocks the event loop, and is a second round trip after the job record is written (so a crash
between the two leaves a job that never runs). Instead the API renders the message exactly as
Celery's Redis transport stores it (Celery's own protocol-2 header code, kombu's envelope) and the
submit script writes record, indexes and message atomically. Workers are plain Celery workers: the
message is indistinguishable from one Celery published (tests run real workers against it).

The envelope (kombu's virtual transport): a JSON object with the base64 body, content type, the
task headers, and properties carrying ``delivery_tag`` (the key of kombu's unacked index, which the
worker's heartbeat refreshes: see ``worker/tasks.py``) and ``delivery_info`` (exchange ``""`` and the
queue name as routing key, which is how kombu routes to and restores into a named queue).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid
from typing import Any

from celery import Celery

from ckptconv.core.jobstore import RedisKeys

# Time limits, in order: the job's own deadline (max_runtime_seconds from its first start, checked
# cooperatively between tensors: see worker/tasks.py) fires first; Celery's soft limit (an exception
# raised wherever the task is, even mid-publication, which then removes what it placed) this much
# later; the hard limit (the process is killed; the job is taken over and finished or failed) as
# much again after that. Celery counts from the start of each delivery, never earlier than the job.
TIME_LIMIT_GRACE_SECONDS = 60


# Stand-ins in a rendered message of ckptconv.run_job, which later messages copy (see run_job).
_TASK_ID = "ckptconv-task-id-0000-000000000000000"
_JOB_ID = "job_" + "f" * 32
_TEMPLATES_MAX = 1000


class TaskMessages:
    def __init__(self, keys: RedisKeys) -> None:
        self.keys = keys
        # An unconfigured app: only its protocol-2 message builder is used, never a connection.
        self._amqp = Celery("ckptconv-api", set_as_current=False).amqp
        self._origin = f"{os.getpid()}@{socket.gethostname()}"
        self._run_job: dict[tuple[str, int], tuple[str, str]] = {}

    def render(
        self,
        task: str,
        args: list[Any],
        *,
        queue: str,
        delivery_tag: str | None = None,
        soft_time_limit: float | None = None,
        time_limit: float | None = None,
        expires_in: float | None = None,
        task_id: str | None = None,
    ) -> str:
        task_id = task_id or str(uuid.uuid4())
        msg = self._amqp.as_task_v2(
            task_id,
            task,
            args,
            {},
            soft_time_limit=soft_time_limit,
            time_limit=time_limit,
            expires=expires_in,
            origin=self._origin,
            argsrepr=repr(args),
            kwargsrepr="{}",
        )
        return json.dumps(
            {
                "body": _body(msg.body),
                "content-encoding": "utf-8",
                "content-type": "application/json",
                "headers": msg.headers,
                "properties": {
                    **msg.properties,
                    "delivery_mode": 2,
                    "delivery_info": {"exchange": "", "routing_key": queue},
                    "priority": 0,
                    "body_encoding": "base64",
                    "delivery_tag": delivery_tag or str(uuid.uuid4()),
                },
            },
            separators=(",", ":"),
        )

    def run_job(self, job_id: str, *, queue: str, max_runtime_seconds: int, task_id: str | None = None) -> str:
        """The message of ``ckptconv.run_job``: it carries only the job id (the record has the rest).

        Every submission sends one, so it is rendered once per queue and run time, with stand-ins
        for the ids, and copied with the ids put in (a fifth of the CPU of rendering it each time).
        """
        template = self._run_job.get((queue, max_runtime_seconds))
        if template is None:
            limits = time_limits(max_runtime_seconds)
            text = self.render(
                "ckptconv.run_job", [_JOB_ID], queue=queue, delivery_tag=_JOB_ID, task_id=_TASK_ID, **limits
            )
            body = _body(([_JOB_ID], {}, _EMBED))
            if text.count(body) != 1:
                raise ValueError(f"cannot make a message template from {text!r}")
            if len(self._run_job) >= _TEMPLATES_MAX:
                self._run_job.clear()
            template = self._run_job[(queue, max_runtime_seconds)] = (text, body)
        text, body = template
        text = text.replace(body, _body(([job_id], {}, _EMBED)))
        return text.replace(_TASK_ID, task_id or str(uuid.uuid4())).replace(_JOB_ID, job_id)

    async def push(self, client: Any, queue: str, message: str) -> None:
        await client.lpush(self.keys.queue(queue), message)


def time_limits(max_runtime_seconds: int) -> dict[str, float]:
    """Celery's soft and hard time limits of a job allowed ``max_runtime_seconds``."""
    return {
        "soft_time_limit": max_runtime_seconds + TIME_LIMIT_GRACE_SECONDS,
        "time_limit": max_runtime_seconds + 2 * TIME_LIMIT_GRACE_SECONDS,
    }


# What Celery's as_task_v2 puts after a task's args and kwargs when there is no workflow.
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps builds one per call otherwise


def _body(body: tuple[Any, ...]) -> str:
    return base64.b64encode(_ENCODE(list(body)).encode()).decode()
