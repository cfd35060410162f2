"""Ranged reads from S3 into the caller's buffers, as concurrent ranged GETs.

One connection tops out far below what a store serves to several, so a range longer than two
parts is fetched as parts of ``part_size`` bytes in parallel, each straight into its slice of the
caller's buffer. Every GET of this reader, whichever thread asks (the executor reads several
values at once), takes one of ``concurrency`` slots: the number of GETs in flight is bounded no
matter how many callers read at once. Each part is retried per the storage's policy on its own; a
retry after a broken body asks only for the bytes still missing, of the object the first answer
came from (``If-Match``). A caller that names an ETag (``etag``: the version of the object it read
first, see :mod:`ckptconv.storage.pinned`) gets every GET conditional on it: bytes of another
version are refused (412), never mixed with the first one's.

A body arrives faster than any one read call takes it only from the fastest servers; from most it
trickles in a packet or two at a time, and a thread woken for each one pays a system call, a thread
switch and the GIL per 64 KiB or so. While a body is read the socket's receive low-water mark
(``SO_RCVLOWAT``) is raised to a slice (1 MiB): the thread sleeps until that much waits, then
takes it in one call (:class:`_LowWater`). 1 GB read from a local s3rver by 8 threads took
0.76-0.94 CPU-s (9,000 thread switches), now 0.47-0.55 (1,400). The read timeout then counts from
the last slice, not the last packet; once a read timed out so, the storage takes bodies as they
come: the part is retried and a server slower than a slice per timeout is still read, at the cost
of one timeout.

Neighbouring values of one object are read with one GET when together they are shorter than two
parts (:meth:`RangedGets.read_scattered`): its body is read into each value's buffer in turn. A
server spends about as much on a request as on a megabyte of its body (s3rver: ~4 ms of CPU per
GET), and a Llama layer holds six tensors of 4 KB to 8 MB (two norms, four attention projections)
beside three of 23 MB: a 3 GB checkpoint took 296 GETs (one per tensor, the two 125 MiB ones in
parts), 147 with neighbours joined (in the order the run reads them and within its read-ahead:
``ckptconv.engine.prefetch``).

Settings (environment, read when the storage is built): ``CKPTCONV_S3_READ_CONCURRENCY``
(default 8) GETs in flight, each of at most ``CKPTCONV_S3_READ_PART_SIZE`` bytes (default 16 MiB).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import http.client
import os
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from botocore.exceptions import ClientError

from ckptconv.core.sizes import parse_size
from ckptconv.storage.ranges import replaced, short_read
from ckptconv.storage.s3.client import TruncatedResponse, error_code, precondition_failed

DEFAULT_READ_CONCURRENCY = 8
DEFAULT_READ_PART_SIZE = 16 << 20
# Parts are never smaller than S3's own multipart minimum: smaller GETs cost more in requests than
# they gain in parallelism.
MIN_READ_PART_SIZE = 5 << 20
# Body bytes taken from the connection per read call (what a broken connection can cost).
READ_SLICE = 1 << 20
# Body bytes that may sit outside the socket, where the low-water mark does not see them: a TLS
# record being decrypted (at most 16 KiB and its framing), with room to spare.
LOW_WATER_MARGIN = 64 << 10


def read_settings() -> tuple[int, int]:
    """(GETs in flight, part size) from the environment."""
    env = os.environ
    concurrency = int(env.get("CKPTCONV_S3_READ_CONCURRENCY", DEFAULT_READ_CONCURRENCY))
    part_size = parse_size(env.get("CKPTCONV_S3_READ_PART_SIZE", str(DEFAULT_READ_PART_SIZE)))
    return max(1, concurrency), max(MIN_READ_PART_SIZE, part_size)


Retried = Callable[[str, Callable[[], Any], str], Any]


class RangedGets:
    """Concurrent ranged GETs of one S3 client, at most ``concurrency`` in flight. Thread-safe."""

    def __init__(self, client: Any, retried: Retried, *, concurrency: int, part_size: int) -> None:
        self.client = client
        self.retried = retried
        self.concurrency = max(1, concurrency)
        self.part_size = max(MIN_READ_PART_SIZE, part_size)
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # Set once a read timed out waiting for a whole slice: the server may send less than a
        # slice per read timeout, so bodies are taken as they come from then on (the read timeout
        # counts from the last packet again, as a stall's should).
        self._as_it_comes = False

    def read_into(
        self, uri: str, bucket: str, key: str, offset: int, view: memoryview, etag: str | None = None
    ) -> None:
        """Fill ``view`` with the object's bytes from ``offset`` (CorruptCheckpoint past its end, or
        when the object is no longer version ``etag``)."""
        length = len(view)
        if length == 0:
            return
        part = self.part_size
        if self.concurrency <= 1 or length < self.one_get_below:
            self._read_part(uri, bucket, key, offset, Segments([view]), etag)
            return
        futures = [
            self._parts_pool().submit(
                self._read_part, uri, bucket, key, offset + start, Segments([view[start : start + part]]), etag
            )
            for start in range(0, length, part)
        ]
        try:
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)  # no part may write into the buffer after we return

    def read_scattered(
        self, uri: str, bucket: str, key: str, offset: int, views: Sequence[memoryview], etag: str | None = None
    ) -> None:
        """Fill ``views`` in turn with the object's bytes from ``offset``: one GET when they are
        shorter than two parts together, as a single range is (each on its own otherwise)."""
        segments = Segments(views)
        if len(segments) < self.one_get_below:
            if len(segments):
                self._read_part(uri, bucket, key, offset, segments, etag)
            return
        for view in views:
            self.read_into(uri, bucket, key, offset, view, etag)
            offset += len(view)

    @property
    def one_get_below(self) -> int:
        """Bytes below which a range is read with one GET: parts pay only from two on."""
        return 2 * self.part_size

    def read_head(
        self, uri: str, bucket: str, key: str, offset: int, length: int, etag: str | None = None
    ) -> tuple[bytes, dict[str, Any]]:
        """Up to ``length`` bytes from ``offset`` with one GET (in a slot, retried), and the response's
        facts: ``size`` (from its Content-Range), ``etag``, ``mtime``. ``size`` is None when the
        range starts at or past the end (the server refuses it) or no size was announced."""
        condition = {"IfMatch": etag} if etag else {}

        def attempt() -> tuple[bytes, dict[str, Any]]:
            with self._slots:
                try:
                    r = self.client.get_object(
                        Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}", **condition
                    )
                except ClientError as e:
                    code, status = error_code(e)
                    if code == "InvalidRange" or status == 416:
                        return b"", {"size": None}
                    if etag and precondition_failed(e):
                        raise replaced(uri, f"while it was being read (its ETag is no longer {etag})") from None
                    raise
                body = r["Body"]
                try:
                    skip, last, total = _served_range(r.get("ContentRange"), offset)
                    data = body.read()
                finally:
                    body.close()
            announced = r.get("ContentLength")
            if announced is not None and len(data) != int(announced):
                raise TruncatedResponse(f"the body ended after {len(data)} of {announced} bytes")
            facts = {"etag": r.get("ETag"), "mtime": r.get("LastModified")}
            if last is None:  # the server ignored Range and sent the whole object
                return data[skip : skip + length], {**facts, "size": len(data)}
            if len(data) != last - offset + 1:
                raise TruncatedResponse(f"the body has {len(data)} bytes for the range {offset}-{last}")
            return data[:length], {**facts, "size": total}

        return self.retried(uri, attempt, "get_object")

    def _parts_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="s3-read")
            return self._pool

    def _read_part(
        self, uri: str, bucket: str, key: str, offset: int, view: Segments, pinned: str | None = None
    ) -> None:
        done = [0]  # bytes in place so far; survives the failed tries
        # The object's ETag: the caller's, or as the first answer gave it.
        etag: list[str] = [pinned] if pinned else []

        def attempt() -> None:
            with self._slots:
                self._get_into(uri, bucket, key, offset, view, done, etag)

        self.retried(uri, attempt, "get_object")

    def _get_into(
        self, uri: str, bucket: str, key: str, offset: int, view: Segments, done: list[int], etag: list[str]
    ) -> None:
        """One ranged GET of the bytes of ``view`` from ``done[0]`` on; advances ``done[0]`` as they
        arrive. A retry asks for the rest of the same object (``If-Match`` the first answer's ETag):
        an object replaced between two tries would otherwise fill one buffer with bytes of two objects."""
        length = len(view)
        start = offset + done[0]
        condition = {"IfMatch": etag[0]} if etag else {}
        try:
            r = self.client.get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{offset + length - 1}", **condition
            )
        except ClientError as e:
            code, status = error_code(e)
            if code == "InvalidRange" or status == 416:  # the range starts at or past the end
                size = e.response.get("Error", {}).get("ActualObjectSize")
                raise short_read(uri, offset, length, done[0], int(size) if size else None) from None
            if condition and precondition_failed(e):
                raise replaced(uri, f"while it was being read (its ETag is no longer {etag[0]})") from None
            raise
        if not etag and r.get("ETag"):
            etag.append(r["ETag"])
        body = r["Body"]
        raw = body._raw_stream
        try:
            skip, _end, total = _served_range(r.get("ContentRange"), start)
            announced = r.get("ContentLength")
            _skip(raw, skip)  # a server that ignored Range sends the object from byte 0
            readinto, low_water = _body_reader(raw, slices=not self._as_it_comes)
            # Where the body ends, in the buffer (a truncated object's ends before the range does);
            # unannounced, nowhere a read may wait for.
            body_end = done[0] + int(announced) - skip if announced is not None else done[0]
            while done[0] < length:
                # In slices: a read that fails mid-way loses what it had, so keep each one small.
                low_water.before_slice(body_end - done[0] - READ_SLICE)
                try:
                    n = readinto(view.window(done[0], READ_SLICE))
                except http.client.HTTPException as e:  # a broken chunked body
                    raise TruncatedResponse(f"the body broke: {type(e).__name__}: {e}") from e
                except TimeoutError:  # a stall, or a server slower than a slice per read timeout
                    self._as_it_comes = self._as_it_comes or low_water.raised
                    raise
                if not n:
                    break
                done[0] += n
            if low_water.reset() and done[0] == length:
                _release(raw)
                return
            got = done[0] - (start - offset)
            if (total is not None and start + got >= total) or (announced is not None and skip + got >= announced):
                # The response is whole and still short: the object itself ends early.
                raise short_read(uri, offset, length, done[0], total)
            raise TruncatedResponse(f"the body ended after {got} bytes of the range from offset {start}")
        finally:
            body.close()


class Segments:
    """Buffers filled in turn by one stream of bytes: its byte ``i`` lands in the buffer that
    holds position ``i`` of their concatenation."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = [v for v in views if len(v)]
        self._starts = []
        total = 0
        for v in self._views:
            self._starts.append(total)
            total += len(v)
        self._length = total

    def __len__(self) -> int:
        return self._length

    def window(self, position: int, most: int) -> memoryview:
        """The buffer's memory from ``position`` on: at most ``most`` bytes, never past the end of
        the buffer holding ``position`` (a read into it fills one buffer at a time)."""
        i = bisect.bisect_right(self._starts, position) - 1
        start = position - self._starts[i]
        return self._views[i][start : start + most]


def _served_range(content_range: str | None, start: int) -> tuple[int, int | None, int | None]:
    """(bytes to skip, last byte served, object size) from a response's Content-Range.

    Without one the server ignored Range and sends the object from byte 0 (allowed by HTTP).
    A range that starts elsewhere than asked is a broken response.
    """
    if not content_range:
        return start, None, None
    unit, _, rest = content_range.partition(" ")
    span, _, total_text = rest.partition("/")
    first, _, last = span.partition("-")
    try:
        first_n, last_n = int(first), int(last)
    except ValueError:
        raise TruncatedResponse(f"unreadable Content-Range {content_range!r}") from None
    if unit != "bytes" or first_n != start:
        raise TruncatedResponse(f"asked for bytes from {start}, got Content-Range {content_range!r}")
    return 0, last_n, int(total_text) if total_text.isdigit() else None


def _body_reader(raw: Any, *, slices: bool = True) -> tuple[Callable[[memoryview], int], _LowWater]:
    """The body's ``readinto`` that fills the caller's buffer from the socket, and the low-water
    mark of the socket it reads from (never raised unless ``slices``: the body is taken as it comes).

    urllib3's ``readinto`` reads a new bytes object and copies it into the buffer: a fresh
    allocation and a copy of every byte. The http.client response under it reads into the buffer
    itself; a body of known length read whole is then handed back by :func:`_release`.
    """
    fp = getattr(raw, "_fp", None)
    # botocore asks urllib3 for the bytes as sent (no decoding), so nothing waits in its buffers.
    if isinstance(fp, http.client.HTTPResponse) and getattr(raw, "decode_content", True) is False:
        connection = getattr(raw, "connection", None)
        return fp.readinto, _LowWater(getattr(connection, "sock", None) if slices else None)
    # urllib3 reads ahead of what it is asked for: the mark could wait for bytes it holds already.
    return raw.readinto, _LowWater(None)


class _LowWater:
    """The receive low-water mark of the socket a body is read from (``SO_RCVLOWAT``): a read
    waits until that many bytes are there, or the connection ends.

    A mark never exceeds the body bytes announced to follow the slice being read, less
    :data:`LOW_WATER_MARGIN`: every read of the slice then waits for bytes that are on their way,
    never for bytes the server will not send (the end of a body is read as it comes). A connection
    goes back to the pool only with the mark at one byte again (:meth:`reset`): the next answer on
    it must not wait for more than it holds.
    """

    _OPTION = getattr(socket, "SO_RCVLOWAT", None)

    def __init__(self, sock: Any) -> None:
        # A plain or TLS socket; not a TLS tunnel inside a TLS proxy connection, whose records the
        # margin does not cover (its body is read as it comes).
        self._sock = sock if isinstance(sock, socket.socket) and self._OPTION is not None else None
        self._mark = 1

    def before_slice(self, following: int) -> None:
        """Set the mark for the next slice, which ``following`` bytes of the body come after."""
        self._set(max(1, min(READ_SLICE, following - LOW_WATER_MARGIN)))

    @property
    def raised(self) -> bool:
        """True while a read waits for more than one byte."""
        return self._mark > 1

    def reset(self) -> bool:
        """The mark back at one byte; False when that failed (the connection must not be reused)."""
        return self._set(1)

    def _set(self, mark: int) -> bool:
        """True when the mark is ``mark`` now; on a failure it stays as it was (and is set no more)."""
        if mark == self._mark:
            return True
        if self._sock is not None:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, self._OPTION, mark)
            except OSError:  # a closed socket: the rest of the body is read as it comes, if at all
                self._sock = None
                return False
            self._mark = mark
            return True
        return False


def _release(raw: Any) -> None:
    """Return the connection of a body read whole to the pool (urllib3 did not see its end when
    the reader of :func:`_body_reader` read past it); one not read to its end is closed with the body."""
    fp = getattr(raw, "_fp", None)
    if isinstance(fp, http.client.HTTPResponse) and fp.isclosed():
        raw.release_conn()


def _skip(raw: Any, n: int) -> None:
    while n > 0:
        chunk = raw.read(min(n, 1 << 20))
        if not chunk:
            raise TruncatedResponse("the response ended before the requested range")
        n -= len(chunk)
