"""Storage: bytes behind URIs (``s3://bucket/key``, local paths, ``file://`` URIs).

``open_storage(uri)`` picks the backend by scheme and returns a shared, thread-safe instance
(one per scheme and S3 endpoint), confined to the current job's URI prefixes when a job runs
(:mod:`ckptconv.storage.confined`). The contract every backend meets is in
:mod:`ckptconv.storage.base`; names from untrusted input are joined with ``Storage.join`` or
:func:`confine`, never by string concatenation.

Importing this package does not import boto3; the S3 backend is loaded on first use.
"""

from __future__ import annotations

import os
import threading

from ckptconv.core.errors import InvalidRequest
from ckptconv.core.uri import check_relative, confine, is_local, is_s3, join, local_path_of, scheme_of, split_s3
from ckptconv.storage.base import ObjectInfo, RangeReader, Storage, Writer
from ckptconv.storage.confined import confine_storage
from ckptconv.storage.local import LocalStorage

__all__ = [
    "ObjectInfo",
    "RangeReader",
    "Storage",
    "Writer",
    "check_relative",
    "confine",
    "is_local",
    "is_s3",
    "join",
    "local_path_of",
    "open_storage",
    "scheme_of",
    "split_s3",
]

_lock = threading.Lock()
_instances: dict[tuple[str | None, ...], Storage] = {}


def _cache_key(scheme: str) -> tuple[str | None, ...]:
    if scheme == "file":
        return ("file",)
    # A different endpoint, region or profile in the environment needs a different client.
    env = os.environ
    return (
        "s3",
        env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
        env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        env.get("AWS_PROFILE"),
    )


def open_storage(uri: str) -> Storage:
    """The storage backend for ``uri``: S3 for ``s3://``, local for paths and ``file://``.

    Raises :class:`~ckptconv.core.errors.InvalidRequest` for other schemes and malformed S3 URIs.
    Instances are cached and shared between threads. Inside a job's scope (see
    :mod:`ckptconv.storage.confined`) the backend comes wrapped so that it touches only the URIs the
    job's owner may touch.
    """
    scheme = scheme_of(uri)
    if scheme == "s3":
        split_s3(uri)  # refuses s3:// URIs without a bucket before any client is built
    elif scheme == "file":
        local_path_of(uri)  # refuses file://otherhost/...
    else:
        raise InvalidRequest(
            f"unsupported storage scheme {scheme!r} in {uri!r}",
            hint="use s3://bucket/key or a local path",
            uri=uri,
        )
    key = _cache_key(scheme)
    with _lock:
        storage = _instances.get(key)
        if storage is None:
            if scheme == "s3":
                # Deferred: the S3 backend imports boto3, loaded only for the first s3:// URI.
                from ckptconv.storage.s3 import S3Storage

                storage = S3Storage()
            else:
                storage = LocalStorage()
            _instances[key] = storage
    return confine_storage(storage)
