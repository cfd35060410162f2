"""An S3 multipart upload whose parts are fixed byte ranges of the final object, filled in any order.

:class:`~ckptconv.storage.s3.S3Writer` streams an object front to back. Formats whose byte layout
is known before the data arrives (an H5 file with preallocated datasets, a safetensors file whose
header gives every offset) can instead place each byte where it belongs: ``write_at(offset,
data)``. The object is cut into a fixed grid of parts: ``part_size`` bytes for the first thousand,
doubling every thousand parts as :class:`~ckptconv.storage.s3.S3Writer`'s do, so that S3's
10,000-part limit never caps the object below 5 TiB; a part is sent as soon as every one of its bytes has been
written, by a pool of ``concurrency`` threads, and ``write_at`` waits while that many parts are in
flight, so memory stays near ``(concurrency + open parts) * part_size``. Parts still being filled
are buffered: a writer that fills the object roughly in order keeps one or two open.

``complete(size)`` sends the last (possibly short) part and completes the upload create-only (an
object smaller than one part is sent with one create-only ``PutObject`` instead; the multipart
upload is only created when the first part is sent);
every failure (including one in ``complete``) aborts the upload, and ``abort`` is idempotent, so
a failed conversion leaves no incomplete upload behind. Retries follow the storage's policy.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ckptconv.core.errors import InvalidRequest, SinkProtocolError, StorageError
from ckptconv.storage.base import ObjectInfo, Storage, Writer
from ckptconv.storage.digests import BlockHasher

if TYPE_CHECKING:
    from ckptconv.storage.s3 import S3Storage

DEFAULT_PART_SIZE = 16 << 20
DEFAULT_CONCURRENCY = 4
_GROUP = 1_000  # parts of one size before the size doubles (as S3Writer's parts do)
# Parts being filled at once by a writer that fills the object roughly in order (see above).
OPEN_PARTS = 2


def upload_buffer_bytes(part_size: int = DEFAULT_PART_SIZE, concurrency: int = DEFAULT_CONCURRENCY) -> int:
    """Bytes one :class:`PartUpload` buffers at most: ``concurrency`` parts in flight plus the
    parts still being filled. Memory budgets count it for outputs written to S3."""
    return (max(1, concurrency) + OPEN_PARTS) * part_size


def check_part_size(part_size: int) -> None:
    """Refuse (InvalidRequest) a part size outside what S3's multipart uploads take."""
    # Deferred: the S3 backend imports boto3, loaded only once an S3 upload runs.
    from ckptconv.storage.s3 import MAX_PART_SIZE, MIN_PART_SIZE

    if part_size < MIN_PART_SIZE or part_size > MAX_PART_SIZE:
        raise InvalidRequest(f"part_size must be within [{MIN_PART_SIZE}, {MAX_PART_SIZE}], not {part_size}")


