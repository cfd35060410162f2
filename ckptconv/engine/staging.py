"""The staging area of a run: where each attempt of a job writes before publication, and its removal."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

from ckptconv.core.bounded import load_json
from ckptconv.core.errors import (
    ObjectNotFound,
    TargetExists,
)
from ckptconv.core.fencing import current_attempt
from ckptconv.core.job_records import target_identity
from ckptconv.core.uri import basename, normalize_uri
from ckptconv.core.uri import parent as parent_of
from ckptconv.formats import target_exists
from ckptconv.formats.registry import FORMATS
from ckptconv.storage import open_storage
from ckptconv.storage.base import Storage

log = logging.getLogger(__name__)

STAGING_DIR = ".ckptconv-staging"
MANIFEST_NAME = "manifest.json"
MANIFEST_SUFFIX = ".manifest.json"
# In an attempt's staging area: what identifies the files its publication placed (local files).
PLACEMENT_NAME = ".ckptconv-placement.json"


@dataclass(frozen=True)
class _Layout:
    """Where a conversion writes: staging, the sink's URI inside it, and the final parent."""

    storage: Storage
    target: str  # final URI of the checkpoint (a file, a directory/prefix, or a TF prefix)
    parent: str  # the target's parent; outputs keep their path relative to it
    staging: str  # staging prefix (no trailing slash)

    @property
    def sink_uri(self) -> str:
        return self.staging + "/" + basename(self.target)

    def final(self, staged_uri: str) -> str:
        rel = staged_uri[len(self.staging) + 1 :]
        return self.storage.join(self.parent, rel)

    def manifest_candidates(self) -> list[str]:
        return [self.target + "/" + MANIFEST_NAME, self.target + MANIFEST_SUFFIX]

    def occupied(self, fmt: str | None, extra_files: dict[str, bytes] | None = None) -> str | None:
        """What is in the way of publishing here (see :func:`occupant`), or an extra file's final
        name beside the target (a model conversion's config) taken by other bytes than the run's:
        publication accepts a name already holding the bytes it places, and refuses any other."""
        found = occupant(self.storage, self.target, fmt)
        if found is not None:
            return found
        for rel, data in (extra_files or {}).items():
            uri = self.storage.join(self.parent, rel)
            if not uri.startswith(self.target + "/") and _holds_other_bytes(self.storage, uri, data):
                return uri
        return None


def _holds_other_bytes(storage: Storage, uri: str, data: bytes) -> bool:
    """True when something exists at ``uri`` and is not ``data`` (an extra file is small: a config)."""
    try:
        if storage.stat(uri).size != len(data):
            return True
        return storage.read_all(uri) != data
    except ObjectNotFound:
        return False


def occupant(storage: Storage, target: str, fmt: str | None) -> str | None:
    """What already sits where a conversion to ``target`` would publish (the target itself, or the
    manifest a file target places beside it), or None. Checked before any work, so that a job
    that could never publish fails at once rather than after hours of copying."""
    if target_exists(storage, target, fmt):
        return target
    beside = target + MANIFEST_SUFFIX
    return beside if storage.exists(beside) else None


def _layout(storage: Storage, target: str, staging: str | None, job_id: str | None) -> _Layout:
    target = target.rstrip("/")
    parent = parent_of(target)
    if staging is None:
        staging = attempt_staging(storage, parent, job_id)
    return _Layout(storage, target, parent, staging.rstrip("/"))


def sibling_holders(target: str) -> list[str]:
    """The targets that write ``target`` (canonical) beside themselves, not under: a file target
    ``T`` places its manifest at ``T.manifest.json``, and a checkpoint named by a prefix ``T`` its
    files (a TF bundle's ``T.index``, ``T.data-00000-of-00001``). Such a target and ``target``
    publish to one final key, so they are one reservation (``RedisKeys.target_claim``)."""
    parent, sep, name = target_identity(target).rpartition("/")
    patterns = [re.escape(MANIFEST_SUFFIX)] + [spec.prefix_files for spec in FORMATS.values() if spec.prefix_files]
    stems = (re.fullmatch(f"(.+?)(?:{pattern})", name) for pattern in patterns)
    return list(dict.fromkeys(parent + sep + m.group(1) for m in stems if m is not None))


