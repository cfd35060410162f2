"""S3 and S3-compatible storage (AWS, MinIO, Ceph, moto) on boto3; the only module that imports boto3.

Guarantees on top of the :class:`~ckptconv.storage.base.Storage` contract:

- The client comes from the standard AWS environment (credentials chain, ``AWS_ENDPOINT_URL`` /
  ``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION``) with a connection pool sized for a few
  threads. A boto3 client is thread-safe, so one :class:`S3Storage` serves every thread.
- Every call retries per the one policy of :mod:`ckptconv.storage.retry` (botocore's own retries
  are off): 5xx and throttling answers, connection errors, stalled responses (no byte for
  ``CKPTCONV_S3_READ_TIMEOUT_S``, default 60) and bodies shorter than announced, or without a
  length and short. A ranged read broken mid-body asks only for the bytes it still lacks. Past
  the budget the call fails with :class:`~ckptconv.core.errors.StorageError`.
- A create-only write retried after an answer was lost may find the object it created itself: the
  object's ETag tells (the MD5 of a put, the multipart ETag of a completed upload, the source's
  ETag of a copy), and then the write succeeded.
- Writes are streaming multipart uploads: a part is sent as soon as it fills, from a background
  thread, while the producer fills the next one (memory: about two parts per writer). Objects
  smaller than one part are sent with one ``PutObject`` at commit. Part sizes grow with the part
  number so that S3's 10,000-part limit is never the reason an upload fails.
- Create-only commits (``overwrite=False``) send ``If-None-Match: *`` (atomic on AWS and MinIO)
  and also check with ``HeadObject`` first, because some servers ignore the header. Servers that
  reject the header get the check alone.
- ``publish`` copies server-side (``CopyObject`` up to 5 GiB, ``UploadPartCopy`` beyond), then
  deletes the staging key. Nothing is renamed: S3 has no rename.
- An abandoned writer (neither committed nor aborted) leaves an incomplete multipart upload that
  S3 keeps (and bills) until aborted; always use writers as context managers. ``delete_prefix``
  also aborts the incomplete uploads under the prefix (staging areas are discarded that way, also
  after a crash). A bucket lifecycle rule ``AbortIncompleteMultipartUpload`` is the backstop.
"""

from __future__ import annotations

import binascii
import concurrent.futures
import contextlib
import hashlib
import io
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

import boto3
import urllib3.exceptions
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from ckptconv.core.errors import InvalidRequest, ObjectNotFound, StorageError, TargetExists
from ckptconv.core.sizes import parse_size
from ckptconv.core.uri import join as join_uri
from ckptconv.core.uri import s3_uri, split_s3
from ckptconv.storage.base import ObjectInfo, RangeReader, Storage, Writer
from ckptconv.storage.ranges import check_range, short_read
from ckptconv.storage.retry import RetryPolicy

log = logging.getLogger(__name__)

# S3's multipart rules: every part but the last >= 5 MiB, no part > 5 GiB, at most 10,000 parts.
MIN_PART_SIZE = 5 << 20
MAX_PART_SIZE = 5 << 30
MAX_PARTS = 10_000
# CopyObject copies at most 5 GiB in one request; larger objects need UploadPartCopy.
MAX_SINGLE_COPY = 5 << 30
# Doubling the part size every this many parts reaches S3's 5 TiB object limit well before part 10,000.
PART_GROWTH_EVERY = 1_000
# A handful of engine threads plus one background uploader per open writer (plus the parallel reads).
MAX_POOL_CONNECTIONS = 16
# Ranged GETs of one read in flight at once (CKPTCONV_S3_READ_CONCURRENCY), each of
# CKPTCONV_S3_READ_PART_SIZE bytes (default 16 MiB).
DEFAULT_READ_CONCURRENCY = 8
# A response that sends no byte for this long is a stalled connection: retried.
DEFAULT_READ_TIMEOUT_S = 60.0
# Body bytes taken from the connection per read call (what a broken connection can cost).
READ_SLICE = 1 << 20

_CREDENTIALS_HINT = (
    "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the instance role) "
    "and that they may access this bucket; without s3:ListBucket, S3 answers 403 also for missing objects"
)
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_DENIED_CODES = {
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
}
# Answers that say "try again": server errors and throttling.
_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "OperationAborted",
}
# Transport failures: the connection could not be made, broke, stalled, or ended a body early.
_TRANSPORT_ERRORS = (
    HTTPClientError,  # ResponseStreamingError, ReadTimeoutError, ConnectionClosedError, ...
    BotoConnectionError,  # EndpointConnectionError, ConnectTimeoutError
    IncompleteReadError,
    urllib3.exceptions.HTTPError,  # raised by body reads on the raw stream
    OSError,  # ConnectionResetError and friends from the socket itself
)


