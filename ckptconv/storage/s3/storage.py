"""The S3 backend of :class:`~ckptconv.storage.base.Storage` (guarantees: :mod:`ckptconv.storage.s3`)."""

from __future__ import annotations

import contextlib
import io
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from botocore.exceptions import ClientError

from ckptconv.core.errors import InvalidRequest, ObjectNotFound, StorageError, TargetExists, VerificationFailed
from ckptconv.core.fencing import current_attempt
from ckptconv.core.uri import join as join_uri
from ckptconv.core.uri import s3_uri, split_s3
from ckptconv.storage.base import OWNER_METADATA, STREAM_PART_SIZE, ObjectInfo, RangeReader, Storage, Writer
from ckptconv.storage.ranges import check_range, replaced
from ckptconv.storage.retry import RetryPolicy
from ckptconv.storage.s3.client import (
    MAX_POOL_CONNECTIONS,
    TRANSIENT_CODES,
    TruncatedResponse,
    clean_etag,
    error_code,
    make_client,
    not_implemented,
    precondition_failed,
    s3_errors,
    transient,
)
from ckptconv.storage.s3.reads import RangedGets, read_settings
from ckptconv.storage.s3.writer import (
    MAX_PART_SIZE,
    MAX_PARTS,
    MAX_SINGLE_COPY,
    MIN_PART_SIZE,
    S3Writer,
    multipart_etag,
)

log = logging.getLogger(__name__)


