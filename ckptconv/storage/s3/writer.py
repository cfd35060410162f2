"""Streaming writes to S3: one object front to back as a multipart upload (:class:`S3Writer`).

A part is sent as soon as it fills, from a background thread, while the producer fills the next
one (memory: about two parts per writer). Objects smaller than one part are sent with one
``PutObject`` at commit. Part sizes grow with the part number so that S3's 10,000-part limit is
never the reason an upload fails. Writes whose byte layout is known up front and that arrive out of
order go through :mod:`ckptconv.storage.part_upload` instead.
"""

from __future__ import annotations

import binascii
import contextlib
import hashlib
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ckptconv.core.errors import SinkProtocolError, StorageError
from ckptconv.storage.base import ObjectInfo, Writer
from ckptconv.storage.s3.client import clean_etag

if TYPE_CHECKING:
    from ckptconv.storage.s3.storage import S3Storage

# S3's multipart rules: every part but the last >= 5 MiB, no part > 5 GiB, at most 10,000 parts.
MIN_PART_SIZE = 5 << 20
MAX_PART_SIZE = 5 << 30
MAX_PARTS = 10_000
# CopyObject copies at most 5 GiB in one request; larger objects need UploadPartCopy.
MAX_SINGLE_COPY = 5 << 30
# Doubling the part size every this many parts reaches S3's 5 TiB object limit well before part 10,000.
PART_GROWTH_EVERY = 1_000


def part_size_for(part_number: int, base: int) -> int:
    """Size of part ``part_number`` (1-based) for a writer whose first parts are ``base`` bytes.

    Parts double every :data:`PART_GROWTH_EVERY` parts, so 64 MiB parts cover 64 GB with the
    first thousand parts and S3's 5 TiB object limit within the 10,000-part limit.
    """
    size = max(base, MIN_PART_SIZE) << ((part_number - 1) // PART_GROWTH_EVERY)
    return min(size, MAX_PART_SIZE)


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives an object completed from parts with these ETags (MD5 of their MD5s, "-N")."""
    digest = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        digest.update(binascii.unhexlify(etag.strip('"')))
    return f"{digest.hexdigest()}-{len(part_etags)}"


class S3Writer(Writer):
    """One streaming upload. Not thread-safe (one producer); see the module docstring."""

    def __init__(
        self,
        storage: S3Storage,
        uri: str,
        bucket: str,
        key: str,
        *,
        overwrite: bool,
        part_size: int,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.uri = uri
        self._storage = storage
        self._client = storage.client
        self._bucket = bucket
        self._key = key
        self._overwrite = overwrite
        self._base_part_size = max(part_size, MIN_PART_SIZE)
        self._metadata = dict(metadata or {})
        self._buf = bytearray()
        self._written = 0
        self._state = "open"
        self._info: ObjectInfo | None = None
        self._upload_id: str | None = None
        self._next_part = 1
        self._parts: list[dict[str, Any]] = []
        self._pending: Future[dict[str, Any]] | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def bytes_written(self) -> int:
        return self._written

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._state != "open":
            raise SinkProtocolError(f"write to a {self._state} writer for {self.uri}")
        view = memoryview(data).cast("B")
        pos, n = 0, len(view)
        # Copy at most one part's worth at a time: a huge write never doubles in memory.
        while pos < n:
            size = part_size_for(self._next_part, self._base_part_size)
            take = min(size - len(self._buf), n - pos)
            self._buf += view[pos : pos + take]
            pos += take
            if len(self._buf) >= size:
                self._send_part()
        self._written += n
        return n

    def _send_part(self) -> None:
        """Hand the full buffer to the uploader thread; wait first for the part before it (bounded memory)."""
        if self._next_part > MAX_PARTS:
            raise StorageError(f"{self.uri} needs more than {MAX_PARTS} parts", hint="S3 objects are at most 5 TiB")
        if self._upload_id is None:
            self._start_upload()
        body, self._buf = self._buf, bytearray()
        self._wait_pending()
        assert self._executor is not None
        # In a holder the task empties: a pool thread keeps a task's arguments until after its
        # result is set, which would keep this part alive beside the next two.
        self._pending = self._executor.submit(self._upload_held, self._next_part, [body])
        self._next_part += 1

    def _start_upload(self) -> None:
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key}
        if self._metadata:
            kwargs["Metadata"] = self._metadata
        if self._storage.part_checksums:
            # AWS requires the upload to announce the algorithm its parts carry checksums of.
            kwargs["ChecksumAlgorithm"] = "CRC32"
        self._upload_id = self._storage._call(self.uri, self._client.create_multipart_upload, **kwargs)["UploadId"]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s3-upload")

    def _upload_held(self, number: int, holder: list[bytearray]) -> dict[str, Any]:
        return self._upload_part(number, holder.pop())

    def _upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "Bucket": self._bucket,
            "Key": self._key,
            "UploadId": self._upload_id,
            "PartNumber": number,
            "Body": body,
        }
        if self._storage.part_checksums:
            kwargs["ChecksumAlgorithm"] = "CRC32"
        # Re-sending a part replaces it: safe to retry whatever happened to the earlier try.
        r = self._storage._call(self.uri, self._client.upload_part, **kwargs)
        part = {"PartNumber": number, "ETag": r["ETag"]}
        if self._storage.part_checksums and r.get("ChecksumCRC32"):
            part["ChecksumCRC32"] = r["ChecksumCRC32"]
        return part

    def _wait_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._parts.append(pending.result())

    def commit(self) -> ObjectInfo:
        if self._state == "committed":
            assert self._info is not None
            return self._info
        if self._state != "open":
            raise SinkProtocolError(f"commit of an aborted writer for {self.uri}")
        try:
            etag = self._put_whole() if self._upload_id is None else self._complete()
        except BaseException:
            self.abort()
            raise
        self._state = "committed"
        self._shutdown()
        self._info = ObjectInfo(uri=self.uri, size=self._written, etag=clean_etag(etag))
        return self._info

    def _put_whole(self) -> str | None:
        body = bytes(self._buf)
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key, "Body": body}
        self._buf = bytearray()
        if self._metadata:
            kwargs["Metadata"] = self._metadata
        if self._overwrite:
            return self._storage._call(self.uri, self._client.put_object, **kwargs).get("ETag")

        def ours(got: ObjectInfo) -> bool:
            return got.size == len(body) and got.etag == hashlib.md5(body, usedforsecurity=False).hexdigest()

        return self._storage.create_only(self.uri, self._client.put_object, ours=ours, **kwargs).get("ETag")

    def _complete(self) -> str | None:
        if self._buf:
            # The last part may be smaller than 5 MiB.
            self._send_part()
        self._wait_pending()
        assert self._upload_id is not None
        r = self._storage.complete_upload(
            self.uri, self._bucket, self._key, self._upload_id, self._parts, overwrite=self._overwrite
        )
        return r.get("ETag")

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        self._buf = bytearray()
        if self._pending is not None:
            # Abort only after the part in flight ended, or S3 might keep that part.
            with contextlib.suppress(Exception):
                self._pending.result()
            self._pending = None
        self._shutdown()
        if self._upload_id is not None:
            self._storage._abort_upload(self._bucket, self._key, self._upload_id, self.uri)

    def _shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