def staging_root(target: str) -> str:
    """The staging directory of every job writing ``target`` (``<parent>/.ckptconv-staging/``):
    besides the target itself, what a job must be allowed to write."""
    return parent_of(normalize_uri(target).rstrip("/")).rstrip("/") + "/" + STAGING_DIR + "/"


def attempt_staging(storage: Storage, parent: str, job_id: str | None) -> str:
    """Where the attempt in scope of ``job_id`` stages beside ``parent`` (attempt 0 outside a worker)."""
    attempt = current_attempt(job_id) if job_id else None
    return storage.join(_job_staging(storage, parent, job_id), str(attempt.number if attempt else 0))


def _job_staging(storage: Storage, parent: str, job_id: str | None) -> str:
    """Where every attempt of one job stages (``<parent>/.ckptconv-staging/<job id>``)."""
    return storage.join(parent, STAGING_DIR, job_id or uuid.uuid4().hex)


def _attempt_stagings(layout: _Layout, job_id: str) -> list[_Layout]:
    """The staging areas of this job's attempts that exist, the newest attempt first."""
    root = _job_staging(layout.storage, layout.parent, job_id)
    found: set[str] = set()
    for info in layout.storage.list(root + "/"):
        first = info.uri[len(root) + 1 :].split("/", 1)[0]
        if first:
            found.add(first)
    order = sorted(found, key=lambda a: (not a.isdigit(), -int(a) if a.isdigit() else 0, a))
    return [dataclasses.replace(layout, staging=layout.storage.join(root, a)) for a in order]


def _discard(layout: _Layout, prefix: str | None = None) -> None:
    """Delete the staging prefix (or ``prefix``, a job's staging root; on S3 with its incomplete
    multipart uploads) and, locally, the temp files of writers that died mid-write and the
    staging directories left empty."""
    prefix = prefix or layout.staging
    layout.storage.delete_prefix(prefix + "/")
    local = layout.storage.local_path(prefix)
    if local is not None:
        shutil.rmtree(local, ignore_errors=True)
        for d in (local, local.parent, local.parent.parent):
            if d.name == STAGING_DIR or d == local or d.parent.name == STAGING_DIR:
                try:
                    d.rmdir()
                except OSError:  # absent, or still used by another job: keep it
                    pass


def _discard_job(layout: _Layout, job_id: str | None) -> None:
    """Delete the staging of every attempt of the job (after its publication, or for good)."""
    _discard(layout, _job_staging(layout.storage, layout.parent, job_id) if job_id else None)


def discard_staging(target: str, job_id: str, staging: str | None = None) -> None:
    """Remove what a job (e.g. one whose worker died) left in its staging areas, and the unfinished
    copies of a publication of it killed mid-copy; idempotent.

    For a job that ends without publishing (cancelled, failed, out of attempts), before its final
    state releases its target: the copies are aborted at the exact final keys its staged manifests
    name, which no other live job's publication may use (the target is this job's meanwhile), and
    the files a killed publication of it placed there are removed (see :func:`_unplace`)."""
    target = normalize_uri(target)
    layout = _layout(open_storage(target), target, staging, job_id)
    for area in [layout] if staging is not None else _attempt_stagings(layout, job_id):
        found = _staged_manifest(area)
        if found is not None:  # publication starts only once the manifest is staged
            abort_interrupted_copies(layout.storage, found[2])
            _unplace(area, found[1], found[2], job_id)
    if staging is not None:
        _discard(layout)
    else:
        _discard_job(layout, job_id)


def abort_interrupted_copies(storage: Storage, doc: dict[str, Any]) -> None:
    """Abort the unfinished uploads a publication of the staged manifest ``doc`` killed while it
    copied a file in parts left at that file's final key (exactly: not at longer keys beginning
    with it). Nothing reuses them (publication copies afresh) and each holds up to a whole copy of
    the file, never removed otherwise: the staging area's removal does not reach final keys."""
    for f in doc["files"]:
        abort = getattr(storage.backend(f["uri"]), "abort_publication", None)
        if abort is not None:
            abort(f["uri"], f["size"])


