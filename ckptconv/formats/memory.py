"""How tensors are allocated, so that memory stays bounded by the largest tensor.

Two facts of glibc's allocator decide the peak RSS of a streaming conversion:

- By default, blocks under a *dynamic* threshold (which grows up to 32 MiB as large blocks are
  freed) come from per-thread arenas. A conversion allocates tens-of-MB tensors on a reader
  thread and frees them on another, so the arenas fragment and keep freed memory: on a 3 GB
  checkpoint the peak grew by a further 100-200 MB over a 1 GB one with the same largest tensor.
  :func:`bound_allocator` fixes the threshold, so every block of a tensor's size is its own
  mapping, returned to the system when freed, and RSS no longer depends on the checkpoint's size.
- A fresh mapping is zeroed by the kernel and faulted in page by page, which costs about as much
  as the copy that fills it. :func:`empty_tensor` takes large tensors from :class:`BufferPool`
  (buffers of finished tensors of the same size) and asks Linux for 2 MiB pages on new ones (one
  fault per 2 MiB where transparent huge pages are set to ``madvise``, the common default).
"""

from __future__ import annotations

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
from ckptconv.formats.base import RawTensor, torch_dtype

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# Blocks at least this large are mapped on their own: above LZ4 chunk buffers and read batches
# (about 1 MiB, reused), below any tensor large enough to matter for the peak.
MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # mallopt parameter numbers, from glibc's malloc.h
_MADV_HUGEPAGE = 14

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


class BufferPool:
    """Freed tensor buffers, kept for the next tensor of the same byte size.

    A conversion reads tensors of a few recurring sizes (every layer has the same shapes), and a
    fresh buffer must be zeroed by the kernel before the read fills it: on a 3 GB checkpoint that
    zeroing cost as much as the copy itself. Handing the buffer of a finished tensor to the next
    one of its size skips it. A buffer comes back only when the last tensor or array that uses
    its memory is gone (a finalizer on the numpy view the tensor is built on), so reuse never
    overwrites a live value; at most ``max_idle`` bytes wait in the pool, the rest go back to
    the system, so the pool adds a fixed amount to the peak, not one that grows with the checkpoint.
    """

    def __init__(self, max_idle: int = 128 << 20, min_size: int = MMAP_THRESHOLD) -> None:
        self.max_idle = max_idle
        self.min_size = min_size
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self._caps: list[int] = []  # the caps of the runs in progress (see ``capped``)
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (for tests and benchmarks)

    @property
    def idle_cap(self) -> int:
        """The idle bytes allowed now: ``max_idle``, or less while a run has capped it."""
        with self._lock:
            return min([self.max_idle, *self._caps])

    @contextlib.contextmanager
    def capped(self, nbytes: int) -> Iterator[None]:
        """Keep at most ``nbytes`` idle while the block runs (the smallest cap of the runs in progress).

        A conversion's memory estimate counts twice its largest value: one alive (read ahead or
        being written) and one more. Idle buffers are that one more: with tensors of many sizes a
        pool of ``max_idle`` held up to 128 MiB of buffers of other sizes beside the live ones, over
        the estimate of any checkpoint whose largest tensor is smaller; capped at the largest value,
        the pool stays within it. When the last run in progress ends, the pool is emptied.
        """
        with self._lock:
            self._caps.append(max(0, nbytes))
            self._trim(min([self.max_idle, *self._caps]))
        try:
            yield
        finally:
            with self._lock:
                self._caps.remove(max(0, nbytes))
                if not self._caps:
                    # The last run ended: what follows (its commit, a worker waiting for its next
                    # job) has no use for its buffers.
                    self._trim(0)

    def tensor(self, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """An uninitialized C-contiguous CPU tensor."""
        import torch

        tdtype = torch_dtype(dtype)
        nbytes = math.prod(shape) * tdtype.itemsize
        if nbytes < self.min_size:
            return torch.empty(shape, dtype=tdtype)
        return torch.from_numpy(self.array(nbytes)).view(tdtype).view(shape)

    def array(self, nbytes: int) -> np.ndarray:
        """An uninitialized 1-D uint8 array of ``nbytes``: large ones from the pool, given back
        when the last array or tensor over its memory is gone."""
        if nbytes < self.min_size:
            return np.empty(nbytes, dtype=np.uint8)
        buf = self._take(nbytes)
        if buf is None:
            buf = np.empty(nbytes, dtype=np.uint8)
            advise_huge_pages(buf.ctypes.data, nbytes)
        lease = buf[:]  # the object the tensor keeps alive; its end returns ``buf``
        weakref.finalize(lease, self._give_back, buf)
        return lease

    def _take(self, nbytes: int) -> np.ndarray | None:
        with self._lock:
            free = self._idle.get(nbytes)
            if not free:
                return None
            self._idle_bytes -= nbytes
            self.reused += 1
            return free.pop()

    def _give_back(self, buf: np.ndarray) -> None:
        n = buf.nbytes
        with self._lock:
            cap = min([self.max_idle, *self._caps])
            # Room is made by dropping buffers of other sizes: the size just freed is the likeliest
            # to be asked for next (the next layer's same tensor).
            self._trim(cap - n, keep=n)
            if self._idle_bytes + n <= cap:
                self._idle.setdefault(n, []).append(buf)
                self._idle_bytes += n

    def _trim(self, room: int, keep: int | None = None) -> None:
        """Drop idle buffers (of sizes other than ``keep``) until at most ``room`` bytes stay idle."""
        for size in list(self._idle):
            if self._idle_bytes <= room:
                break
            if size != keep:
                self._idle_bytes -= size * len(self._idle.pop(size))

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes


POOL = BufferPool()


def empty_tensor(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """An uninitialized CPU tensor for a reader to fill: large ones come from :data:`POOL`."""
    return POOL.tensor(tuple(shape), dtype)


def empty_raw(shape: tuple[int, ...], dtype: str) -> RawTensor:
    """:func:`empty_tensor` without torch: the tensor's bytes, for a reader to fill."""
    shape = tuple(shape)
    return RawTensor(POOL.array(math.prod(shape) * dtype_size(dtype)), dtype, shape)
