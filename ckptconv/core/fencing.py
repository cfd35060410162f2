"""The attempt a job's code runs as, and the fence that stops a stale attempt from acting.

A job may run more than once (its worker was lost, or stalled long enough to lose its lease, and
another worker took over). Each run is an *attempt* with a number that only grows; the job record
in Redis holds the current one. Everything an attempt does that others can see is fenced by that
number:

- state changes and progress compare it atomically in Redis (``ckptconv.core.jobstore``);
- staging paths contain it (``<parent>/.ckptconv-staging/<job>/<attempt>/``), so two attempts never
  write or delete the same staged file;
- publication calls :func:`fence` before moving each file and before the manifest: an attempt that
  is no longer current stops with :class:`~ckptconv.core.errors.LeaseLost` instead of publishing.

The worker opens an :func:`attempt_scope` around a job's handler; the engine reads it with
:func:`current_attempt` (the CLI runs outside any scope: no fencing, staging keyed by job alone).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Attempt:
    job_id: str
    number: int
    # Raises LeaseLost when this attempt is no longer the job's current one (reads Redis).
    check: Callable[[], None]


_current: contextvars.ContextVar[Attempt | None] = contextvars.ContextVar("ckptconv_attempt", default=None)


@contextlib.contextmanager
def attempt_scope(attempt: Attempt) -> Iterator[Attempt]:
    token = _current.set(attempt)
    try:
        yield attempt
    finally:
        _current.reset(token)


def current_attempt(job_id: str | None = None) -> Attempt | None:
    """The attempt in scope (of ``job_id``, when given), or None."""
    attempt = _current.get()
    if attempt is None or (job_id is not None and attempt.job_id != job_id):
        return None
    return attempt


def fence(job_id: str | None = None) -> None:
    """Raise LeaseLost if the attempt in scope is no longer current; nothing outside a scope."""
    attempt = current_attempt(job_id)
    if attempt is not None:
        attempt.check()
