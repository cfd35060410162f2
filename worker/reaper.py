"""The reaper: no job stays non-final without a live owner or a queued message.

The broker re-delivers a message whose worker died (kombu's visibility timeout), and the heartbeat
re-takes a lease that lapsed while nobody else wanted it. What neither covers: a message that was
acknowledged or deleted while its job was not final (a duplicate delivery acknowledged while the
holder later died, a message dropped by a broker restart without persistence, an operator's purge).
The reaper finds those jobs and queues their message again; past ``max_attempts``, the worker that
receives it fails the job with ``worker_lost`` (the same path as a job whose workers keep dying).

Where it runs: in every worker's main process, as a daemon thread started when the worker is
ready (no Celery beat to deploy). One pass every ``reaper_interval_seconds``; a Redis lock lets one
worker at a time make a pass. A job is acted on only when two passes in a row found it orphaned
(no lease, no unacknowledged or queued message, no change for a lease plus a visibility timeout),
which leaves a message in flight between the queue and the unacknowledged index alone. Acting is
itself fenced: the requeue script re-checks, atomically, that the job is in the same attempt and
has no lease.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

from ckptconv.core.job_records import now_ms
from ckptconv.core.jobstore import JobStore

log = logging.getLogger("ckptconv.reaper")


class Reaper:
    def __init__(self, store: JobStore, settings: Any) -> None:
        self.store = store
        self.settings = settings
        self.interval = settings.reaper_interval_seconds
        self.quiet_ms = int((settings.lease_seconds + settings.visibility_timeout_seconds) * 1000)
        self.token = uuid.uuid4().hex
        self.suspects: dict[str, str] = {}  # job id -> attempts, found orphaned by the previous pass
        self.stop = threading.Event()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._loop, name="ckptconv-reaper", daemon=True)
        thread.start()
        return thread

    def _loop(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.run_once()
            except Exception as e:  # Redis away: try again next time
                log.warning("reaper pass failed: %s", e)

    def run_once(self) -> dict[str, list[str]]:
        """One pass (if this worker gets the lock); returns what it did, by action."""
        done: dict[str, list[str]] = {"requeued": []}
        lock = self.store.keys.p + "reaper"
        if not self.store.r.set(lock, self.token, nx=True, px=int(self.interval * 900)):
            return done
        queues = (self.settings.jobs_queue,)
        orphans = self.store.orphans(quiet_ms=self.quiet_ms, queues=queues, now=now_ms())
        confirmed = {j: a for j, a in orphans.items() if self.suspects.get(j) == a}
        self.suspects = orphans
        for job_id, attempts in confirmed.items():
            # Past the attempt budget too: the worker that receives the message fails the job with
            # worker_lost, removing its staging, mirroring the record and sending the webhook.
            if self.store.requeue(job_id, attempts, self.settings.jobs_queue):
                log.warning("job %s: no owner and no message; queued again (after attempt %s)", job_id, attempts)
                done["requeued"].append(job_id)
            self.suspects.pop(job_id, None)
        return done
