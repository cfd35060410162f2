"""How a job's parts are handed out: the protocol the worker implements, and the in-process runner."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any, Protocol


class PartRunner(Protocol):
    """How a job's parts are handed out: by the worker (part tasks on the queue, leases in Redis),
    or :class:`InlineRunner` (every part in this process, one after another)."""

    # Seconds a dispatched part may stay unclaimed before the job's own worker runs it itself.
    grace_seconds: float

    def for_attempt(self, attempt: int) -> PartRunner:
        """The runner of another attempt of the same job (a takeover stops that attempt's parts)."""

    def dispatch(self, count: int) -> None:
        """Queue one task for each of parts ``0 .. count - 1``."""

    def claim(self, index: int) -> contextlib.AbstractContextManager[bool]:
        """Hold part ``index`` while it runs (yields False when another process holds it)."""

    def held(self, indexes: Collection[int]) -> set[int]:
        """Which of the parts ``indexes`` a live process holds (one question for them all: a worker
        waiting for hundreds of parts asks it every poll)."""

    def report(self, index: int, tensors: int, nbytes: int) -> None:
        """Part ``index`` has written ``tensors`` values and ``nbytes`` bytes so far."""

    def reported(self) -> tuple[int, int]:
        """Values and bytes written by every part so far."""

    def failure(self) -> dict[str, Any] | None:
        """The problem of a part that failed for good (the job fails with it), if any."""

    def stop(self) -> None:
        """Tell the parts still running to stop at their next check."""

    def wait_idle(self, count: int, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until no process holds any of the ``count`` parts."""


class InlineRunner:
    """Every part in this process (the command line, the Python API): same bytes, no parallelism."""

    grace_seconds = 0.0

    def __init__(self) -> None:
        self._progress: dict[int, tuple[int, int]] = {}

    def for_attempt(self, attempt: int) -> InlineRunner:
        return InlineRunner()

    def dispatch(self, count: int) -> None:
        pass

    @contextlib.contextmanager
    def claim(self, index: int) -> Iterator[bool]:
        yield True

    def held(self, indexes: Collection[int]) -> set[int]:
        return set()

    def report(self, index: int, tensors: int, nbytes: int) -> None:
        self._progress[index] = (tensors, nbytes)

    def reported(self) -> tuple[int, int]:
        return sum(t for t, _ in self._progress.values()), sum(b for _, b in self._progress.values())

    def failure(self) -> dict[str, Any] | None:
        return None

    def stop(self) -> None:
        pass

    def wait_idle(self, count: int, timeout: float) -> None:
        pass