class S3Storage(Storage):
    """Objects in S3 or an S3-compatible store. Thread-safe; one instance per endpoint.

    ``part_checksums`` sends CRC32 checksums with every multipart part (what boto3's transfer
    manager does on AWS); by default it follows the client's ``request_checksum_calculation``.
    ``multipart_copy_threshold`` and ``copy_part_size`` choose between ``CopyObject`` and
    ``UploadPartCopy`` in ``publish`` (tests lower them to exercise the multipart path).
    ``max_attempts`` overrides the retry budget of the environment (see :mod:`ckptconv.storage.retry`).
    """

    scheme = "s3"

    def __init__(
        self,
        endpoint_url: str | None = None,
        *,
        client: Any = None,
        max_attempts: int | None = None,
        part_checksums: bool | None = None,
        multipart_copy_threshold: int = MAX_SINGLE_COPY,
        copy_part_size: int = 1 << 30,
    ) -> None:
        concurrency, part_size = read_settings()
        pool = MAX_POOL_CONNECTIONS + concurrency
        self.client = client if client is not None else make_client(endpoint_url, pool_connections=pool)
        self.endpoint_url: str | None = self.client.meta.endpoint_url
        self.retry = RetryPolicy.from_env(max_attempts)
        self._gets = RangedGets(self.client, self._retried, concurrency=concurrency, part_size=part_size)
        if part_checksums is None:
            part_checksums = getattr(self.client.meta.config, "request_checksum_calculation", None) != "when_required"
        self.part_checksums = part_checksums
        self.multipart_copy_threshold = min(multipart_copy_threshold, MAX_SINGLE_COPY)
        self.copy_part_size = min(max(copy_part_size, MIN_PART_SIZE), MAX_PART_SIZE)
        # Cleared the first time the server refuses If-None-Match; HeadObject checks remain.
        self.conditional_writes = True
        # Cleared the first time the server cannot list multipart uploads.
        self.upload_listing = True

    # --- helpers ---------------------------------------------------------------------------

    def _errors(self, uri: str) -> contextlib.AbstractContextManager[None]:
        return s3_errors(uri, self.endpoint_url)

    def _retried(self, uri: str, call: Callable[[], Any], what: str) -> Any:
        """``call()`` under the retry policy; its last error typed for ``uri``."""
        with self._errors(uri):
            return self.retry.run(call, transient=transient, what=f"{what} {uri}")

    def _call(self, uri: str, method: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        """One S3 API call (whose response has no body to stream) under the retry policy."""
        return self._retried(uri, lambda: method(**kwargs), method.__name__)

    def _object(self, uri: str, *, writing: bool = False) -> tuple[str, str]:
        bucket, key = split_s3(uri)
        if not key:
            if writing:
                raise InvalidRequest(f"{uri} names a bucket, not an object", hint="write to s3://bucket/key")
            raise ObjectNotFound(f"{uri} names a bucket, not an object", uri=uri)
        return bucket, key

    def create_only(
        self,
        uri: str,
        call: Callable[..., dict[str, Any]],
        *,
        ours: Callable[[ObjectInfo], bool] | None = None,
        checked: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Run a write that must not replace an existing object at ``uri`` (put, complete, copy).

        Checks with HeadObject first (servers that ignore If-None-Match), then sends the write
        with ``If-None-Match: *`` so that AWS and MinIO refuse it atomically if another writer
        won meanwhile. Raises TargetExists when the object exists. ``ours`` recognizes the
        object this very write creates: when a retry is refused (the object exists, or the
        upload is gone) because an earlier try did succeed, that is success. ``checked``: the
        caller found ``uri`` absent right before (with nothing sent in between): no second HEAD.
        """
        if not checked and self.exists(uri):
            raise TargetExists(f"{uri} already exists", uri=uri)
        tries = 0

        def attempt() -> dict[str, Any]:
            nonlocal tries
            tries += 1
            try:
                if self.conditional_writes:
                    try:
                        return call(IfNoneMatch="*", **kwargs)
                    except ClientError as e:
                        if not not_implemented(e):
                            raise
                        log.info("%s refuses If-None-Match (%s); relying on HEAD checks", self.endpoint_url, e)
                        self.conditional_writes = False
                return call(**kwargs)
            except ClientError as e:
                code, status = error_code(e)
                refused = code in ("PreconditionFailed", "NoSuchUpload", "ConditionalRequestConflict") or status == 412
                if tries > 1 and refused and ours is not None:
                    mine = self._created_by_us(uri, ours)
                    if mine is not None:
                        return mine
                raise

        return self._retried(uri, attempt, call.__name__)

    def _created_by_us(self, uri: str, ours: Callable[[ObjectInfo], bool]) -> dict[str, Any] | None:
        try:
            info = self.stat(uri)
        except ObjectNotFound:
            return None
        if not ours(info):
            return None
        log.info("%s: an earlier try created it; its answer was lost", uri)
        return {"ETag": info.etag}

    # --- Storage ---------------------------------------------------------------------------

    def stat(self, uri: str) -> ObjectInfo:
        return _info_of(uri, self._head(uri, *self._object(uri)))

    def _head(self, uri: str, bucket: str, key: str, etag: str | None = None) -> dict[str, Any]:
        condition = {"IfMatch": _quoted(etag)} if etag else {}

        def attempt() -> dict[str, Any]:
            try:
                r = self.client.head_object(Bucket=bucket, Key=key, **condition)
            except ClientError as e:
                if condition and precondition_failed(e):
                    raise replaced(uri, f"since it was first read (its ETag is no longer {etag})") from None
                raise
            if r.get("ContentLength") is None or r.get("LastModified") is None:
                raise TruncatedResponse("HeadObject answered without Content-Length or Last-Modified")
            return r

        return self._retried(uri, attempt, "head_object")

    def user_metadata(self, uri: str) -> dict[str, str]:
        """The object's user metadata (``x-amz-meta-*``), keys lowercased as S3 returns them."""
        return self.described(uri)[1]

    def described(self, uri: str, *, etag: str | None = None) -> tuple[ObjectInfo, dict[str, str]]:
        """The object's facts and its user metadata, from one HEAD; with ``etag``, of that version
        or refused (CorruptCheckpoint)."""
        head = self._head(uri, *self._object(uri), etag)
        return _info_of(uri, head), dict(head.get("Metadata", {}))

    # The reads take ``etag``: given, every GET is of that version of the object or refused
    # (CorruptCheckpoint), see ckptconv.storage.pinned.

    def read_range(self, uri: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        check_range(uri, offset, length)
        buf = bytearray(length)
        self.read_into(uri, offset, buf, etag=etag)
        return bytes(buf)

    def read_into(self, uri: str, offset: int, buf: bytearray | memoryview, *, etag: str | None = None) -> None:
        """Fill ``buf`` with the bytes at ``offset``: concurrent ranged GETs (:mod:`ckptconv.storage.s3.reads`)."""
        view = memoryview(buf).cast("B")
        check_range(uri, offset, len(view))
        if len(view) == 0:
            return
        bucket, key = self._object(uri)
        self._gets.read_into(uri, bucket, key, offset, view, _quoted(etag))

    def read_scattered(self, uri: str, offset: int, bufs: Sequence[memoryview], *, etag: str | None = None) -> None:
        """Fill ``bufs`` in turn from ``offset``: one GET below :attr:`coalesce_bytes` together."""
        views = [memoryview(b).cast("B") for b in bufs]
        check_range(uri, offset, sum(len(v) for v in views))
        bucket, key = self._object(uri)
        self._gets.read_scattered(uri, bucket, key, offset, views, _quoted(etag))

    def read_head(self, uri: str, length: int, *, offset: int = 0, etag: str | None = None) -> tuple[bytes, ObjectInfo]:
        """One ranged GET: the bytes and, from its headers, the object's size, ETag and mtime (no HEAD)."""
        check_range(uri, offset, length)
        bucket, key = self._object(uri)
        if length == 0:
            return b"", self.stat(uri)
        data, facts = self._gets.read_head(uri, bucket, key, offset, length, _quoted(etag))
        if facts["size"] is None or facts.get("mtime") is None:  # past the end, or a sparse answer
            return data, self.stat(uri)
        info = ObjectInfo(
            uri=uri, size=int(facts["size"]), etag=clean_etag(facts["etag"]), mtime=facts["mtime"].timestamp()
        )
        return data, info

    @property
    def read_concurrency(self) -> int:
        """Ranged GETs in flight at most."""
        return self._gets.concurrency

    @property
    def read_parallelism(self) -> int:  # type: ignore[override]
        # As many values read at once as GETs may be in flight: values of a few MB are one GET each.
        return self._gets.concurrency

    @property
    def read_part_size(self) -> int:
        return self._gets.part_size

    @property
    def coalesce_bytes(self) -> int:  # type: ignore[override]
        # What one GET reads of a single range (RangedGets.read_into).
        return self._gets.one_get_below

    def open_reader(self, uri: str) -> BinaryIO:
        """A buffered, seekable reader over ranged GETs (read-ahead of 8 MiB per request)."""
        info = self.stat(uri)
        return io.BufferedReader(RangeReader(self, uri, info.size), buffer_size=64 << 10)  # type: ignore[return-value]

    def open_writer(
        self,
        uri: str,
        *,
        overwrite: bool = False,
        part_size: int = STREAM_PART_SIZE,
        metadata: Mapping[str, str] | None = None,
    ) -> Writer:
        """A streaming multipart :class:`S3Writer`; ``metadata`` becomes the object's user metadata.

        ``part_size`` below S3's 5 MiB minimum is raised to it.
        """
        bucket, key = self._object(uri, writing=True)
        # Early refusal saves uploading gigabytes that commit would refuse anyway.
        if not overwrite and self.exists(uri):
            raise TargetExists(f"{uri} already exists", uri=uri)
        metadata = self.object_metadata(metadata)
        return S3Writer(self, uri, bucket, key, overwrite=overwrite, part_size=part_size, metadata=metadata)

    def write_bytes(self, uri: str, data: bytes, *, overwrite: bool = False) -> ObjectInfo:
        if len(data) > STREAM_PART_SIZE:
            return super().write_bytes(uri, data, overwrite=overwrite)
        return self.put_object(uri, data, overwrite=overwrite, metadata=self.object_metadata())

    def put_object(
        self, uri: str, data: bytes | bytearray | memoryview, *, overwrite: bool, metadata: Mapping[str, str]
    ) -> ObjectInfo:
        """``data``, held whole in memory, as one PutObject (a streaming upload past
        :data:`STREAM_PART_SIZE`), create-only unless ``overwrite``, with the user ``metadata`` as
        given; its size and ETag (no mtime). The put's own check of the key stands for a writer's
        early one, which only saves uploading what is not yet in memory, and its answer's ETag for
        a HEAD after it."""
        bucket, key = self._object(uri, writing=True)
        writer = S3Writer(self, uri, bucket, key, overwrite=overwrite, part_size=STREAM_PART_SIZE, metadata=metadata)
        with writer:
            writer.write(data)
            return writer.commit()

    def object_metadata(self, metadata: Mapping[str, str] | None = None) -> dict[str, str]:
        """The user metadata of an object written now: ``metadata`` and, inside a job's attempt,
        the job's id under :data:`OWNER_METADATA`.

        A staged object names its job from the start, so publication places it with a plain
        server-side copy that keeps its metadata: naming the job only at the copy (replacing the
        metadata) made servers such as s3rver stream the whole object again.
        """
        attempt = current_attempt()
        owner = {OWNER_METADATA: attempt.job_id} if attempt is not None else {}
        return {**(metadata or {}), **owner}

    def _pages(self, uri: str, method: Callable[..., dict[str, Any]], token: str, **kwargs: Any) -> Iterator[dict]:
        """The pages of a listing call, each page retried on its own."""
        extra: dict[str, Any] = {}
        while True:
            page = self._call(uri, method, **kwargs, **extra)
            yield page
            if not page.get("IsTruncated"):
                return
            if token == "ContinuationToken":
                extra = {"ContinuationToken": page["NextContinuationToken"]}
            else:  # list_multipart_uploads
                extra = {"KeyMarker": page.get("NextKeyMarker"), "UploadIdMarker": page.get("NextUploadIdMarker")}

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Objects whose URI starts with ``prefix``, in S3's order (UTF-8 binary order = sorted by URI).

        Keys ending in ``/`` (the "folder" markers consoles create) are not objects here.
        """
        bucket, key_prefix = split_s3(prefix)
        for page in self._pages(
            prefix, self.client.list_objects_v2, "ContinuationToken", Bucket=bucket, Prefix=key_prefix
        ):
            for obj in page.get("Contents", ()):
                if obj["Key"].endswith("/"):
                    continue
                yield ObjectInfo(
                    uri=s3_uri(bucket, obj["Key"]),
                    size=int(obj["Size"]),
                    etag=clean_etag(obj.get("ETag")),
                    mtime=obj["LastModified"].timestamp(),
                )

    def delete(self, uri: str) -> None:
        bucket, key = self._object(uri, writing=True)
        self._call(uri, self.client.delete_object, Bucket=bucket, Key=key)

    def delete_owned(self, uri: str, owner: str) -> bool:
        """Delete the object at ``uri`` if its metadata names ``owner`` (:data:`OWNER_METADATA`);
        False, deleting nothing, when it does not. The delete is conditional on the ETag of the
        object checked (``If-Match``): one another writer put there after the check stays (a 412),
        unless it has the very same bytes, which S3 cannot tell apart. ObjectNotFound when nothing
        is at ``uri``."""
        bucket, key = self._object(uri, writing=True)
        head = self._head(uri, bucket, key)
        if head.get("Metadata", {}).get(OWNER_METADATA) != owner:
            return False
        try:
            self._call(uri, self.client.delete_object, Bucket=bucket, Key=key, IfMatch=head["ETag"])
        except TargetExists:  # a 412: replaced since the check
            return False
        return True

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` (folder markers included) in batches of 1000, and
        abort the incomplete multipart uploads under it.

        Refuses an empty key prefix: that would empty the whole bucket.
        """
        bucket, key_prefix = split_s3(prefix)
        if not key_prefix:
            raise InvalidRequest(
                f"refusing to delete every object in bucket {bucket!r}", hint="name a narrower prefix", uri=prefix
            )
        n = 0
        # Listing again after each batch: deleting while paginating would skip keys on some servers.
        while True:
            page = self._call(prefix, self.client.list_objects_v2, Bucket=bucket, Prefix=key_prefix)
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", ())]
            if not keys:
                break
            self._delete_batch(prefix, bucket, keys)
            n += len(keys)
        self.abort_uploads(prefix)
        return n

    def _delete_batch(self, prefix: str, bucket: str, keys: list[dict[str, str]]) -> None:
        pending = keys

        def attempt() -> None:
            nonlocal pending
            r = self.client.delete_objects(Bucket=bucket, Delete={"Objects": pending, "Quiet": True})
            errors = r.get("Errors") or []
            if not errors:
                return
            first = errors[0]
            if all(err.get("Code") in TRANSIENT_CODES for err in errors):
                pending = [{"Key": err["Key"]} for err in errors]
                raise TruncatedResponse(f"{len(errors)} deletions under {prefix} failed ({first.get('Code')})")
            raise StorageError(
                f"could not delete {len(errors)} objects under {prefix}, e.g. {first.get('Key')}: "
                f"{first.get('Code')} {first.get('Message', '')}".rstrip(),
                uri=prefix,
            )

        self._retried(prefix, attempt, "delete_objects")

    def abort_uploads(self, prefix: str, *, exact: bool = False) -> int:
        """Abort every incomplete multipart upload whose key starts with ``prefix``'s key (with
        ``exact``: whose key is that key).

        Servers that cannot list uploads (s3rver) are skipped: writers abort their own uploads."""
        if not self.upload_listing:
            return 0
        bucket, key_prefix = split_s3(prefix)
        try:
            uploads = [
                (u["Key"], u["UploadId"])
                for page in self._pages(
                    prefix, self.client.list_multipart_uploads, "KeyMarker", Bucket=bucket, Prefix=key_prefix
                )
                for u in page.get("Uploads", ())
                if not exact or u["Key"] == key_prefix
            ]
        except StorageError as e:
            if not (isinstance(e.__cause__, ClientError) and not_implemented(e.__cause__)):
                raise
            log.info("%s cannot list multipart uploads (%s)", self.endpoint_url, e)
            self.upload_listing = False
            return 0
        for key, upload_id in uploads:
            self._abort_upload(bucket, key, upload_id, s3_uri(bucket, key))
        return len(uploads)

    def abort_publication(self, uri: str, size: int) -> int:
        """Abort the unfinished multipart uploads at exactly ``uri`` that a publication of a
        ``size``-byte object there, killed mid-copy, may have left: none for an object ``publish``
        copies in one CopyObject, which leaves no upload (nor lists uploads for nothing)."""
        if size <= self.multipart_copy_threshold:
            return 0
        return self.abort_uploads(uri, exact=True)

    def publish(self, pairs: Iterable[tuple[str, str]], *, overwrite: bool = False, owner: str | None = None) -> None:
        """Copy each staging object to its final key (server-side), in order, then delete the staging
        key (a delete that fails is logged, not raised: the final object is in place). With an
        ``owner``, each copy names it in its user metadata (:data:`OWNER_METADATA`): a staged
        object that names it already (written inside its attempt: :meth:`object_metadata`) is
        copied with its metadata as it is.

        Every source is checked to exist, and (unless ``overwrite``) every target to be absent,
        before the first copy, so a refused publish changes nothing.
        """
        pairs = list(pairs)
        heads = [self._head(src, *self._object(src)) for src, _ in pairs]
        if not overwrite:
            for _, dst in pairs:
                if self.exists(dst):
                    raise TargetExists(f"{dst} already exists", uri=dst)
        for i, ((src, dst), head) in enumerate(zip(pairs, heads, strict=True)):
            info = _info_of(src, head)
            if info.size <= self.multipart_copy_threshold:
                # The first copy follows the check of its target: no second HEAD of it before.
                self._copy_object(src, dst, info, head, overwrite=overwrite, owner=owner, checked=i == 0)
            else:
                self._copy_multipart(src, dst, info, overwrite=overwrite, owner=owner)
            try:
                self.delete(src)
            except StorageError as e:
                # ``dst`` is placed: raising now would leave it to a caller that removes only what
                # a publish it saw succeed placed. The staged copy goes with its staging area.
                log.warning("published %s but could not remove its staged copy %s: %s", dst, src, e)

    def _copy_object(
        self,
        src: str,
        dst: str,
        info: ObjectInfo,
        head: dict[str, Any],
        *,
        overwrite: bool,
        owner: str | None,
        checked: bool = False,
    ) -> None:
        """CopyObject of ``src`` (``info``, and ``head`` the HeadObject answer it was read from) to ``dst``."""
        src_bucket, src_key = self._object(src)
        bucket, key = self._object(dst, writing=True)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "CopySource": {"Bucket": src_bucket, "Key": src_key}}
        if owner is not None and head.get("Metadata", {}).get(OWNER_METADATA) != owner:
            # Staged outside the job's attempt (object_metadata did not name it): the copy names
            # it. Replacing the metadata replaces all of it: the source's is carried over by hand,
            # and some servers stream the whole object again for it (a plain copy keeps it as is).
            kwargs["MetadataDirective"] = "REPLACE"
            kwargs["Metadata"] = {**head.get("Metadata", {}), OWNER_METADATA: owner}
            if head.get("ContentType"):
                kwargs["ContentType"] = head["ContentType"]
        # Copy only the object publish checked (``info``): one replaced since would publish bytes
        # that no checksum of this job describes.
        if info.etag:
            kwargs["CopySourceIfMatch"] = f'"{info.etag}"'
        try:
            if overwrite:
                self._call(dst, self.client.copy_object, **kwargs)
            else:
                self.create_only(
                    dst, self.client.copy_object, ours=lambda got: _same_object(got, info), checked=checked, **kwargs
                )
        except TargetExists as e:
            # A 412 answers either precondition: If-None-Match (an object is at ``dst``) or
            # CopySourceIfMatch (the source changed). Only the target's presence tells which.
            refused = isinstance(e.__cause__, ClientError) and precondition_failed(e.__cause__)
            if refused and info.etag and (overwrite or not self.exists(dst)):
                raise _source_changed(src) from None
            raise

    def _copy_multipart(self, src: str, dst: str, info: ObjectInfo, *, overwrite: bool, owner: str | None) -> None:
        src_bucket, src_key = self._object(src)
        bucket, key = self._object(dst, writing=True)
        head = self._head(src, src_bucket, src_key)
        # Every part copies the object publish checked (``info``): parts read from two objects, or
        # from one replaced since, would publish bytes that no checksum of this job describes.
        if int(head["ContentLength"]) != info.size or clean_etag(head.get("ETag")) != info.etag:
            raise _source_changed(src)
        pinned = {"CopySourceIfMatch": f'"{info.etag}"'} if info.etag else {}
        metadata = {**head.get("Metadata", {}), **({OWNER_METADATA: owner} if owner is not None else {})}
        create: dict[str, Any] = {"Bucket": bucket, "Key": key, "Metadata": metadata}
        if head.get("ContentType"):
            create["ContentType"] = head["ContentType"]
        size = info.size
        part = max(self.copy_part_size, math.ceil(size / MAX_PARTS))
        ranges = [(number, start, min(start + part, size) - 1) for number, start in enumerate(range(0, size, part), 1)]
        upload_id = self._call(dst, self.client.create_multipart_upload, **create)["UploadId"]

        def copy_part(number: int, start: int, end: int) -> dict[str, Any]:
            def attempt() -> dict[str, Any]:
                try:
                    return self.client.upload_part_copy(
                        Bucket=bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                        CopySource={"Bucket": src_bucket, "Key": src_key},
                        CopySourceRange=f"bytes={start}-{end}",
                        **pinned,
                    )
                except ClientError as e:
                    if pinned and precondition_failed(e):
                        raise _source_changed(src) from None
                    raise

            r = self._retried(dst, attempt, "upload_part_copy")
            return {"PartNumber": number, "ETag": r["CopyPartResult"]["ETag"]}

        try:
            # Parts are copied by the server, several at a time (as many as ranged GETs may be in
            # flight: the client's connection pool has room for them). One at a time, a 1 TB file's
            # 1 GiB parts would take the server's per-request copy rate a thousand times over.
            with ThreadPoolExecutor(min(self.read_concurrency, len(ranges)), thread_name_prefix="s3-copy") as pool:
                futures = [pool.submit(copy_part, *r) for r in ranges]
                try:
                    parts = [f.result() for f in futures]
                except BaseException:
                    for f in futures:
                        f.cancel()  # those not started; the pool waits for the others before the abort
                    raise
            self.complete_upload(dst, bucket, key, upload_id, parts, overwrite=overwrite)
        except BaseException:
            self._abort_upload(bucket, key, upload_id, dst)
            raise

    def complete_upload(
        self, uri: str, bucket: str, key: str, upload_id: str, parts: list[dict[str, Any]], *, overwrite: bool
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "Bucket": bucket,
            "Key": key,
            "UploadId": upload_id,
            "MultipartUpload": {"Parts": parts},
        }
        if overwrite:
            return self._call(uri, self.client.complete_multipart_upload, **kwargs)
        expected = multipart_etag([p["ETag"] for p in parts])
        return self.create_only(
            uri, self.client.complete_multipart_upload, ours=lambda got: got.etag == expected, **kwargs
        )

    def _abort_upload(self, bucket: str, key: str, upload_id: str, uri: str) -> None:
        """Best effort: a failure here must not hide the error that made us abort."""
        try:
            self._call(uri, self.client.abort_multipart_upload, Bucket=bucket, Key=key, UploadId=upload_id)
        except StorageError as e:
            if not (isinstance(e.__cause__, ClientError) and error_code(e.__cause__)[0] == "NoSuchUpload"):
                log.warning("could not abort multipart upload %s of %s: %s", upload_id, uri, e)

    def join(self, base: str, *parts: str) -> str:
        return join_uri(base, *parts)


def _info_of(uri: str, head: dict[str, Any]) -> ObjectInfo:
    """The facts of a HeadObject answer."""
    size, etag, mtime = int(head["ContentLength"]), clean_etag(head.get("ETag")), head["LastModified"].timestamp()
    return ObjectInfo(uri=uri, size=size, etag=etag, mtime=mtime)


def _source_changed(uri: str) -> VerificationFailed:
    return VerificationFailed(f"{uri} changed after publication checked it; nothing was published from it", uri=uri)


def _same_object(got: ObjectInfo, source: ObjectInfo) -> bool:
    """Whether ``got`` is a server-side copy of ``source`` (a copy keeps the ETag of a plain object)."""
    return got.size == source.size and got.etag is not None and got.etag == source.etag


def _quoted(etag: str | None) -> str | None:
    """An ETag as S3 sends it, for an ``If-Match`` (ObjectInfo keeps it without quotes)."""
    return f'"{etag}"' if etag else None
