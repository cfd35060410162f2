"""S3 and S3-compatible storage (AWS, MinIO, Ceph, moto) on boto3.

Guarantees on top of the :class:`~ckptconv.storage.base.Storage` contract:

- The client comes from the standard AWS environment (credentials chain, ``AWS_ENDPOINT_URL`` /
  ``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION``) with a connection pool sized for a few
  threads plus the parallel reads. A boto3 client is thread-safe, so one :class:`S3Storage` serves
  every thread (:mod:`.client`).
- Every call retries per the one policy of :mod:`ckptconv.storage.retry` (botocore's own retries
  are off): 5xx and throttling answers, connection errors, stalled responses (no byte for
  ``CKPTCONV_S3_READ_TIMEOUT_S``, default 60) and bodies shorter than announced, or without a
  length and short. Past the budget the call fails with :class:`~ckptconv.core.errors.StorageError`.
- Reads are concurrent ranged GETs, at most ``CKPTCONV_S3_READ_CONCURRENCY`` in flight per
  storage, each straight into the caller's buffer; a ranged read broken mid-body asks only for the
  bytes it still lacks, of the same object (``If-Match`` the first answer's ETag) (:mod:`.reads`).
- A create-only write retried after an answer was lost may find the object it created itself: the
  object's ETag tells (the MD5 of a put, the multipart ETag of a completed upload, the source's
  ETag of a copy), and then the write succeeded.
- Writes are streaming multipart uploads (:mod:`.writer`); positioned parts of a known layout go
  through :mod:`ckptconv.storage.part_upload`, which reuses its part buffers and hashes each part's
  blocks (the output's block digest) as it sends them.
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

from ckptconv.storage.s3.client import make_client
from ckptconv.storage.s3.storage import S3Storage
from ckptconv.storage.s3.writer import MAX_PART_SIZE, MAX_PARTS, MIN_PART_SIZE, S3Writer, multipart_etag, part_size_for

__all__ = [
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MIN_PART_SIZE",
    "S3Storage",
    "S3Writer",
    "make_client",
    "multipart_etag",
    "part_size_for",
]
