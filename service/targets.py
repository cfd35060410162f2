"""The API's check that a job's target is free of existing data, made before the job is created.

Conversions never overwrite. Refusing an existing target at submit answers the caller at once
(409 ``target_taken``) instead of queueing a job that fails later; the engine checks again before
writing (``target_exists`` there is the backstop for two submissions racing past this check).
The check runs before the reservation script, so a refused request leaves nothing in Redis.
"""

from __future__ import annotations

from typing import Any

import anyio

from ckptconv.core.errors import ObjectNotFound, StorageUnavailable, TargetTaken
from ckptconv.core.jobstore import target_identity
from ckptconv.formats import target_exists
from ckptconv.storage import open_storage


async def refuse_existing_target(target_doc: dict[str, Any], timeout: float) -> None:
    """Raise TargetTaken when something exists at the target (one HEAD and one list, plus the
    ``.index`` for a TF bundle); StorageUnavailable (503) when the store fails or is slower than
    ``timeout`` seconds."""
    uri, fmt = target_identity(target_doc["uri"]), target_doc.get("format")  # s3://b/out/ is s3://b/out

    def check() -> bool:
        try:
            return target_exists(open_storage(uri), uri, fmt)
        except ObjectNotFound:  # no such bucket: nothing exists there (the job reports the bucket)
            return False

    try:
        with anyio.fail_after(timeout):
            # The storage clients block: a thread, abandoned (left to finish) at the deadline.
            exists = await anyio.to_thread.run_sync(check, abandon_on_cancel=True)
    except TimeoutError:
        raise StorageUnavailable(f"the object store did not answer within {timeout:g} s about {uri}") from None
    except OSError as e:  # a StorageError, or a socket error a client library let through
        raise StorageUnavailable(f"cannot check whether {uri} exists: {e}") from e
    if exists:
        raise TargetTaken(
            f"{uri} already exists",
            hint="conversions never overwrite: choose another target URI, or delete what is there first",
            uri=uri,
        )
