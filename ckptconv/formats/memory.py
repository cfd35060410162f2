"""How tensors are allocated, so that memory stays bounded by the largest tensor.

Two facts of glibc's allocator decide the peak RSS of a streaming conversion:

- By default, blocks under a *dynamic* threshold (which grows up to 32 MiB as large blocks are
  freed) come from per-thread arenas. A conversion allocates tens-of-MB tensors on a reader
  thread and frees them on another, so the arenas fragment and keep freed memory: on a 3 GB
  checkpoint the peak grew by a further 100-200 MB over a 1 GB one with the same largest tensor.
  :func:`bound_allocator` fixes the threshold, so every block of a tensor's size is its own
  mapping, returned to the system when freed, and RSS no longer depends on the checkpoint's size.
- A fresh mapping is zeroed by the kernel and faulted in page by page, which costs about as much
  as the copy that fills it. :func:`empty_tensor` places large tensors in :class:`BufferPool`'s
  buffers (those of finished tensors, of any size that fits) and asks Linux for 2 MiB pages on
  new ones (one fault per 2 MiB where transparent huge pages are set to ``madvise``, the common
  default).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import logging
import math
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptconv.core.dtypes import dtype_size
from ckptconv.core.errors import OutOfMemory
from ckptconv.formats.base import RawTensor, torch_dtype
from ckptconv.storage.direct_io import ALIGN
from ckptconv.storage.direct_reads import DIRECT_READ_BYTES

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# Blocks at least this large are mapped on their own: above LZ4 chunk buffers and read batches
# (about 1 MiB, reused), below any tensor large enough to matter for the peak.
MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # mallopt parameter numbers, from glibc's malloc.h
_MADV_HUGEPAGE = 14
# Where ranges lent from one buffer start: a cache line, as torch aligns its own allocations.
_ALIGN = 64
# The block size of direct reads, which a buffer in phase with its file offset is aligned to.
PHASE_ALIGN = ALIGN

_libc: Any = None


def _c_library() -> Any:
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                _libc = ctypes.CDLL(None, use_errno=True)
                _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            except (OSError, AttributeError):
                _libc = False
    return _libc


def bound_allocator(threshold: int = MMAP_THRESHOLD) -> bool:
    """Map blocks of ``threshold`` bytes or more on their own (glibc); True when it took effect.

    Called once at the start of a process that converts (the CLI, a worker), before its threads.
    """
    libc = _c_library()
    if not libc or not hasattr(libc, "mallopt"):
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused; the allocator keeps its defaults")
    return ok


def advise_huge_pages(address: int, length: int) -> None:
    """Ask Linux for 2 MiB pages over the aligned part of a fresh buffer (a no-op elsewhere)."""
    libc = _c_library()
    if not libc:
        return
    start = (address + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (address + length) & ~(HUGE_PAGE - 1)
    if end - start >= HUGE_PAGE:
        libc.madvise(start, end - start, _MADV_HUGEPAGE)


class _Block:
    """A buffer and the ranges of it lent out, sorted by start."""

    __slots__ = ("buf", "era", "held", "lent", "size")

    def __init__(self, buf: np.ndarray, era: int) -> None:
        self.buf = buf
        self.era = era  # the pool's era it was allocated in (see ``BufferPool._era``)
        self.size = buf.nbytes
        self.lent: list[tuple[int, int]] = []
        self.held = False  # counted in the pool's ``held_bytes`` (placed in unless retired)

    def gap(self, nbytes: int) -> tuple[int, int] | None:
        """(size, start) of the smallest free range that fits ``nbytes``, or None."""
        best = None
        at = 0
        for start, end in [*self.lent, (self.size, self.size)]:
            if start - at >= nbytes and (best is None or start - at < best[0]):
                best = (start - at, at)
            at = -(-end // _ALIGN) * _ALIGN
        return best


class BufferPool:
    """Buffers of finished tensors, carved for the next ones, within a fixed number of bytes.

    A fresh buffer must be zeroed by the kernel before the read fills it: on a 3 GB checkpoint
    that cost as much as the copy itself. The pool keeps the buffers of finished tensors and lends
    ranges of them to the next ones: the smallest free range that fits, so a buffer of one size
    serves the next tensor of that size whole, and a larger one (an embedding's) several smaller
    tensors side by side. A range is lent again only when the last tensor or array over it is gone
    (a finalizer on the numpy array the tensor is built on), so a lent range never overlaps a live
    value.

    Memory: the pool holds at most ``held_cap`` bytes of buffers, counted whole whether idle or
    partly lent, so what it keeps resident beyond the live tensors themselves (idle buffers, the
    free ends and holes of partly lent ones) stays within the cap however the sizes come. A
    buffer that does not fit goes back to the system when its tensor is gone; one that is held
    takes the place of smaller idle ones (a larger buffer serves more sizes). A smaller cap (a
    run with a smaller largest value starting, the last run ending) drops idle buffers at once
    and retires partly lent ones: nothing is placed in them again, and they stay counted until
    their last range comes back.
    """

    def __init__(self, max_held: int = 128 << 20, min_size: int = MMAP_THRESHOLD) -> None:
        self.max_held = max_held
        self.min_size = min_size
        self._blocks: list[_Block] = []  # the buffers held that tensors are placed in (not retired)
        self._held_bytes = 0
        self._lent_bytes = 0  # of the held buffers' bytes, those lent to live tensors
        self._caps: list[int] = []  # the caps of the runs in progress (see ``capped``)
        self._lock = threading.Lock()
        # Ranges whose tensors are gone, waiting for the lock: a finalizer may run on any thread,
        # including one inside the pool's own lock (a garbage collection it triggered).
        self._returned: collections.deque[tuple[_Block, int]] = collections.deque()
        self.reused = 0  # tensors placed in held buffers (for tests and benchmarks)
        self.fresh_bytes = 0  # bytes of the buffers allocated anew (idem)
        # How many times the last run in progress ended (or the pool was cleared): a buffer
        # allocated before and given back after is not held, the pool was emptied for what follows.
        self._era = 0

    @property
    def held_cap(self) -> int:
        """The bytes the pool may hold now: ``max_held``, or less while a run has capped it."""
        with self._lock:
            return self._cap()

    def _cap(self) -> int:
        return min([self.max_held, *self._caps])

    @contextlib.contextmanager
    def capped(self, nbytes: int) -> Iterator[None]:
        """Hold at most ``nbytes`` (and one block, :data:`PHASE_ALIGN`) while the block runs (the
        smallest cap of the runs in progress).

        A conversion's memory estimate (``Plan.memory``) counts the pool's buffers as one largest
        value beside those alive (read ahead, being transformed or written): with tensors of many
        sizes a pool of ``max_held`` held up to 128 MiB of buffers of other sizes beside the live
        ones, over the estimate of any checkpoint whose largest tensor is smaller; capped at the
        largest value, the pool stays within it. When the last run in progress ends, the pool is
        emptied.
        """
        # A value allocated in phase with its file offset takes a block more (see ``array``): the
        # largest one's buffer must still fit.
        cap = max(0, nbytes) + PHASE_ALIGN
        with self._lock:
            self._caps.append(cap)
            self._trim(self._cap())
        self._drain()
        try:
            yield
        finally:
            with self._lock:
                self._caps.remove(cap)
                if not self._caps:
                    # The last run ended: what follows (its commit, a worker waiting for its next
                    # job) has no use for its buffers.
                    self._trim(0)
                    self._era += 1
            self._drain()

    def tensor(self, shape: tuple[int, ...], dtype: str, *, phase: int | None = None) -> torch.Tensor:
        """An uninitialized C-contiguous CPU tensor (``phase``: see :meth:`array`)."""
        import torch

        tdtype = torch_dtype(dtype)
        nbytes = math.prod(shape) * tdtype.itemsize
        if nbytes < self.min_size and (phase is None or nbytes < DIRECT_READ_BYTES):
            return torch.empty(shape, dtype=tdtype)
        return torch.from_numpy(self.array(nbytes, phase=phase)).view(tdtype).view(shape)

    def array(self, nbytes: int, *, phase: int | None = None) -> np.ndarray:
        """An uninitialized 1-D uint8 array of ``nbytes``: large ones from the pool, their range
        given back when the last array or tensor over its memory is gone. With ``phase``, a large
        one starts at an address equal to ``phase`` modulo :data:`PHASE_ALIGN` (a buffer in phase
        with the file offset it is read from: ckptconv.storage.direct_reads)."""
        if nbytes < self.min_size:
            if phase is None or nbytes < DIRECT_READ_BYTES:  # too small to be read direct
                return np.empty(nbytes, dtype=np.uint8)
            spare = np.empty(nbytes + PHASE_ALIGN, dtype=np.uint8)
            at = _shift_into_phase(spare.ctypes.data, phase)
            return spare[at : at + nbytes]
        # Room to move the start into phase, lent and given back with the range.
        room = nbytes + (PHASE_ALIGN if phase is not None else 0)
        with self._lock:
            block, start = self._place(room)
        self._drain()
        if block is None:
            block = _Block(_allocate(room), self._era)
            advise_huge_pages(block.buf.ctypes.data, room)
            block.lent.append((0, room))
        at = start + (_shift_into_phase(block.buf.ctypes.data + start, phase) if phase is not None else 0)
        # The array the tensor keeps alive, whose end gives the range back. Built on a memoryview,
        # not as a slice of the buffer: numpy makes a slice of a slice a view of the buffer itself,
        # so a view of the tensor's array would not keep that array, and its range, alive.
        lease = np.frombuffer(memoryview(block.buf)[at : at + nbytes], dtype=np.uint8)
        weakref.finalize(lease, self._give_back, block, start)
        return lease

    def _place(self, nbytes: int) -> tuple[_Block | None, int]:
        """The held buffer and offset of the smallest free range that fits ``nbytes``, lent; or
        (None, 0) and the caller allocates."""
        best: tuple[int, int, _Block] | None = None
        for block in self._blocks:
            gap = block.gap(nbytes)
            if gap is not None and (best is None or gap[0] < best[0]):
                best = (*gap, block)
        if best is None:
            self.fresh_bytes += nbytes
            return None, 0
        _, start, block = best
        bisect.insort(block.lent, (start, start + nbytes))
        self._lent_bytes += nbytes
        self.reused += 1
        return block, start

    def _give_back(self, block: _Block, start: int) -> None:
        self._returned.append((block, start))
        self._drain()

    def _drain(self) -> None:
        """Take back the ranges whose tensors are gone. Whoever holds the lock when one is
        returned calls this after letting it go, so none waits past that."""
        while self._returned:
            if not self._lock.acquire(blocking=False):
                return
            try:
                while self._returned:
                    self._take_back(*self._returned.popleft())
            finally:
                self._lock.release()

    def _take_back(self, block: _Block, start: int) -> None:
        i = bisect.bisect_left(block.lent, (start, -1))
        _, end = block.lent.pop(i)
        if not block.held:
            if not block.lent and block.era == self._era:
                self._hold(block)
            return
        self._lent_bytes -= end - start
        if not block.lent and block not in self._blocks:
            # Retired by a smaller cap: it leaves the pool now that nothing uses it.
            block.held = False
            self._held_bytes -= block.size

    def _hold(self, block: _Block) -> None:
        """Hold a buffer no tensor uses any more, if the cap has room for it once idle buffers
        smaller than it make way; otherwise it goes back to the system with its last reference."""
        over = self._held_bytes + block.size - self._cap()
        if over > 0:
            smaller = sorted((b for b in self._blocks if not b.lent and b.size < block.size), key=lambda b: b.size)
            if sum(b.size for b in smaller) < over:
                return
            for b in smaller:
                if over <= 0:
                    break
                self._drop(b)
                over -= b.size
        block.held = True
        self._blocks.append(block)
        self._held_bytes += block.size

    def _drop(self, block: _Block) -> None:
        """Stop placing tensors in ``block``. An idle one leaves the pool and goes back to the
        system; a partly lent one is retired: it stays counted (its free ranges are resident) until
        its last range comes back, and then goes."""
        self._blocks.remove(block)
        if not block.lent:
            block.held = False
            self._held_bytes -= block.size

    def _trim(self, room: int) -> None:
        """Place tensors in at most ``room`` bytes of buffers, and hold no more than that once the
        partly lent ones have come back: idle buffers go first, then partly lent ones retire."""
        placeable = sum(b.size for b in self._blocks)
        for block in sorted(self._blocks, key=lambda b: (bool(b.lent), b.size)):
            if self._held_bytes <= room or placeable <= room:
                break
            self._drop(block)
            placeable -= block.size

    def clear(self) -> None:
        with self._lock:
            self._trim(0)
            self._era += 1
        self._drain()

    @property
    def held_bytes(self) -> int:
        """The bytes of the buffers held, idle or partly lent (at most ``held_cap``)."""
        return self._held_bytes

    @property
    def idle_bytes(self) -> int:
        """The bytes of the held buffers that no live tensor uses."""
        return self._held_bytes - self._lent_bytes


POOL = BufferPool()


def _allocate(nbytes: int) -> np.ndarray:
    """A new uninitialized buffer; a size the process cannot have (a shape declared far beyond
    what the file holds, or a tensor larger than the machine's memory) is a typed error."""
    try:
        return np.empty(nbytes, dtype=np.uint8)
    except MemoryError:
        raise OutOfMemory(f"no memory for a value of {nbytes:,} bytes: the allocation failed") from None


def empty_tensor(shape: tuple[int, ...], dtype: str, *, phase: int | None = None) -> torch.Tensor:
    """An uninitialized CPU tensor for a reader to fill: large ones come from :data:`POOL`, in
    ``phase`` with the file offset it is read from when given (see :meth:`BufferPool.array`)."""
    return POOL.tensor(tuple(shape), dtype, phase=_aligned_phase(phase, dtype))


def empty_raw(shape: tuple[int, ...], dtype: str, *, phase: int | None = None) -> RawTensor:
    """:func:`empty_tensor` without torch: the tensor's bytes, for a reader to fill."""
    shape = tuple(shape)
    return RawTensor(POOL.array(math.prod(shape) * dtype_size(dtype), phase=_aligned_phase(phase, dtype)), dtype, shape)


def _shift_into_phase(address: int, phase: int) -> int:
    """The bytes to skip from ``address`` to the first address equal to ``phase`` modulo a block."""
    return (phase - address) % PHASE_ALIGN


def _aligned_phase(phase: int | None, dtype: str) -> int | None:
    """``phase``, unless a buffer there would not be aligned to the dtype's element (bytes stored
    at an odd offset): such a value is read through the page cache into an aligned buffer, as
    the kernels that compute on it expect."""
    return phase if phase is not None and phase % dtype_size(dtype) == 0 else None
