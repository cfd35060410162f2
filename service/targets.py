"""The API's check that a job's target is free of existing data, made before the job is created.

Conversions never overwrite. Refusing an existing target at submit answers the caller at once
(409 ``target_taken``) instead of queueing a job that fails later; the engine checks again before
writing (``target_exists`` there is the backstop for two submissions racing past this check).
The check runs before the reservation script, so a refused request leaves nothing in Redis.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptconv.core.errors import ObjectNotFound, StorageUnavailable, TargetTaken
from ckptconv.core.job_records import target_identity
from ckptconv.core.uri import is_local, local_path_of
from ckptconv.formats import target_exists
from ckptconv.storage import open_storage

# The storage clients block, so the check runs in a thread. A thread of a check that timed out is
# left to finish and holds its slot until then; a check that finds every thread busy waits for one
# within its own timeout, so a stalled object store answers 503s, each after the timeout at most.
# asyncio's executor hop costs less than half of anyio.to_thread's (about 20 us of CPU against 50).
_CHECKS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="ckptconv-target-check")


async def refuse_existing_target(target_doc: dict[str, Any], timeout: float) -> None:
    """Raise TargetTaken when something exists at the target (one HEAD and one list, plus the
    ``.index`` for a TF bundle); StorageUnavailable (503) when the store fails or is slower than
    ``timeout`` seconds."""
    uri, fmt = target_identity(target_doc["uri"]), target_doc.get("format")  # s3://b/out/ is s3://b/out
    if is_local(uri) and _nothing_at(local_path_of(uri), fmt):
        return

    def check() -> bool:
        try:
            return target_exists(open_storage(uri), uri, fmt)
        except ObjectNotFound:  # no such bucket: nothing exists there (the job reports the bucket)
            return False

    try:
        # On timeout wait_for cancels the future; the thread is abandoned (left to finish).
        exists = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(_CHECKS, check), timeout)
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


def _nothing_at(path: str, fmt: str | None) -> bool:
    """True when no entry exists at a local target's path (nor, for a TF bundle, at its ``.index``):
    then nothing can be at it or under it. Anything else is left to the full check.

    One lstat on the event loop, the usual answer for a new local target: the scope check already
    resolves every component of a local path there (symlinks), and this costs less than the thread
    hop of the full check."""
    for p in (path, path + ".index") if fmt == "tf" else (path,):
        try:
            os.lstat(p)
        except FileNotFoundError:
            continue
        except OSError:
            pass
        return False  # something is there, or the path cannot be looked at: the full check decides
    return True
