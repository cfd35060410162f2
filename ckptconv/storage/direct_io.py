"""Positioned writes of bulk data that bypass the page cache (``O_DIRECT``), behind the caller.

Why: a value written through the page cache costs the kernel a fresh page for every 4 KiB, a copy
into it, then the writeback that the final ``fsync`` waits for; on a machine whose memory is lent
back and forth with a hypervisor, fresh pages cost several times the copy. Measured on a 3 GB
conversion from S3 to a local cs-h5 file, page cache dropped: 8.1-8.9 s instead of 11.5-12.1 s,
system time 1.4 s instead of 5.1-5.3 s, the final ``fsync`` 0.02 s instead of 0.8 s, and the S3
server beside it got back the CPU it had lost to the kernel (7.1 s instead of 8.9-9.4 s).

How (:class:`DirectWrites`): written bytes are copied into page-aligned staging buffers
(``BATCHES`` of ``BATCH_BYTES``), adjacent writes gathered into one buffer, each byte at the
buffer position that has the alignment of its file offset. ``WRITERS`` background threads write
the full buffers (and the last one, on :meth:`DirectWrites.flush`): their whole ``ALIGN``-byte
blocks with ``O_DIRECT``, the partial blocks at either end (where one value meets the next, or
HDF5's metadata) through the page cache, which the kernel keeps coherent with the direct writes.
Two buffers in flight never share a whole block (each block lies in one buffer's range, or is
partial and goes through the page cache), and a buffer that rewrites bytes of one still in flight
waits for it, so the file ends as if every write had been made in order. The caller goes on
copying the next bytes while the device takes the previous ones; it waits only when every buffer
is in flight, or to rewrite bytes still being written.

Where the filesystem refuses ``O_DIRECT`` (at the open, or ``EINVAL`` at the first write: some
FUSE, network and older tmpfs mounts), every byte goes through the page cache as before.
``CKPTCONV_DIRECT_IO=0`` does the same on purpose.

Failures: a write that failed in the background (a full disk where nothing was reserved, an I/O
error) is raised by the next :meth:`~DirectWrites.write_at`, :meth:`~DirectWrites.flush` or
:meth:`~DirectWrites.close`; a buffer still queued then is not written (one already being written
by the other thread may land). Memory: at most ``BATCHES * BATCH_BYTES`` (48 MiB) per open file,
mapped on its first write and resident only as far as it was filled.

Sizes: 16 MiB buffers, two of them in flight. Against the three 4 MiB ones of the first version,
in alternating pairs of 3 GB conversions on local disk (safetensors -> cs-h5 and back, page cache
dropped), one writer with two 16 MiB buffers converted faster in 14 pairs of 15 (0.4 s on average
in the six pairs of exactly these sizes); 8 MiB buffers were slower, 32 MiB ones no faster, and a
third buffer for the one writer added nothing. A second writer did add: this machine's virtual
disk wrote 3 GB of 16 MiB direct writes in 3.0 s one at a time and in 2.1 s two at a time, and
while 3 GB were read beside them in 5.1-8.2 s against 4.2-4.3 s. The conversions with two writers
took less time in 10 of 12 alternating pairs (safetensors -> cs-h5 and cs-h5 -> safetensors, a
sharded torch archive, the Llama layout cs-2.9 -> hf): up to 1.8 s less. From S3 (3 GB s3 ->
local cs-h5, paced by the S3 server on the same two cores) it made no difference that this
machine's noise would show: in seven alternating pairs the change was faster in three, medians
13.7 s against 13.0 s before it, s5cmd's download 11.3 s.

The copy into a staging buffer releases the GIL (:func:`copy_bytes`), so the thread hashing the
same bytes (ckptconv.formats.sharding) runs beside it instead of after it. Measured with py-spy, a
3 GB cs-2.9 -> hf conversion's main thread spent more time waiting for that hash than anything
else; with the copy released, the conversions were faster in 5 of 8 alternating pairs (3 of 3
cs-h5 -> safetensors, by 0.25-1.1 s), within this machine's noise of about a second otherwise.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
import weakref

ALIGN = 4096  # file offsets, lengths and buffer addresses of direct writes (any block size up to 4 KiB)
BATCH_BYTES = 16 << 20
WRITERS = 2  # direct writes in flight per file (see Sizes above)
BATCHES = WRITERS + 1  # one filled by the caller while the others are written


def direct_io_enabled() -> bool:
    return os.environ.get("CKPTCONV_DIRECT_IO", "1").strip().lower() not in ("0", "false", "no", "off")


def staging_bytes() -> int:
    """What the staging buffers of a file being filled hold once they have all been used (a
    conversion's memory estimate counts them for a local output), none without direct writes."""
    return BATCHES * BATCH_BYTES if direct_io_enabled() else 0


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` until every byte of ``data`` is at ``offset`` onwards."""
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


# Copies at least this large are made without the GIL (see :func:`copy_bytes`).
GIL_FREE_COPY_BYTES = 64 << 10


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``; a large copy releases the GIL while it runs (numpy's does, a memoryview
    assignment's does not). The bytes copied into a staging buffer are hashed at the same time on
    another thread (ckptconv.formats.sharding), which would otherwise wait for the GIL until the
    copy ends, then hash while this thread waits for it: the copy and the hash one after the other."""
    if src.nbytes < GIL_FREE_COPY_BYTES or not (src.c_contiguous and dst.c_contiguous):
        dst[:] = src
        return
    import numpy as np  # here, not above: processes that write no values never load numpy

    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


class _Batch:
    """A staging buffer holding the file's bytes ``[start, start + filled)`` from position
    ``start % ALIGN`` on."""

    __slots__ = ("buf", "filled", "start", "view")

    def __init__(self) -> None:
        self.buf = mmap.mmap(-1, BATCH_BYTES)  # anonymous maps are page-aligned
        self.view = memoryview(self.buf)
        self.start = 0
        self.filled = 0

    @property
    def head(self) -> int:
        return self.start % ALIGN

    @property
    def end(self) -> int:
        return self.start + self.filled

    @property
    def room(self) -> int:
        return BATCH_BYTES - self.head - self.filled


class _Writer:
    """The background side of :class:`DirectWrites`: the staging buffers, the threads that write
    them, and the first failure. Apart from its front, so that a front dropped without ``close``
    is collected and its finalizer stops the threads (which refer only to this)."""

    def __init__(self, fd: int, dfd: int) -> None:
        self.fd = fd
        self.dfd = dfd
        # Set once the filesystem refused a direct write (EINVAL): every byte goes through ``fd``
        # from then on. ``dfd`` stays open until :meth:`stop`, so that a write of the other
        # thread still using it never meets its number reused by another file.
        self.refused = False
        self.direct_bytes = 0
        self.failure: BaseException | None = None
        self.free: list[_Batch] = []
        self.made = 0
        self.in_flight: list[_Batch] = []
        self.cond = threading.Condition()
        self.todo: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []

    @property
    def direct(self) -> bool:
        return self.dfd >= 0 and not self.refused

    def take(self, start: int) -> _Batch:
        """A free staging buffer for bytes from ``start`` on (waits while all are in flight)."""
        with self.cond:
            while not self.free and self.made >= BATCHES:
                self.cond.wait()
            batch = self.free.pop() if self.free else None
            if batch is None:
                self.made += 1
        batch = batch or _Batch()
        batch.start, batch.filled = start, 0
        return batch

    def submit(self, batch: _Batch) -> None:
        """Queue ``batch`` for a writing thread. Batches in flight together are written in any
        order, so one that rewrites bytes of another still in flight waits for it first (the
        later write must win, as it would in order)."""
        with self.cond:
            while any(b.start < batch.end and batch.start < b.end for b in self.in_flight):
                self.cond.wait()
            self.in_flight.append(batch)
        if not self.threads:
            for _ in range(WRITERS):
                t = threading.Thread(target=self._run, name="ckptconv-direct-writes", daemon=True)
                t.start()
                self.threads.append(t)
        self.todo.put(batch)

    def wait(self) -> None:
        with self.cond:
            while self.in_flight:
                self.cond.wait()

    def stop(self, *, drop: bool) -> None:
        """End the threads (after writing what is queued, unless ``drop``); close the direct
        descriptor. The buffers are unmapped once nothing refers to them (a kept failure's
        traceback may, for a while)."""
        if drop:
            with self.cond:
                self.failure = self.failure or _Dropped()
        threads, self.threads = self.threads, []
        for _ in threads:
            self.todo.put(None)
        for t in threads:
            t.join()  # never the current thread: on a writer thread, _stop_dropped calls this from another
        self.free.clear()
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1
        self.fd = -1  # never the caller's descriptor again, whatever number it gets next

    def _run(self) -> None:
        while (batch := self.todo.get()) is not None:
            try:
                if self.failure is None:
                    self._write(batch)
            except BaseException as e:  # raised by the caller's next call
                with self.cond:
                    self.failure = self.failure or e
            with self.cond:
                self.free.append(batch)
                self.in_flight.remove(batch)
                self.cond.notify_all()

    def _write(self, batch: _Batch) -> None:
        start, end, head = batch.start, batch.end, batch.head
        view = batch.view[head : head + batch.filled]
        first = -(-start // ALIGN) * ALIGN  # the batch's whole blocks: [first, last)
        last = end // ALIGN * ALIGN
        if not self.direct or last <= first:
            pwrite_all(self.fd, view, start)
            return
        if first > start:
            pwrite_all(self.fd, view[: first - start], start)
        whole = view[first - start : last - start]
        try:
            pwrite_all(self.dfd, whole, first)
            with self.cond:
                self.direct_bytes += len(whole)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # The filesystem took the open but not the write: the page cache from now on.
            self.refused = True
            pwrite_all(self.fd, whole, first)
        if end > last:
            pwrite_all(self.fd, view[last - start :], last)


class DirectWrites:
    """Positioned writes into the file open as ``fd`` (``path``), direct where the filesystem
    allows; ``fd`` (a plain descriptor of the same file, the caller's) takes the partial blocks.
    After :meth:`close`, every call fails (EBADF), as writes to a closed descriptor do."""

    def __init__(self, path: str, fd: int) -> None:
        dfd = -1
        if direct_io_enabled():
            try:
                dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:  # EINVAL where the filesystem has no direct I/O
                dfd = -1
        self._back = _Writer(fd, dfd)
        self._current: _Batch | None = None
        self._closed = False
        # Dropped without close (an abandoned writer): the threads end, what they hold goes back.
        self._finalizer = weakref.finalize(self, _stop_dropped, self._back)

    @property
    def direct(self) -> bool:
        """Whether writes still go around the page cache (false once the filesystem refused)."""
        return self._back.direct

    @property
    def direct_bytes(self) -> int:
        """Bytes written with O_DIRECT so far (for tests and benchmarks)."""
        return self._back.direct_bytes

    def write_at(self, offset: int, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        self._check()
        back = self._back
        if not back.direct and self._current is None and not back.in_flight:
            pwrite_all(back.fd, view, offset)
            return
        pos = 0
        while pos < len(view):
            batch = self._current
            if batch is None or batch.end != offset + pos or batch.room == 0:
                if batch is not None:
                    back.submit(batch)
                batch = self._current = back.take(offset + pos)
            n = min(len(view) - pos, batch.room)
            at = batch.head + batch.filled
            copy_bytes(batch.view[at : at + n], view[pos : pos + n])
            batch.filled += n
            pos += n

    def flush(self) -> None:
        """Every byte written so far is in the file (or its failure raised)."""
        self._check()
        if self._current is not None:
            batch, self._current = self._current, None
            self._back.submit(batch)
        self._back.wait()
        self._check()

    def close(self, *, write_pending: bool = True) -> None:
        """Flush (unless ``write_pending`` is false: what is not written yet is dropped and no
        failure is raised) and let go of the buffers, the threads and the direct descriptor."""
        if self._closed:
            return
        try:
            if write_pending:
                self.flush()
        finally:
            self._closed = True
            self._current = None
            self._finalizer.detach()
            self._back.stop(drop=not write_pending)

    def _check(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "write to a closed file")
        failure = self._back.failure
        if failure is not None and not isinstance(failure, _Dropped):
            raise failure


def _stop_dropped(back: _Writer) -> None:
    """Stop the writer of a front collected without ``close``. The collection may run on one of the
    writer's own threads, even while it holds the writer's lock; joining the other thread from
    there could wait forever for that lock, so that stop goes to a thread of its own."""
    if threading.current_thread() in back.threads:
        threading.Thread(
            target=back.stop, kwargs={"drop": True}, name="ckptconv-direct-writes-stop", daemon=True
        ).start()
    else:
        back.stop(drop=True)


class _Dropped(Exception):
    """Pending writes were dropped on purpose (the output is being discarded)."""


__all__ = ["ALIGN", "BATCHES", "BATCH_BYTES", "DirectWrites", "copy_bytes", "direct_io_enabled", "pwrite_all"]
