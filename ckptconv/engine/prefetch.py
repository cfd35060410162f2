"""Reading source values ahead of the executor, on several threads, within a byte budget.

The executor consumes source values one at a time, in the order the plan first uses them. Reading
them one after the other leaves the store idle while a value is transformed and written, and one
request at a time is far below what object storage serves (a value of a few MB is one ranged GET;
its latency, not the bandwidth, sets the pace). The :class:`Prefetcher` reads up to ``workers``
values at once, in first-use order, and hands them over in that order.

Memory: a worker claims a value's bytes before reading it; claims stop while the claimed bytes
not yet released by the consumer would exceed ``budget``. Two exceptions keep it from deadlocking,
both bounded: a value larger than the budget is read alone (nothing else claimed), and the value
the consumer is waiting for is always read (it may hold several inputs of one step, a fused QKV,
that together exceed the budget). Values alive at once are thus at most ``max(budget, largest)``
plus what the consumer holds.

Neighbours: where the source's storage reads neighbouring byte ranges of a file as one request
(``Storage.coalesce_bytes``: object storage, where a request costs as much as a megabyte of its
body), a worker claims with the next value the ones after it in the order that follow it in the
same file (``TensorSource.extent``), while together they stay below that size and within the
budget, and reads them together (``TensorSource.read_neighbours``), each into its own memory. When
that read fails they are read again one by one: the error is the one of the value it is about, as
without joins, and the values before it are handed over.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ckptconv.formats.base import TensorSource

OnRead = Callable[[str, Any], None]


class Prefetcher:
    """Reads ``keys`` from ``source`` on ``workers`` threads; ``get`` returns them in order.

    ``on_read(key, value)`` runs on the reading thread right after each read (hashing as read).
    The source's ``read`` must be safe to call from ``workers`` threads at once.
    """

    def __init__(
        self,
        source: TensorSource,
        keys: list[str],
        sizes: dict[str, int],
        budget: int,
        *,
        workers: int = 1,
        on_read: OnRead | None = None,
    ) -> None:
        self.source = source
        self.keys = keys
        self.sizes = sizes
        self.budget = budget
        self.on_read = on_read
        # Where each value lies, for reading neighbours together; None where the storage reads
        # every range on its own.
        self._join_below = source.storage.coalesce_bytes
        self._extents = [source.extent(k) for k in keys] if self._join_below else None
        self.outstanding = 0  # bytes claimed by workers and not yet released by the consumer
        self.peak_outstanding = 0
        self._claimed = 0  # keys handed to workers so far (claims go in order)
        self._asked = 0  # keys the consumer has asked for
        self._results: dict[int, tuple[Any, BaseException | None]] = {}
        self._stopped = False
        self._failed = False
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._run, name=f"ckptconv-prefetch-{i}", daemon=True)
            for i in range(max(1, min(workers, len(keys))))
        ]
        try:
            for t in self._threads:
                t.start()
        except BaseException:
            self.stop()  # no thread left reading for a Prefetcher its caller never got
            raise

    def _claim(self) -> list[int] | None:
        """The indices of the next keys to read together (one, or neighbours in one file), once
        the budget allows them; None when done."""
        with self._cond:
            while True:
                if self._stopped or self._failed or self._claimed >= len(self.keys):
                    return None
                i = self._claimed
                if self.outstanding == 0 or self._allows(i):
                    claimed = [i]
                    together = self._take(i)
                    while self._joins(claimed[-1], together) and self._allows(self._claimed):
                        claimed.append(self._claimed)
                        together += self._take(self._claimed)
                    return claimed
                self._cond.wait()

    def _take(self, i: int) -> int:
        """Claim key ``i``, the next in order: its bytes (returned) join the outstanding ones."""
        size = self.sizes.get(self.keys[i], 0)
        self._claimed = i + 1
        self.outstanding += size
        self.peak_outstanding = max(self.peak_outstanding, self.outstanding)
        return size

    def _allows(self, i: int) -> bool:
        """Key ``i`` may be claimed now: its bytes fit in the budget, or the consumer waits for it."""
        return self.outstanding + self.sizes.get(self.keys[i], 0) <= self.budget or self._asked > i

    def _joins(self, last: int, together: int) -> bool:
        """The key after ``last`` follows it in the same file, and with the ``together`` bytes
        claimed with it stays below the size the storage reads as one request."""
        j = last + 1
        if self._extents is None or j >= len(self.keys):
            return False
        before, after = self._extents[last], self._extents[j]
        if before is None or after is None or after.uri != before.uri or after.offset != before.offset + before.nbytes:
            return False
        return together + after.nbytes < self._join_below

    def _run(self) -> None:
        while (claimed := self._claim()) is not None:
            read = self._read([self.keys[i] for i in claimed])
            with self._cond:
                if self._stopped:
                    return
                self._results.update(zip(claimed, read, strict=True))
                self._failed = self._failed or any(error is not None for _, error in read)
                self._cond.notify_all()
            # Held here, values the consumer released would stay alive while this thread waits.
            read = []

    def _read(self, keys: list[str]) -> list[tuple[Any, BaseException | None]]:
        """(value, error) of each key: neighbours together, one by one when that fails, so that
        an error is raised for the value it is about and the values before it are handed over."""
        if len(keys) > 1:
            try:
                values = self.source.read_neighbours(keys)
                if len(values) == len(keys):  # otherwise a broken source: read again one by one
                    for key, value in zip(keys, values, strict=True):
                        self._on_read(key, value)
                    return [(value, None) for value in values]
            except Exception:  # read again one by one, below
                pass
            except BaseException as e:  # not a failed read: nothing to read again
                return [(None, e)] * len(keys)
        read: list[tuple[Any, BaseException | None]] = []
        for key in keys:
            try:
                value = self.source.read(key)
                self._on_read(key, value)
                read.append((value, None))
            except BaseException as e:  # handed to the consumer, which re-raises it
                read += [(None, e)] * (len(keys) - len(read))
                break
        return read

    def _on_read(self, key: str, value: Any) -> None:
        if self.on_read is not None:
            self.on_read(key, value)

    def get(self, expected: str) -> Any:
        """The next value in order, which must be ``expected``'s; re-raises its read's error."""
        with self._cond:
            i = self._asked
            self._asked += 1
            self._cond.notify_all()
            while i not in self._results:
                self._cond.wait()
            value, err = self._results.pop(i)
        if err is not None:
            raise err
        if self.keys[i] != expected:  # the consumer and the readers walk the same list; anything else is a bug
            raise RuntimeError(f"prefetch order broken: expected {expected!r}, got {self.keys[i]!r}")
        return value

    def release(self, key: str) -> None:
        """The consumer no longer holds ``key``'s value: its bytes leave the budget."""
        with self._cond:
            self.outstanding -= self.sizes.get(key, 0)
            self._cond.notify_all()

    def stop(self) -> None:
        """Stop reading; values read but not taken are dropped. Waits for reads in progress."""
        with self._cond:
            self._stopped = True
            self._results.clear()
            self._cond.notify_all()
        for t in self._threads:
            if t.ident is not None:  # started
                t.join()
