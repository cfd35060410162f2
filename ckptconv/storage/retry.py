"""The one retry policy of every storage call: an attempt budget and capped exponential backoff
with full jitter.

Object stores fail transiently (500/503, throttling, connections reset mid-body, stalled
responses). Each storage call is retried as a whole here, never inside the HTTP client, so that
every call (requests and the reading of their bodies alike) gets the same budget. What counts as
transient is the backend's business: it passes a ``transient`` predicate. Past the budget the
last error propagates and the backend types it (``storage_error``).

Settings (environment, read when a backend is built):

- ``CKPTCONV_STORAGE_ATTEMPTS`` (default 8; ``AWS_MAX_ATTEMPTS`` is honoured when this is unset):
  tries per call, the first included;
- ``CKPTCONV_STORAGE_BACKOFF_S`` (default 0.1): the first retry waits up to this long, each
  further retry up to twice as long as the previous one ...
- ``CKPTCONV_STORAGE_BACKOFF_MAX_S`` (default 5): ... but never more than this.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# The least number of tries of the calls made in a ``persistent`` block, whatever the budget.
_floor: contextvars.ContextVar[int] = contextvars.ContextVar("ckptconv_retry_floor", default=1)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 8
    backoff_s: float = 0.1
    backoff_max_s: float = 5.0

    @classmethod
    def from_env(cls, attempts: int | None = None) -> RetryPolicy:
        env = os.environ
        if attempts is None:
            text = env.get("CKPTCONV_STORAGE_ATTEMPTS") or env.get("AWS_MAX_ATTEMPTS")
            attempts = int(text) if text else cls.attempts
        return cls(
            attempts=max(1, attempts),
            backoff_s=float(env.get("CKPTCONV_STORAGE_BACKOFF_S", cls.backoff_s)),
            backoff_max_s=float(env.get("CKPTCONV_STORAGE_BACKOFF_MAX_S", cls.backoff_max_s)),
        )

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure: full jitter, so that many clients
        failing together (a store restarting) do not come back in lockstep."""
        return random.uniform(0.0, min(self.backoff_max_s, self.backoff_s * (1 << min(failures - 1, 30))))

    def run(self, call: Callable[[], T], *, transient: Callable[[BaseException], bool], what: str) -> T:
        """``call()`` until it returns, raises a non-transient error, or the budget is spent.

        ``call`` may keep state between tries (a ranged read resumes where the broken one stopped).
        """
        failures = 0
        while True:
            try:
                return call()
            except Exception as e:
                if not transient(e):
                    raise
                failures += 1
                if failures >= max(self.attempts, _floor.get()):
                    log.warning("%s: giving up after %d attempts: %s", what, failures, e)
                    raise
                wait = self.delay(failures)
                log.info("%s: attempt %d failed (%s: %s); retrying in %.2fs", what, failures, type(e).__name__, e, wait)
                time.sleep(wait)


@contextlib.contextmanager
def persistent(attempts: int = RetryPolicy.attempts) -> Iterator[None]:
    """Storage calls made in this block (on this thread) try at least ``attempts`` times.

    For the cleanup after a job failed on storage errors: its staging objects and multipart uploads
    must not stay behind because the store was failing at the job's own, smaller budget."""
    token = _floor.set(attempts)
    try:
        yield
    finally:
        _floor.reset(token)
