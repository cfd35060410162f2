"""Fast chunk I/O for LZ4-filtered HDF5 datasets, bypassing HDF5's filter pipeline.

Why: h5py's automatic chunks are small (64 KiB for a typical weight) and every one of them goes
through the filter pipeline one call at a time, which makes writing a multi-GB checkpoint several
times slower than copying it. The real loader reads any chunk shape (cs-checkpoint-format §1.12),
so the writer uses large C-contiguous slab chunks, LZ4-frames them in a small thread pool (python-lz4
releases the GIL) and hands finished chunks to ``H5Dwrite_chunk``. The reader asks HDF5 only where
each chunk lives and reads and decodes the bytes itself, straight into the tensor's memory.

On-disk framing of the LZ4 filter (HDF5 filter 32004, as registered by hdf5plugin)::

    uint64 BE  original (decoded) chunk size
    uint32 BE  block size (cd_values[0], 0 = 1 GiB; capped at the original size)
    per block: uint32 BE stored size, then the stored bytes; a block whose stored size equals
               its decoded size is kept raw (it did not compress), otherwise it is an LZ4 block.

The last block may be shorter than the block size. A chunk whose filter mask has bit 0 set
skipped the (optional) filter and is stored raw without any framing.
"""

from __future__ import annotations

import math
import os
import queue
import struct
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import lz4.block
import numpy as np

from ckptconv.core.errors import CorruptCheckpoint, InvalidRequest
from ckptconv.storage.digests import WrittenBlocks

LZ4_FILTER_ID = 32004


def register_lz4() -> None:
    """Register the LZ4 filter (and hdf5plugin's others) with the HDF5 library h5py loaded, before
    h5py itself reads or makes an LZ4-chunked dataset. Here, not at import: hdf5plugin loads the
    shared libraries of nine filters (70 ms on a cold page cache, measured beside h5py's 80 ms), of
    no use to a conversion that writes an uncompressed file. Importing it again costs nothing."""
    import hdf5plugin  # noqa: F401 - its import registers the filters


LZ4_DEFAULT_BLOCK = 1 << 30
_HEADER = struct.Struct(">QI")
_BLOCK = struct.Struct(">I")
# 1 MiB slabs: 16x h5py's usual 64 KiB chunks, and still small enough for the kernel's fast write
# path (on the machines measured, single 8 MiB writes into the page cache took 3x longer per byte
# than 1 MiB ones, and slowed concurrent reads too).
DEFAULT_CHUNK_BYTES = 1 << 20
READ_BATCH_BYTES = 8 << 20  # chunks handed to one reader thread at a time


def lz4_bound(n: int) -> int:
    return n + n // 255 + 16


def framed_bound(n: int) -> int:
    """Largest framed size of an ``n``-byte chunk (one block; raw when it does not compress)."""
    return _HEADER.size + _BLOCK.size + max(n, lz4_bound(n))


_PROBE = 64 << 10