class TruncatedResponse(Exception):
    """A response that is not what HTTP promised: a body shorter than its length, or no length.

    Transient (the next try usually gets it whole), never a checkpoint's fault."""


def _transient(e: BaseException) -> bool:
    """Whether retrying ``e`` may succeed (the policy in :mod:`ckptconv.storage.retry` decides how often)."""
    if isinstance(e, ClientError):
        code, status = _error_code(e)
        return code in _TRANSIENT_CODES or status == 429 or (status is not None and status >= 500 and status != 501)
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return False
    return isinstance(e, (TruncatedResponse, *_TRANSPORT_ERRORS))


def part_size_for(part_number: int, base: int) -> int:
    """Size of part ``part_number`` (1-based) for a writer whose first parts are ``base`` bytes.

    Parts double every :data:`PART_GROWTH_EVERY` parts, so 64 MiB parts cover 64 GB with the
    first thousand parts and S3's 5 TiB object limit within the 10,000-part limit.
    """
    size = max(base, MIN_PART_SIZE) << ((part_number - 1) // PART_GROWTH_EVERY)
    return min(size, MAX_PART_SIZE)


def endpoint_from_env() -> str | None:
    """The endpoint boto3 would use from the environment (service-specific variable first)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def make_client(endpoint_url: str | None = None, *, pool_connections: int = MAX_POOL_CONNECTIONS) -> Any:
    """A boto3 S3 client configured from the environment; ``endpoint_url`` overrides it.

    botocore does not retry: :class:`S3Storage` retries every call per its one policy.
    """
    endpoint = endpoint_url or endpoint_from_env()
    options: dict[str, Any] = {
        "retries": {"mode": "standard", "total_max_attempts": 1},
        "max_pool_connections": pool_connections,
        "connect_timeout": 10,
        # Long server-side operations (CompleteMultipartUpload, large copies) keep the connection
        # alive with whitespace on AWS, so a silent connection is a stalled one.
        "read_timeout": float(os.environ.get("CKPTCONV_S3_READ_TIMEOUT_S", DEFAULT_READ_TIMEOUT_S)),
        "tcp_keepalive": True,
    }
    if endpoint:
        # Custom endpoints (MinIO in docker-compose, moto in tests) are rarely set up for
        # virtual-hosted buckets (bucket.host), so address buckets by path.
        options["s3"] = {"addressing_style": "path"}
        # boto3 >= 1.36 adds CRC checksums to every upload by default, which several S3-compatible
        # servers reject; unless the environment says otherwise, send them only where S3 requires them.
        if "AWS_REQUEST_CHECKSUM_CALCULATION" not in os.environ:
            options["request_checksum_calculation"] = "when_required"
        if "AWS_RESPONSE_CHECKSUM_VALIDATION" not in os.environ:
            options["response_checksum_validation"] = "when_required"
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint, config=Config(**options))


def _etag(value: str | None) -> str | None:
    return value.strip('"') if value else None


def _error_code(e: ClientError) -> tuple[str, int | None]:
    code = str(e.response.get("Error", {}).get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, status


def _typed_error(e: ClientError, uri: str) -> Exception:
    """The ckptconv error for a failed S3 call on ``uri``."""
    code, status = _error_code(e)
    message = e.response.get("Error", {}).get("Message") or code
    bucket = uri[len("s3://") :].partition("/")[0]
    if code == "NoSuchBucket":
        return ObjectNotFound(
            f"bucket {bucket!r} does not exist ({uri})",
            hint=f"check the bucket name in the URI, or create bucket {bucket!r}",
            uri=uri,
        )
    if code == "NoSuchUpload":
        return StorageError(
            f"the multipart upload of {uri} no longer exists (aborted elsewhere, or expired by a lifecycle rule)",
            hint="retry the write",
            uri=uri,
        )
    if code in _NOT_FOUND_CODES or status == 404:
        return ObjectNotFound(f"no object at {uri}", uri=uri)
    if code in _DENIED_CODES or status == 403:
        return StorageError(f"access denied to {uri} ({code}: {message})", hint=_CREDENTIALS_HINT, uri=uri)
    if code in ("PreconditionFailed", "412") or status == 412:
        # Only create-only writes send preconditions (If-None-Match: *).
        return TargetExists(f"{uri} already exists", uri=uri)
    if code == "ConditionalRequestConflict":
        return TargetExists(
            f"another writer is creating {uri} at the same time",
            hint="only one of two concurrent writers of the same object can win; choose another target",
            uri=uri,
        )
    return StorageError(
        f"S3 {e.operation_name} failed for {uri}: {code} {message}".rstrip(),
        uri=uri,
        s3_code=code,
        http_status=status,
    )


@contextlib.contextmanager
def _s3_errors(uri: str, endpoint: str | None = None) -> Iterator[None]:
    """Translate botocore exceptions raised inside the block into typed ckptconv errors."""
    try:
        yield
    except ClientError as e:
        raise _typed_error(e, uri) from e
    except (NoCredentialsError, PartialCredentialsError) as e:
        raise StorageError(f"no usable AWS credentials for {uri}: {e}", hint=_CREDENTIALS_HINT, uri=uri) from e
    except TruncatedResponse as e:
        raise StorageError(f"S3 answered {uri} with a broken response: {e}", hint="retry the job", uri=uri) from e
    except (EndpointConnectionError, ConnectTimeoutError, ConnectionClosedError) as e:
        where = endpoint or "the S3 endpoint"
        raise StorageError(
            f"cannot reach {where} for {uri}: {e}",
            hint="check AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3), the network, and that the object store is up",
            uri=uri,
        ) from e
    except (BotoCoreError, urllib3.exceptions.HTTPError, OSError) as e:
        raise StorageError(f"S3 request for {uri} failed: {type(e).__name__}: {e}", uri=uri) from e


def _not_implemented(e: ClientError) -> bool:
    """True when a server refuses a feature itself (``If-None-Match``, listing uploads), not the request."""
    code, status = _error_code(e)
    return status == 501 or code == "NotImplemented"


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
        env = os.environ
        self.read_concurrency = max(1, int(env.get("CKPTCONV_S3_READ_CONCURRENCY", DEFAULT_READ_CONCURRENCY)))
        self.read_part_size = max(MIN_PART_SIZE, parse_size(env.get("CKPTCONV_S3_READ_PART_SIZE", "16MiB")))
        pool = MAX_POOL_CONNECTIONS + self.read_concurrency
        self.client = client if client is not None else make_client(endpoint_url, pool_connections=pool)
        self.endpoint_url: str | None = self.client.meta.endpoint_url
        self.retry = RetryPolicy.from_env(max_attempts)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
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
        return _s3_errors(uri, self.endpoint_url)

    def _retried(self, uri: str, call: Callable[[], Any], what: str) -> Any:
        """``call()`` under the retry policy; its last error typed for ``uri``."""
        with self._errors(uri):
            return self.retry.run(call, transient=_transient, what=f"{what} {uri}")

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
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Run a write that must not replace an existing object at ``uri`` (put, complete, copy).

        Checks with HeadObject first (servers that ignore If-None-Match), then sends the write
        with ``If-None-Match: *`` so that AWS and MinIO refuse it atomically if another writer
        won meanwhile. Raises TargetExists when the object exists. ``ours`` recognizes the
        object this very write creates: when a retry is refused (the object exists, or the
        upload is gone) because an earlier try did succeed, that is success.
        """
        if self.exists(uri):
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
                        if not _not_implemented(e):
                            raise
                        log.info("%s refuses If-None-Match (%s); relying on HEAD checks", self.endpoint_url, e)
                        self.conditional_writes = False
                return call(**kwargs)
            except ClientError as e:
                code, status = _error_code(e)
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
        bucket, key = self._object(uri)
        r = self._head(uri, bucket, key)
        return ObjectInfo(
            uri=uri, size=int(r["ContentLength"]), etag=_etag(r.get("ETag")), mtime=r["LastModified"].timestamp()
        )

    def _head(self, uri: str, bucket: str, key: str) -> dict[str, Any]:
        def attempt() -> dict[str, Any]:
            r = self.client.head_object(Bucket=bucket, Key=key)
            if r.get("ContentLength") is None or r.get("LastModified") is None:
                raise TruncatedResponse("HeadObject answered without Content-Length or Last-Modified")
            return r

        return self._retried(uri, attempt, "head_object")

    def user_metadata(self, uri: str) -> dict[str, str]:
        """The object's user metadata (``x-amz-meta-*``), keys lowercased as S3 returns them."""
        bucket, key = self._object(uri)
        return dict(self._head(uri, bucket, key).get("Metadata", {}))

    def read_range(self, uri: str, offset: int, length: int) -> bytes:
        check_range(uri, offset, length)
        buf = bytearray(length)
        self.read_into(uri, offset, buf)
        return bytes(buf)

    def read_into(self, uri: str, offset: int, buf: bytearray | memoryview) -> None:
        """Fill ``buf`` with the bytes at ``offset``.

        A range longer than ``read_part_size`` is fetched as parts of that size, up to
        ``read_concurrency`` ranged GETs at a time, each straight into its slice of ``buf`` (one
        connection tops out far below what a store serves to several). Each part is retried per
        the policy on its own; a retry after a broken body asks only for the bytes still missing.
        """
        view = memoryview(buf).cast("B")
        length = len(view)
        check_range(uri, offset, length)
        if length == 0:
            return
        bucket, key = self._object(uri)
        part = self.read_part_size
        if self.read_concurrency <= 1 or length < 2 * part:
            self._read_part(uri, bucket, key, offset, view)
            return
        futures = [
            self._read_pool().submit(self._read_part, uri, bucket, key, offset + start, view[start : start + part])
            for start in range(0, length, part)
        ]
        try:
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)  # no part may write into buf after we return

    def _read_part(self, uri: str, bucket: str, key: str, offset: int, view: memoryview) -> None:
        done = [0]  # bytes in place so far; survives the failed tries

        def attempt() -> None:
            self._get_into(uri, bucket, key, offset, view, done)

        self._retried(uri, attempt, "get_object")

    def _read_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.read_concurrency, thread_name_prefix="s3-read")
            return self._pool

    def _get_into(self, uri: str, bucket: str, key: str, offset: int, view: memoryview, done: list[int]) -> None:
        """One ranged GET of ``view[done[0]:]``; advances ``done[0]`` as bytes arrive."""
        length = len(view)
        start = offset + done[0]
        try:
            r = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{offset + length - 1}")
        except ClientError as e:
            code, status = _error_code(e)
            if code == "InvalidRange" or status == 416:  # the range starts at or past the end
                size = e.response.get("Error", {}).get("ActualObjectSize")
                raise short_read(uri, offset, length, done[0], int(size) if size else None) from None
            raise
        body = r["Body"]
        try:
            skip, _end, total = _served_range(r.get("ContentRange"), start)
            announced = r.get("ContentLength")
            raw = body._raw_stream  # readinto: straight into the caller's buffer, no intermediate copy
            _skip(raw, skip)  # a server that ignored Range sends the object from byte 0
            while done[0] < length:
                # In slices: a read that fails mid-way loses what it had, so keep each one small.
                n = raw.readinto(view[done[0] : done[0] + READ_SLICE])
                if not n:
                    break
                done[0] += n
            if done[0] == length:
                return
            got = done[0] - (start - offset)
            if (total is not None and start + got >= total) or (announced is not None and skip + got >= announced):
                # The response is whole and still short: the object itself ends early.
                raise short_read(uri, offset, length, done[0], total)
            raise TruncatedResponse(f"the body ended after {got} bytes of the range from offset {start}")
        finally:
            body.close()

    def open_reader(self, uri: str) -> BinaryIO:
        """A buffered, seekable reader over ranged GETs (read-ahead of 8 MiB per request)."""
        info = self.stat(uri)
        return io.BufferedReader(RangeReader(self, uri, info.size), buffer_size=64 << 10)  # type: ignore[return-value]

    def open_writer(
        self,
        uri: str,
        *,
        overwrite: bool = False,
        part_size: int = 64 << 20,
        metadata: Mapping[str, str] | None = None,
    ) -> Writer:
        """A streaming multipart :class:`S3Writer`; ``metadata`` becomes the object's user metadata.

        ``part_size`` below S3's 5 MiB minimum is raised to it.
        """
        bucket, key = self._object(uri, writing=True)
        # Early refusal saves uploading gigabytes that commit would refuse anyway.
        if not overwrite and self.exists(uri):
            raise TargetExists(f"{uri} already exists", uri=uri)
        return S3Writer(self, uri, bucket, key, overwrite=overwrite, part_size=part_size, metadata=metadata)

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
                    etag=_etag(obj.get("ETag")),
                    mtime=obj["LastModified"].timestamp(),
                )

    def delete(self, uri: str) -> None:
        bucket, key = self._object(uri, writing=True)
        self._call(uri, self.client.delete_object, Bucket=bucket, Key=key)

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
            if all(err.get("Code") in _TRANSIENT_CODES for err in errors):
                pending = [{"Key": err["Key"]} for err in errors]
                raise TruncatedResponse(f"{len(errors)} deletions under {prefix} failed ({first.get('Code')})")
            raise StorageError(
                f"could not delete {len(errors)} objects under {prefix}, e.g. {first.get('Key')}: "
                f"{first.get('Code')} {first.get('Message', '')}".rstrip(),
                uri=prefix,
            )

        self._retried(prefix, attempt, "delete_objects")

    def abort_uploads(self, prefix: str) -> int:
        """Abort every incomplete multipart upload whose key starts with ``prefix``'s key.

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
            ]
        except StorageError as e:
            if not (isinstance(e.__cause__, ClientError) and _not_implemented(e.__cause__)):
                raise
            log.info("%s cannot list multipart uploads (%s)", self.endpoint_url, e)
            self.upload_listing = False
            return 0
        for key, upload_id in uploads:
            self._abort_upload(bucket, key, upload_id, s3_uri(bucket, key))
        return len(uploads)

    def publish(self, pairs: Iterable[tuple[str, str]], *, overwrite: bool = False) -> None:
        """Copy each staging object to its final key (server-side), in order, then delete the staging key.

        Every source is checked to exist, and (unless ``overwrite``) every target to be absent,
        before the first copy, so a refused publish changes nothing.
        """
        pairs = list(pairs)
        infos = [self.stat(src) for src, _ in pairs]
        if not overwrite:
            for _, dst in pairs:
                if self.exists(dst):
                    raise TargetExists(f"{dst} already exists", uri=dst)
        for (src, dst), info in zip(pairs, infos, strict=True):
            if info.size <= self.multipart_copy_threshold:
                self._copy_object(src, dst, info, overwrite=overwrite)
            else:
                self._copy_multipart(src, dst, info.size, overwrite=overwrite)
            self.delete(src)

    def _copy_object(self, src: str, dst: str, info: ObjectInfo, *, overwrite: bool) -> None:
        src_bucket, src_key = self._object(src)
        bucket, key = self._object(dst, writing=True)
        kwargs = {"Bucket": bucket, "Key": key, "CopySource": {"Bucket": src_bucket, "Key": src_key}}
        if overwrite:
            self._call(dst, self.client.copy_object, **kwargs)
        else:
            self.create_only(dst, self.client.copy_object, ours=lambda got: _same_object(got, info), **kwargs)

    def _copy_multipart(self, src: str, dst: str, size: int, *, overwrite: bool) -> None:
        src_bucket, src_key = self._object(src)
        bucket, key = self._object(dst, writing=True)
        head = self._head(src, src_bucket, src_key)
        create: dict[str, Any] = {"Bucket": bucket, "Key": key, "Metadata": head.get("Metadata", {})}
        if head.get("ContentType"):
            create["ContentType"] = head["ContentType"]
        part = max(self.copy_part_size, math.ceil(size / MAX_PARTS))
        upload_id = self._call(dst, self.client.create_multipart_upload, **create)["UploadId"]
        try:
            parts = []
            for number, start in enumerate(range(0, size, part), start=1):
                end = min(start + part, size) - 1
                r = self._call(
                    dst,
                    self.client.upload_part_copy,
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource={"Bucket": src_bucket, "Key": src_key},
                    CopySourceRange=f"bytes={start}-{end}",
                )
                parts.append({"PartNumber": number, "ETag": r["CopyPartResult"]["ETag"]})
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
            if not (isinstance(e.__cause__, ClientError) and _error_code(e.__cause__)[0] == "NoSuchUpload"):
                log.warning("could not abort multipart upload %s of %s: %s", upload_id, uri, e)

    def join(self, base: str, *parts: str) -> str:
        return join_uri(base, *parts)


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


def _skip(raw: Any, n: int) -> None:
    while n > 0:
        chunk = raw.read(min(n, 1 << 20))
        if not chunk:
            raise TruncatedResponse("the response ended before the requested range")
        n -= len(chunk)


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives an object completed from parts with these ETags (MD5 of their MD5s, "-N")."""
    digest = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        digest.update(binascii.unhexlify(etag.strip('"')))
    return f"{digest.hexdigest()}-{len(part_etags)}"


def _same_object(got: ObjectInfo, source: ObjectInfo) -> bool:
    """Whether ``got`` is a server-side copy of ``source`` (a copy keeps the ETag of a plain object)."""
    return got.size == source.size and got.etag is not None and got.etag == source.etag


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
            raise ValueError(f"write to a {self._state} writer for {self.uri}")
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
        self._pending = self._executor.submit(self._upload_part, self._next_part, body)
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
            raise ValueError(f"commit of an aborted writer for {self.uri}")
        try:
            etag = self._put_whole() if self._upload_id is None else self._complete()
        except BaseException:
            self.abort()
            raise
        self._state = "committed"
        self._shutdown()
        self._info = ObjectInfo(uri=self.uri, size=self._written, etag=_etag(etag))
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
