"""The boto3 client and what S3's answers mean: typed errors, and which failures are transient.

The only module that imports boto3 (the rest of the S3 backend imports botocore's exception
types from here or from botocore directly).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

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

from ckptconv.core.errors import CkptconvError, ObjectNotFound, StorageError, TargetExists

# A handful of engine threads plus one background uploader per open writer (plus the parallel reads).
MAX_POOL_CONNECTIONS = 16
# A response that sends no byte for this long is a stalled connection: retried. (A ranged read of
# a body waits for a MiB at a time, then after such a timeout as it comes: see
# ckptconv.storage.s3.reads.)
DEFAULT_READ_TIMEOUT_S = 60.0

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
TRANSIENT_CODES = {
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


def transient(e: BaseException) -> bool:
    """Whether retrying ``e`` may succeed (the policy in :mod:`ckptconv.storage.retry` decides how often)."""
    if isinstance(e, CkptconvError):  # a typed answer (StorageError is an OSError, but already final)
        return False
    if isinstance(e, ClientError):
        code, status = error_code(e)
        return code in TRANSIENT_CODES or status == 429 or (status is not None and status >= 500 and status != 501)
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return False
    return isinstance(e, (TruncatedResponse, *_TRANSPORT_ERRORS))


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


def clean_etag(value: str | None) -> str | None:
    return value.strip('"') if value else None


def precondition_failed(e: ClientError) -> bool:
    """Whether S3 refused a conditional request (If-Match, If-None-Match, CopySourceIfMatch): 412."""
    code, status = error_code(e)
    return code in ("PreconditionFailed", "412") or status == 412


def error_code(e: ClientError) -> tuple[str, int | None]:
    code = str(e.response.get("Error", {}).get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, status


def typed_error(e: ClientError, uri: str) -> Exception:
    """The ckptconv error for a failed S3 call on ``uri``."""
    code, status = error_code(e)
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
    if precondition_failed(e):
        # Create-only writes send If-None-Match: *; a copy whose CopySourceIfMatch fails tells
        # the two apart itself (S3Storage._copy_object).
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
def s3_errors(uri: str, endpoint: str | None = None) -> Iterator[None]:
    """Translate botocore exceptions raised inside the block into typed ckptconv errors."""
    try:
        yield
    except CkptconvError:  # already typed; StorageError is an OSError and must not be wrapped again
        raise
    except ClientError as e:
        raise typed_error(e, uri) from e
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


def not_implemented(e: ClientError) -> bool:
    """True when a server refuses a feature itself (``If-None-Match``, listing uploads), not the request."""
    code, status = error_code(e)
    return status == 501 or code == "NotImplemented"