class PartUpload:
    """One positioned multipart upload (see the module docstring). ``write_at`` is called from
    one thread at a time; uploads run on the upload's own pool."""

    def __init__(
        self,
        storage: S3Storage,
        uri: str,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
        overwrite: bool = False,
        upload_id: str | None = None,
        metadata: dict[str, str] | None = None,
        block_digest: bool = True,
    ) -> None:
        check_part_size(part_size)
        self.uri = uri
        self.part_size = part_size
        self._storage = storage
        self._bucket, self._key = storage._object(uri, writing=True)
        self._overwrite = overwrite
        # The object's user metadata, given when the upload is created; resolved here, in the
        # caller's thread, where the job's attempt is in scope (the upload may start on the pool).
        self._metadata = storage.object_metadata(metadata)
        self._open: dict[int, tuple[bytearray, int]] = {}  # part -> (buffer, bytes filled)
        self._sent: set[int] = set()
        self._futures: list[Future[dict[str, Any]]] = []
        self._slots = threading.BoundedSemaphore(max(1, concurrency))
        # Buffers of parts sent, for the next parts: a fresh 16 MiB buffer is zeroed and faulted in
        # page by page (its own mapping: formats/memory.py), which costs more than filling it. A
        # buffer is taken from here or made only when none is spare, so there are never more than
        # the parts in flight and open at once, as without reuse.
        self._spare: list[bytearray] = []
        self._spare_lock = threading.Lock()
        self._spare_max = max(1, concurrency) + OPEN_PARTS
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="s3-part")
        self._state = "open"
        # Given: this process fills some parts of an upload another one created and completes.
        self._upload_id: str | None = upload_id
        # Every part is hashed as it is sent (the grid's parts are multiples of part_size), so the
        # block digest of what this upload sent is known without reading it back (storage/digests.py).
        # A caller that checksums the object otherwise (a file written front to back gets its
        # digest as it is written) asks for none: hashing every byte again costs CPU for nothing.
        self.blocks = BlockHasher(part_size)
        self._block_digest = block_digest

    @property
    def upload_id(self) -> str:
        """The multipart upload's id, creating the upload if it was not yet."""
        return self._start()

    def _start(self) -> str:
        if self._upload_id is None:
            s = self._storage
            kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key}
            if s.part_checksums:
                kwargs["ChecksumAlgorithm"] = "CRC32"
            if self._metadata:
                kwargs["Metadata"] = self._metadata
            self._upload_id = s._call(self.uri, s.client.create_multipart_upload, **kwargs)["UploadId"]
        return self._upload_id

    def _size_of_group(self, group: int) -> int:
        # Deferred: the S3 backend imports boto3, loaded only once an S3 upload runs.
        from ckptconv.storage.s3 import MAX_PART_SIZE

        return min(self.part_size << group, MAX_PART_SIZE)

    def part_bounds(self, number: int) -> tuple[int, int]:
        """``[start, end)`` of part ``number`` (1-based) on the grid."""
        start, group, before = 0, 0, number - 1
        while before > 0:
            n = min(before, _GROUP)
            start += n * self._size_of_group(group)
            before -= n
            group += 1
        return start, start + self._size_of_group((number - 1) // _GROUP)

    def part_of(self, offset: int) -> int:
        """The number of the part holding byte ``offset``."""
        base, group = 0, 0
        while True:
            size = self._size_of_group(group)
            if offset < base + _GROUP * size:
                return group * _GROUP + (offset - base) // size + 1
            base += _GROUP * size
            group += 1

    def write_at(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Place ``data`` at ``offset``; every byte of the object must be written exactly once."""
        if self._state != "open":
            raise SinkProtocolError(f"write to a {self._state} upload of {self.uri}")
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            number = self.part_of(offset + pos)
            start, end = self.part_bounds(number)
            take = min(end - (offset + pos), len(view) - pos)
            if number in self._sent:
                raise SinkProtocolError(f"{self.uri}: bytes at {offset + pos} written twice")
            buf, filled = self._open.get(number) or (self._buffer(end - start), 0)
            at = offset + pos - start
            buf[at : at + take] = view[pos : pos + take]
            filled += take
            pos += take
            if filled == end - start:
                self._open.pop(number, None)
                self._send(number, buf)
            else:
                self._open[number] = (buf, filled)

    def _send(self, number: int, body: bytearray | memoryview) -> None:
        # Deferred: the S3 backend imports boto3, loaded only once an S3 upload runs.
        from ckptconv.storage.s3 import MAX_PARTS

        if number > MAX_PARTS:
            raise StorageError(f"{self.uri} needs more than {MAX_PARTS} parts of {self.part_size} bytes")
        self._raise_failed()
        self._start()
        self._slots.acquire()  # bounded: at most `concurrency` parts in memory in flight
        self._sent.add(number)
        try:
            future = self._pool.submit(self._upload_in_slot, number, [body])
        except BaseException:
            self._slots.release()
            raise
        self._futures.append(future)

    def _upload_in_slot(self, number: int, holder: list[bytearray | memoryview]) -> dict[str, Any]:
        """Upload the part ``holder`` carries, then free its slot once nothing here holds it.

        Why the holder, and the release here rather than in a done callback: the pool thread keeps
        a task's arguments until after its callbacks ran, so a slot freed there let the next part in
        while the sent one was still alive; on a loaded machine every thread of the pool could lag
        so, and a run peaked ``concurrency`` parts over its estimate.
        """
        body = holder.pop()
        try:
            return self._upload_part(number, body)
        finally:
            self._recycle(body)
            del body
            self._slots.release()

    def _buffer(self, size: int) -> bytearray:
        """A buffer for a part of ``size`` bytes: a spare one (its old bytes are all written over
        before it is sent again: a part is sent only once every byte of it was written)."""
        with self._spare_lock:
            for i, buf in enumerate(self._spare):
                if len(buf) == size:
                    return self._spare.pop(i)
        return bytearray(size)

    def _recycle(self, body: bytearray | memoryview) -> None:
        if isinstance(body, bytearray):
            with self._spare_lock:
                if len(self._spare) < self._spare_max:
                    self._spare.append(body)

    def _stop_pool(self, *, cancel: bool = False) -> None:
        """Wait for the parts in flight (dropping those not started when ``cancel``), and free the
        spare buffers."""
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        with self._spare_lock:
            self._spare.clear()

    def _raise_failed(self) -> None:
        for f in self._futures:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def _upload_part(self, number: int, body: bytearray | memoryview) -> dict[str, Any]:
        s = self._storage
        kwargs: dict[str, Any] = {
            "Bucket": self._bucket,
            "Key": self._key,
            "UploadId": self._upload_id,
            "PartNumber": number,
            "Body": bytes(body) if isinstance(body, memoryview) else body,
        }
        if s.part_checksums:
            kwargs["ChecksumAlgorithm"] = "CRC32"
        # Re-sending a part replaces it: safe to retry whatever happened to the earlier try.
        r = s._call(self.uri, s.client.upload_part, **kwargs)
        if self._block_digest:
            self.blocks.add(self.part_bounds(number)[0], body)
        part = {"PartNumber": number, "ETag": r["ETag"]}
        if s.part_checksums and r.get("ChecksumCRC32"):
            part["ChecksumCRC32"] = r["ChecksumCRC32"]
        return part

    def complete(self, size: int) -> ObjectInfo:
        """Send the last part and complete the upload of an object of ``size`` bytes."""
        if self._state != "open":
            raise SinkProtocolError(f"complete of a {self._state} upload of {self.uri}")
        try:
            last = self.part_of(size - 1)
            start, _ = self.part_bounds(last)
            if last == 1 and self._upload_id is None:
                return self._put_whole(size)
            tail = self._open.pop(last, None)
            if tail is not None and tail[1] == size - start:
                self._send(last, memoryview(tail[0])[: size - start])
            missing = [n for n in range(1, last + 1) if n not in self._sent]
            if missing or self._open:
                raise StorageError(
                    f"{self.uri}: parts {missing[:5] or sorted(self._open)[:5]} were not completely written"
                )
            parts = sorted((f.result() for f in self._futures), key=lambda p: p["PartNumber"])
            r = self._storage.complete_upload(
                self.uri, self._bucket, self._key, self._upload_id, parts, overwrite=self._overwrite
            )
        except BaseException:
            self.abort()
            raise
        self._state = "completed"
        self._stop_pool()
        etag = r.get("ETag")
        return ObjectInfo(uri=self.uri, size=size, etag=etag.strip('"') if etag else None)

    def flush(self, size: int) -> list[dict[str, Any]]:
        """Send the parts this process filled (the short last one of an object of ``size`` bytes
        too, when it holds it) and wait for them, without completing: another process completes the
        upload with every process's parts (see :meth:`complete_parts`). Returns ``PartNumber`` and
        ``ETag`` of each part sent here. A part left half filled is an error."""
        try:
            last = self.part_of(size - 1)
            start, _ = self.part_bounds(last)
            tail = self._open.pop(last, None)
            if tail is not None and tail[1] == size - start:
                self._send(last, memoryview(tail[0])[: size - start])
            if self._open:
                raise StorageError(f"{self.uri}: parts {sorted(self._open)[:5]} were not completely written")
            parts = sorted((f.result() for f in self._futures), key=lambda p: p["PartNumber"])
        except BaseException:
            self._state = "aborted"
            self._stop_pool()
            raise
        self._state = "flushed"
        self._stop_pool()
        return parts

    def complete_parts(self, parts: list[dict[str, Any]], size: int) -> ObjectInfo:
        """Complete the upload from parts sent by any process (create-only; idempotent once done)."""
        numbers = [p["PartNumber"] for p in parts]
        expected = list(range(1, self.part_of(size - 1) + 1)) if size else [1]
        if sorted(numbers) != expected:
            raise StorageError(f"{self.uri}: parts {sorted(numbers)[:5]}... do not make parts 1..{expected[-1]}")
        r = self._storage.complete_upload(
            self.uri,
            self._bucket,
            self._key,
            self._start(),
            sorted(parts, key=lambda p: p["PartNumber"]),
            overwrite=self._overwrite,
        )
        self._state = "completed"
        self._stop_pool()
        etag = r.get("ETag")
        return ObjectInfo(uri=self.uri, size=size, etag=etag.strip('"') if etag else None)

    def _put_whole(self, size: int) -> ObjectInfo:
        """An object within the first part: one create-only PutObject, as a streaming writer sends it."""
        buf, filled = self._open.pop(1, (bytearray(), 0))
        if filled != size:
            raise StorageError(f"{self.uri}: {size} bytes announced, {filled} written")
        if self._block_digest:
            self.blocks.add(0, memoryview(buf)[:size])
        info = self._storage.put_object(
            self.uri, memoryview(buf)[:size], overwrite=self._overwrite, metadata=self._metadata
        )
        self._state = "completed"
        self._stop_pool()
        return info

    def stop(self) -> None:
        """Send nothing more from here: parts not yet started are dropped, parts in flight are
        waited for. The upload stays open for whoever owns it (another process completes it, or
        the job's cleanup aborts it). A part that stops on cancel or failure calls this before it
        lets go of its lease, so none of its requests reaches the store after the next owner took
        over. Idempotent."""
        if self._state in ("open", "flushed"):
            self._state = "stopped"
        self._open.clear()
        self._stop_pool(cancel=True)

    def abort(self) -> None:
        """Abort the upload (after the parts in flight ended, or S3 might keep them); idempotent."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._open.clear()
        for f in self._futures:
            with contextlib.suppress(BaseException):
                f.result()
        self._stop_pool()
        if self._upload_id is not None:
            self._storage._abort_upload(self._bucket, self._key, self._upload_id, self.uri)


class PartWriter(Writer):
    """A front-to-back :class:`Writer` over a :class:`PartUpload`: a sequential output (a
    safetensors shard, a torch zip) whose parts go out ``concurrency`` at a time instead of one."""

    def __init__(self, upload: PartUpload) -> None:
        self.uri = upload.uri
        self._upload = upload
        self._pos = 0
        self._info: ObjectInfo | None = None

    @property
    def bytes_written(self) -> int:
        return self._pos

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        try:
            self._upload.write_at(self._pos, view)
        except BaseException:
            self.abort()
            raise
        self._pos += len(view)
        return len(view)

    def commit(self) -> ObjectInfo:
        if self._info is None:
            if self._pos == 0:
                self._upload.abort()
                with self._upload._storage.open_writer(self.uri, overwrite=self._upload._overwrite) as w:
                    w.write(b"")
                self._info = self._upload._storage.stat(self.uri)
            else:
                self._info = self._upload.complete(self._pos)
        return self._info

    def abort(self) -> None:
        self._upload.abort()


def open_output_writer(
    storage: Storage, uri: str, size: int | None = None, *, concurrency: int = DEFAULT_CONCURRENCY, bulk: bool = True
) -> Writer:
    """The writer for one output file: concurrent part uploads on S3 (``concurrency`` parts in
    flight), the storage's own elsewhere: a local file of a known ``size`` is preallocated first,
    and a ``bulk`` one (tensors, not an index) is written around the page cache."""
    if storage.scheme == "s3":
        # The backend drives the multipart calls of this one object (a confined storage checks uri first).
        backend = storage.backend(uri)
        # The file is hashed as it is written (its digest): no block digest of its parts.
        upload = PartUpload(
            backend,  # type: ignore[arg-type]
            uri,
            part_size=DEFAULT_PART_SIZE,
            concurrency=concurrency,
            block_digest=False,
        )
        return PartWriter(upload)
    return announce(storage.open_writer(uri), size, bulk=bulk)


def announce(writer: Writer, size: int | None, *, bulk: bool) -> Writer:
    """``writer``, told what it will hold where it can use it (a local file's): a known ``size``
    is preallocated, and bulk data (tensors, not an index) goes around the page cache. Aborted
    when that fails (a full disk)."""
    preallocate = getattr(writer, "preallocate", None)
    direct = getattr(writer, "stream_direct", None)
    try:
        if size and preallocate is not None:
            preallocate(size)
        elif bulk and direct is not None:
            direct()
    except BaseException:
        writer.abort()
        raise
    return writer


__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_PART_SIZE",
    "PartUpload",
    "PartWriter",
    "announce",
    "open_output_writer",
    "upload_buffer_bytes",
]