def _staged_manifest(layout: _Layout) -> tuple[str, str, dict[str, Any]] | None:
    """(staged URI, final URI, document) of the manifest in this staging area, if it has one."""
    for uri in layout.manifest_candidates():
        candidate = layout.storage.join(layout.staging, uri[len(layout.parent) + 1 :])
        doc = _read_json(layout.storage, candidate)
        if doc is not None:
            return candidate, uri, doc
    return None


def _read_json(storage: Storage, uri: str) -> dict[str, Any] | None:
    try:
        return load_json(storage.read_all(uri), what=f"the manifest {uri}")
    except ObjectNotFound:
        return None


def _discard_after_failure(layout: _Layout) -> None:
    """Discard staging on a failure path; a failure to clean up (storage down past the retry
    budget) is logged, never raised over the error being handled. A later attempt of the job,
    or ``discard_staging``, removes what is left."""
    try:
        _discard(layout)
    except Exception as e:
        log.warning("could not discard the staging area %s: %s", layout.staging, e)


def record_placement(layout: _Layout, doc: dict[str, Any]) -> None:
    """Before publication places its first file: the identity (device, inode, size, mtime) of each
    staged local file, which the placed file keeps (publication links it). Written once: a resumed
    publication finds some staged files already moved, and the first record names them all."""
    storage = layout.storage
    uri = storage.join(layout.staging, PLACEMENT_NAME)
    if storage.exists(uri):
        return
    facts: dict[str, list[int]] = {}
    for f in doc["files"]:
        path = storage.local_path(storage.join(layout.staging, f["path"]))
        if path is None:
            return  # not local: publish names the job in each object's metadata instead
        with contextlib.suppress(FileNotFoundError):
            facts[f["uri"]] = _identity(os.stat(path))
    with contextlib.suppress(TargetExists):
        storage.write_bytes(uri, json.dumps(facts).encode())


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _unplace(area: _Layout, final_manifest: str, doc: dict[str, Any], job_id: str) -> None:
    """Remove the final files of ``doc`` that a publication of this job placed and, killed, left
    without their manifest; never one it cannot prove it placed (another writer's bytes, even the
    same ones): a local file must be the staged file's inode, an object must name the job."""
    storage = area.storage
    published = _read_json(storage, final_manifest)
    if published is not None and published.get("job_id") == job_id:
        return  # the publication finished: those files are the job's output
    remove_placed(area, [f["uri"] for f in doc["files"]], job_id)


def remove_placed(area: _Layout, uris: list[str], job_id: str) -> None:
    """Remove, last first, the final files ``uris`` that a publication of this job staged in
    ``area`` placed, and only while each is still the very file it placed (see
    :func:`_delete_placed`): another writer's bytes at one of those names stay."""
    storage = area.storage
    placement = _read_json(storage, storage.join(area.staging, PLACEMENT_NAME)) or {}
    for uri in reversed(uris):
        try:
            removed = _delete_placed(storage, uri, job_id, placement.get(uri))
        except ObjectNotFound:
            continue
        if removed:
            log.info("removed %s, placed by job %s whose publication did not finish", uri, job_id)
        else:
            log.warning("left %s at the target: job %s did not place it", uri, job_id)


def _delete_placed(storage: Storage, uri: str, job_id: str, identity: list[int] | None) -> bool:
    """Delete ``uri`` if this job's publication placed it, and only the very object checked;
    whether it did. ObjectNotFound when nothing is there.

    On S3 the delete is conditional on the checked object's ETag (``delete_owned``). A local file
    is checked by its identity and then unlinked: POSIX cannot unlink by inode, so a file put at
    that path between the two calls (microseconds; writers of the service never do, the target
    being this job's) would go instead."""
    path = storage.local_path(uri)
    if path is None:
        delete_owned = getattr(storage, "delete_owned", None)
        return delete_owned is not None and delete_owned(uri, job_id)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ObjectNotFound(f"{uri} does not exist", uri=uri) from None
    if identity is None or _identity(st) != identity:
        return False
    with contextlib.suppress(ObjectNotFound):
        storage.delete(uri)
    return True
