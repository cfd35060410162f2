"""The API's check that a job's target is free of existing data, made before the job is created.

Conversions never overwrite. Refusing an existing target at submit answers the caller at once
(409 ``target_taken``) instead of queueing a job that fails later; the engine checks again before
writing (``target_exists`` there is the backstop for two submissions racing past this check).
The check runs before the reservation script, so a refused request leaves nothing in Redis.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptconv.core.errors import ObjectNotFound, StorageUnavailable, TargetTaken
from ckptconv.core.job_records import target_identity
from ckptconv.core.uri import is_local, local_path_of
from ckptconv.engine.staging import MANIFEST_SUFFIX, occupant
from ckptconv.storage import open_storage

log = logging.getLogger("ckptconv.api")

# The storage clients block, so the check runs in a thread. A thread of a check that timed out is
# left to finish and holds its slot until then; a check that finds every thread busy waits for one
# within its own timeout, so a stalled object store answers 503s, each after the timeout at most.
# As many threads as the S3 client has pooled connections (ckptconv.storage.s3.client's
# MAX_POOL_CONNECTIONS): more would only wait for a connection, or open one to throw away, while
# contending for the GIL with the event loop.
# asyncio's executor hop costs less than half of anyio.to_thread's (about 20 us of CPU against 50).
_CHECKS = ThreadPoolExecutor(max_workers=16, thread_name_prefix="ckptconv-target-check")

# The checks under way, by target: requests for a target that is being checked wait for that check
# rather than starting their own, so a burst of submissions to one target costs one check (its HEADs
# and its list), not one each (32 at once used to exceed the timeout on a loaded machine, answering 503s).
# Its answer is at most one check old for every request that joins it, which the check could be
# anyway; two jobs on one target are kept apart by the reservation, not by this check.
_under_way: dict[tuple[str, str | None], asyncio.Future[str | None]] = {}


def warm_up() -> None:
    """Build the S3 client now (boto3's import and service model: about a second of CPU, several
    on a loaded machine) rather than in the first submissions, whose checks would spend their
    timeout on it. A client that cannot be built is left to the checks to report (503)."""
    try:
        open_storage("s3://ckptconv-warm-up/")
    except Exception as e:
        log.warning("the S3 client cannot be built yet (%s: %s); submissions to s3:// will retry", type(e).__name__, e)


async def refuse_existing_target(target_doc: dict[str, Any], timeout: float) -> None:
    """Raise TargetTaken when something exists at the target (a HEAD of it, one list under it, a
    HEAD of the manifest name beside it, plus the ``.index`` for a TF bundle); StorageUnavailable
    (503) when the store fails or is slower than ``timeout`` seconds."""
    uri, fmt = target_identity(target_doc["uri"]), target_doc.get("format")  # s3://b/out/ is s3://b/out
    if is_local(uri) and _nothing_at(local_path_of(uri), fmt):
        return
    try:
        # shield: a request that times out stops waiting; the check goes on for those that joined it.
        exists = await asyncio.wait_for(asyncio.shield(_check_under_way(uri, fmt)), timeout)
    except TimeoutError:
        raise StorageUnavailable(f"the object store did not answer within {timeout:g} s about {uri}") from None
    except OSError as e:  # a StorageError, or a socket error a client library let through
        raise StorageUnavailable(f"cannot check whether {uri} exists: {e}") from e
    if exists is not None:
        raise TargetTaken(
            f"{exists} already exists",
            hint="conversions never overwrite: choose another target URI, or delete what is there first",
            uri=uri,
        )


def _check_under_way(uri: str, fmt: str | None) -> asyncio.Future[str | None]:
    """The check of ``uri`` under way, started now if there is none."""
    key = (uri, fmt)
    check = _under_way.get(key)
    if check is None:
        check = asyncio.get_running_loop().run_in_executor(_CHECKS, _exists, uri, fmt)
        _under_way[key] = check
        check.add_done_callback(lambda done: _finished(key, done))
    return check


def _finished(key: tuple[str, str | None], check: asyncio.Future[str | None]) -> None:
    if _under_way.get(key) is check:
        del _under_way[key]
    if not check.cancelled():
        check.exception()  # retrieved: when every waiter timed out, nobody else reads it


def _exists(uri: str, fmt: str | None) -> str | None:
    """What occupies the target (see ``engine.staging.occupant``), or None."""
    try:
        return occupant(open_storage(uri), uri, fmt)
    except ObjectNotFound:  # no such bucket: nothing exists there (the job reports the bucket)
        return None


def _nothing_at(path: str, fmt: str | None) -> bool:
    """True when no entry exists at a local target's path (nor, for a TF bundle, at its ``.index``,
    nor at the manifest a file target places beside it): then nothing can be at it or under it.
    Anything else is left to the full check.

    One lstat on the event loop, the usual answer for a new local target: the scope check already
    resolves every component of a local path there (symlinks), and this costs less than the thread
    hop of the full check."""
    for p in (path, path + MANIFEST_SUFFIX, *((path + ".index",) if fmt == "tf" else ())):
        try:
            os.lstat(p)
        except FileNotFoundError:
            continue
        except OSError:
            pass
        return False  # something is there, or the path cannot be looked at: the full check decides
    return True