def worth_compressing(src: memoryview, ratio: float = 0.95) -> bool:
    """Whether LZ4 would save space on ``src``, judged from up to three 64 KiB samples.

    Weights rarely compress with LZ4 (random-looking mantissas), and compressing a chunk only to
    store it raw costs about a second of CPU per GB; sampling costs almost nothing.
    """
    n = len(src)
    if n <= 4 * _PROBE:
        return True
    total = packed = 0
    for start in (0, (n - _PROBE) // 2, n - _PROBE):
        window = src[start : start + _PROBE]
        total += len(window)
        packed += len(lz4.block.compress(window, mode="default", store_size=False))
    return packed < ratio * total


def lz4_encode_into(src: memoryview, out: bytearray, mode: str = "always") -> int:
    """Frame ``src`` (one chunk, < 1 GiB) into ``out``; returns the framed length.

    ``mode``: "always" compresses the whole chunk (as the HDF5 filter does), "auto" only when
    samples say it pays off, "never" stores it raw. Every result is valid filter framing: a block
    whose stored size equals its size is raw.
    """
    n = len(src)
    if n == 0 or n > LZ4_DEFAULT_BLOCK:
        raise ValueError("chunk size out of range for single-block LZ4 framing")
    _HEADER.pack_into(out, 0, n, n)
    pos = _HEADER.size + _BLOCK.size
    # Copies go through a memoryview: assigning another object to a bytearray slice first makes a
    # temporary bytearray of it, an extra allocation and copy per chunk.
    dst = memoryview(out)
    if mode == "always" or (mode == "auto" and worth_compressing(src)):
        comp = lz4.block.compress(src, mode="default", store_size=False)
        if len(comp) < n:
            _BLOCK.pack_into(out, _HEADER.size, len(comp))
            dst[pos : pos + len(comp)] = comp
            return pos + len(comp)
    _BLOCK.pack_into(out, _HEADER.size, n)
    dst[pos : pos + n] = src
    return pos + n


def lz4_encode(src: bytes | memoryview) -> bytes:
    src = memoryview(src).cast("B")
    out = bytearray(framed_bound(len(src)))
    return bytes(out[: lz4_encode_into(src, out)])


def lz4_decode_into(stored: memoryview, out: memoryview, what: str) -> None:
    """Decode one framed chunk into ``out`` (exactly the chunk's size). CorruptCheckpoint on any inconsistency."""
    n = len(out)
    if len(stored) < _HEADER.size:
        raise CorruptCheckpoint(f"{what}: LZ4 chunk shorter than its header")
    orig, block = _HEADER.unpack_from(stored, 0)
    if orig != n:
        raise CorruptCheckpoint(f"{what}: LZ4 chunk decodes to {orig} bytes, expected {n}")
    if n == 0:
        return
    if block == 0:
        raise CorruptCheckpoint(f"{what}: LZ4 chunk has block size 0")
    block = min(block, orig)
    pos = _HEADER.size
    done = 0
    while done < n:
        size = min(block, n - done)
        if pos + _BLOCK.size > len(stored):
            raise CorruptCheckpoint(f"{what}: LZ4 chunk truncated")
        (csize,) = _BLOCK.unpack_from(stored, pos)
        pos += _BLOCK.size
        if csize > len(stored) - pos or csize == 0:
            raise CorruptCheckpoint(f"{what}: LZ4 block size {csize} runs past the chunk")
        data = stored[pos : pos + csize]
        if csize == size:
            out[done : done + size] = data
        else:
            try:
                dec = lz4.block.decompress(data, uncompressed_size=size)
            except lz4.block.LZ4BlockError as e:
                raise CorruptCheckpoint(f"{what}: LZ4 block does not decode ({e})") from None
            if len(dec) != size:
                raise CorruptCheckpoint(f"{what}: LZ4 block decodes to {len(dec)} bytes, expected {size}")
            out[done : done + size] = dec
        pos += csize
        done += size


# --- chunk shapes -----------------------------------------------------------------------------


def slab_chunk_shape(shape: tuple[int, ...], itemsize: int, target: int = DEFAULT_CHUNK_BYTES) -> tuple[int, ...]:
    """Chunks that are C-contiguous slabs of about ``target`` bytes (leading 1s, one split axis, full tail).

    The split axis is divided evenly, into a number of parts that divides it when one exists
    close to the minimum: then no chunk sticks out of the array (HDF5 stores edge chunks at full
    size, which would cost padding and a copy).
    """
    inner = itemsize
    for a in range(len(shape) - 1, -1, -1):
        if shape[a] * inner > target:
            least = math.ceil(shape[a] * inner / target)
            parts = next((p for p in range(least, 2 * least + 1) if shape[a] % p == 0), least)
            k = math.ceil(shape[a] / parts)
            return (1,) * a + (k,) + tuple(shape[a + 1 :])
        inner *= shape[a]
    return tuple(shape)


def slab_axis(shape: tuple[int, ...], chunks: tuple[int, ...]) -> int | None:
    """The split axis when every chunk is one C-contiguous run of the array, else None."""
    for a in range(len(shape)):
        if all(c == 1 for c in chunks[:a]) and tuple(chunks[a + 1 :]) == tuple(shape[a + 1 :]):
            return a
    return None


def _chunk_grid(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    counts = [math.ceil(s / c) for s, c in zip(shape, chunks, strict=True)]
    for idx in np.ndindex(*counts):
        yield tuple(i * c for i, c in zip(idx, chunks, strict=True))


def _flat_offset(offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for o, s in zip(offset, shape, strict=True):
        flat = flat * s + o
    return flat


# --- writing ----------------------------------------------------------------------------------


LZ4_MODES = ("auto", "always", "never")


def check_lz4_mode(mode: str) -> str:
    """``mode`` if it is one of LZ4_MODES (when chunks are compressed), else InvalidRequest."""
    if mode not in LZ4_MODES:
        raise InvalidRequest(f"LZ4 mode must be {', '.join(LZ4_MODES)}, not {mode!r}")
    return mode


class ChunkWriter:
    """Frames and writes the chunks of one dataset at a time.

    One instance per sink. Compression runs in ``threads`` worker threads; at most ``in_flight``
    framed chunks exist at once, each in a reused buffer, so memory stays at
    ``in_flight * framed_bound(chunk)`` on top of the tensor being written. HDF5 is only called
    from the calling thread.
    """

    def __init__(
        self, threads: int = 2, in_flight: int = 4, mode: str = "auto", written: WrittenBlocks | None = None
    ) -> None:
        self.mode = check_lz4_mode(mode)
        self.in_flight = max(1, in_flight)
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="lz4") if threads else None
        # Every chunk is reported to ``written`` (hashed for the file's block digest) at its address,
        # on a thread of its own, in the order the chunks were written; its buffer is reused after.
        self._written = written
        self._hash = ThreadPoolExecutor(max_workers=1, thread_name_prefix="h5-digest") if written else None
        self._hashing: deque[tuple[Future[None], bytearray]] = deque()
        self._buffers: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._buf_size = 0
        self._pad = bytearray()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            for pool in (self._pool, self._hash):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._pool = self._hash = None
            self._buffers = queue.SimpleQueue()

    def drain(self) -> None:
        """Wait until every written chunk has been reported; raises the first reporting error."""
        while self._hashing:
            self._hashed_one()

    def _hashed_one(self) -> None:
        fut, buf = self._hashing.popleft()
        try:
            fut.result()
        finally:
            self._give_back(buf)

    def _give_back(self, buf: bytearray) -> None:
        if len(buf) == self._buf_size:  # buffers of an earlier, smaller chunk size are dropped
            self._buffers.put(buf)

    def _pad_buffer(self, n: int) -> memoryview:
        if len(self._pad) < n:
            self._pad = bytearray(n)
        return memoryview(self._pad)[:n]

    def _take(self, need: int) -> bytearray:
        if need > self._buf_size:
            # a bigger chunk than before: drop the old buffers, they would be too small
            self._buffers = queue.SimpleQueue()
            self._buf_size = need
        try:
            return self._buffers.get_nowait()
        except queue.Empty:
            return bytearray(self._buf_size)

    def write(
        self, dsid: Any, data: memoryview, shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int
    ) -> None:
        """Write every chunk of a dataset created with ``chunks`` (slab chunks) from C-ordered ``data``."""
        axis = slab_axis(shape, chunks)
        if axis is None:
            raise ValueError("ChunkWriter needs slab chunks")
        data = data.cast("B")
        chunk_nbytes = math.prod(chunks) * itemsize
        need = framed_bound(chunk_nbytes)
        pending: deque[tuple[tuple[int, ...], bytearray, Future[int] | int]] = deque()

        def flush_one() -> None:
            offset, buf, fut = pending.popleft()
            length = fut.result() if isinstance(fut, Future) else fut
            dsid.write_direct_chunk(offset, memoryview(buf)[:length])
            if self._hash is None or self._written is None:
                self._give_back(buf)
                return
            address = dsid.get_chunk_info_by_coord(offset).byte_offset
            self._hashing.append((self._hash.submit(self._written.wrote, address, memoryview(buf)[:length]), buf))
            if len(self._hashing) > self.in_flight:
                self._hashed_one()

        try:
            for offset in _chunk_grid(shape, chunks):
                start = _flat_offset(offset, shape) * itemsize
                src = data[start : start + chunk_nbytes]
                buf = self._take(need)
                if len(src) < chunk_nbytes:
                    # An edge chunk: HDF5 stores it at full size. Padded in a reused buffer and
                    # framed right here, so the buffer is free again for the next edge chunk.
                    while pending:
                        flush_one()
                    pad = self._pad_buffer(chunk_nbytes)
                    pad[: len(src)] = src
                    np.frombuffer(pad, dtype=np.uint8)[len(src) :] = 0
                    pending.append((offset, buf, lz4_encode_into(pad, buf, self.mode)))
                    flush_one()
                    continue
                if self._pool is not None and chunk_nbytes >= (256 << 10):
                    job: Future[int] | int = self._pool.submit(lz4_encode_into, src, buf, self.mode)
                else:
                    job = lz4_encode_into(src, buf, self.mode)
                pending.append((offset, buf, job))
                if len(pending) >= self.in_flight:
                    flush_one()
            while pending:
                flush_one()
        finally:
            for _, buf, fut in pending:  # after an error: let running jobs finish, keep memory bounded
                if isinstance(fut, Future):
                    fut.exception()
                self._give_back(buf)
            pending.clear()


# --- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredChunk:
    offset: tuple[int, ...]
    filter_mask: int
    address: int
    size: int


def stored_chunks(dsid: Any) -> list[StoredChunk]:
    out: list[StoredChunk] = []

    def visit(info: Any) -> None:
        out.append(StoredChunk(tuple(info.chunk_offset), info.filter_mask, info.byte_offset, info.size))

    dsid.chunk_iter(visit)
    return out


ByteReader = Callable[[int, int], bytes]


class ChunkReader:
    """Reads LZ4-chunked datasets into a caller's buffer using a few threads.

    ``pread_fd``: a file descriptor of the local file (then raw chunks land in the destination
    with one ``preadv``, no intermediate copy); otherwise ``read_bytes(offset, length)``.
    ``file_size`` bounds every chunk address (a truncated file is CorruptCheckpoint).
    """

    def __init__(
        self,
        *,
        file_size: int,
        pread_fd: int | None = None,
        read_bytes: ByteReader | None = None,
        threads: int = 2,
        batch_bytes: int = READ_BATCH_BYTES,
    ) -> None:
        if pread_fd is None and read_bytes is None:
            raise ValueError("ChunkReader needs a file descriptor or a byte reader")
        self.file_size = file_size
        self.fd = pread_fd
        self.read_bytes = read_bytes
        self.batch_bytes = batch_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lz4r") if threads > 1 else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _read(self, address: int, length: int, what: str) -> memoryview:
        if address < 0 or address + length > self.file_size:
            raise CorruptCheckpoint(f"{what}: chunk at byte {address} (+{length}) lies beyond the end of the file")
        if self.fd is not None:
            buf = bytearray(length)
            got = os.preadv(self.fd, [buf], address)
            if got != length:
                raise CorruptCheckpoint(f"{what}: file truncated inside a chunk")
            return memoryview(buf)
        assert self.read_bytes is not None
        data = self.read_bytes(address, length)
        if len(data) != length:
            raise CorruptCheckpoint(f"{what}: file truncated inside a chunk")
        return memoryview(data)

    def _read_raw_into(self, address: int, dest: memoryview, chunk_nbytes: int, what: str) -> bool:
        """Try the fast path for a raw single-block chunk: header + payload straight into ``dest``."""
        if self.fd is None:
            return False
        total = _HEADER.size + _BLOCK.size + chunk_nbytes
        if address < 0 or address + total > self.file_size:
            raise CorruptCheckpoint(f"{what}: chunk at byte {address} lies beyond the end of the file")
        head = bytearray(_HEADER.size + _BLOCK.size)
        got = os.preadv(self.fd, [head, dest], address)
        if got != len(head) + len(dest):
            raise CorruptCheckpoint(f"{what}: file truncated inside a chunk")
        orig, block = _HEADER.unpack_from(head, 0)
        (csize,) = _BLOCK.unpack_from(head, _HEADER.size)
        return orig == chunk_nbytes and min(block, orig) == chunk_nbytes and csize == chunk_nbytes

    def read(
        self, dsid: Any, dest: np.ndarray, chunks: tuple[int, ...], what: str, chunk_list: list[StoredChunk]
    ) -> None:
        """Fill C-contiguous ``dest`` (the dataset's shape, its on-disk element size) from ``chunk_list``."""
        shape = tuple(dest.shape)
        itemsize = dest.dtype.itemsize
        chunk_nbytes = math.prod(chunks) * itemsize
        axis = slab_axis(shape, chunks)
        flat = dest.reshape(-1).view(np.uint8)

        def one(ch: StoredChunk, stored: memoryview | None = None) -> None:
            """Place one chunk; ``stored`` is its bytes when already fetched (remote reads)."""
            if any(o % c or o >= s for o, c, s in zip(ch.offset, chunks, shape, strict=True)):
                raise CorruptCheckpoint(f"{what}: chunk offset {ch.offset} does not fit the dataset")
            if axis is not None:
                start = _flat_offset(ch.offset, shape) * itemsize
                rows = min(chunks[axis], shape[axis] - ch.offset[axis])
                valid = rows * (chunk_nbytes // chunks[axis])
                target = memoryview(flat[start : start + valid])
                if valid == chunk_nbytes and ch.filter_mask & 1 == 0:
                    if (
                        stored is None
                        and ch.size == _HEADER.size + _BLOCK.size + chunk_nbytes
                        and self._read_raw_into(ch.address, target, chunk_nbytes, what)
                    ):
                        return
                    lz4_decode_into(
                        stored if stored is not None else self._read(ch.address, ch.size, what), target, what
                    )
                    return
                target[:] = self._decode(ch, chunk_nbytes, what, stored)[:valid]
                return
            full = np.frombuffer(self._decode(ch, chunk_nbytes, what, stored), dtype=dest.dtype).reshape(chunks)
            region = tuple(slice(o, min(o + c, s)) for o, c, s in zip(ch.offset, chunks, shape, strict=True))
            dest[region] = full[tuple(slice(0, r.stop - r.start) for r in region)]

        batches: list[list[StoredChunk]] = [[]]
        acc = 0
        for ch in chunk_list:
            if acc >= self.batch_bytes:
                batches.append([])
                acc = 0
            batches[-1].append(ch)
            acc += chunk_nbytes

        def run(batch: list[StoredChunk]) -> None:
            if self.fd is not None:
                for ch in batch:
                    one(ch)
                return
            # Remote: one ranged request per run of neighbouring chunks, not one per chunk.
            for span in _spans(batch, self.file_size, what):
                base = span[0].address
                data = self._read(base, span[-1].address + span[-1].size - base, what)
                for ch in span:
                    one(ch, data[ch.address - base : ch.address - base + ch.size])

        if self._pool is None or len(batches) == 1:
            for b in batches:
                run(b)
            return
        futures = [self._pool.submit(run, b) for b in batches]
        errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e

    def _decode(self, ch: StoredChunk, chunk_nbytes: int, what: str, stored: memoryview | None = None) -> memoryview:
        if stored is None:
            stored = self._read(ch.address, ch.size, what)
        if ch.filter_mask & 1:  # the optional filter was skipped: raw chunk
            if len(stored) != chunk_nbytes:
                raise CorruptCheckpoint(f"{what}: unfiltered chunk has {len(stored)} bytes, expected {chunk_nbytes}")
            return stored
        out = bytearray(chunk_nbytes)
        lz4_decode_into(stored, memoryview(out), what)
        return memoryview(out)


_SPAN_GAP = 1 << 20
_SPAN_MAX = 32 << 20


def _spans(batch: list[StoredChunk], file_size: int, what: str) -> list[list[StoredChunk]]:
    """Chunks grouped into runs that one ranged read covers (small gaps included, bounded length)."""
    for ch in batch:
        if ch.address < 0 or ch.size < 0 or ch.address + ch.size > file_size:
            raise CorruptCheckpoint(f"{what}: chunk at byte {ch.address} (+{ch.size}) lies beyond the end of the file")
    spans: list[list[StoredChunk]] = []
    for ch in sorted(batch, key=lambda c: c.address):
        if spans:
            first, last = spans[-1][0], spans[-1][-1]
            end = last.address + last.size
            if 0 <= ch.address - end <= _SPAN_GAP and ch.address + ch.size - first.address <= _SPAN_MAX:
                spans[-1].append(ch)
                continue
        spans.append([ch])
    return spans
