"""Publication of a staged, verified output: every file moved to the target, the manifest last.

Also the result of a run (:class:`ConvertResult`), which a published manifest reads back into.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.errors import (
    LeaseLost,
    ObjectNotFound,
    TargetExists,
    VerificationFailed,
)
from ckptconv.core.fencing import fence
from ckptconv.engine.staging import (
    _attempt_stagings,
    _discard_after_failure,
    _discard_job,
    _Layout,
    _read_json,
    _staged_manifest,
    abort_interrupted_copies,
    record_placement,
    remove_placed,
)
from ckptconv.formats.base import OutputFile
from ckptconv.storage.base import Storage
from ckptconv.storage.digests import entry_digests, stored_block_digest


@dataclass
class ConvertResult:
    target: str
    format: str
    outputs: list[OutputFile]
    manifest: str
    job_id: str | None = None
    warnings: list[str] = field(default_factory=list)
    verify: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    tensors: int = 0
    bytes: int = 0
    extras: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "format": self.format,
            "job_id": self.job_id,
            "outputs": [o.facts() for o in self.outputs],
            "manifest": self.manifest,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "warnings": list(self.warnings),
            "verify": dict(self.verify),
            "timings": dict(self.timings),
            "source": dict(self.source),
            **({"memory": dict(self.memory)} if self.memory else {}),
            **({"extras": self.extras} if self.extras else {}),
        }

    @classmethod
    def from_manifest(cls, manifest_uri: str, doc: dict[str, Any]) -> ConvertResult:
        return cls(
            target=doc["target"]["uri"],
            format=doc["target"]["format"],
            outputs=[OutputFile.from_facts(f) for f in doc["files"]],
            manifest=manifest_uri,
            job_id=doc.get("job_id"),
            warnings=doc.get("warnings", []),
            verify=doc.get("verify", {}),
            timings=doc.get("timings", {}),
            source=doc.get("source", {}),
            memory=doc.get("memory", {}),
            tensors=doc.get("tensors", 0),
            bytes=doc.get("bytes", 0),
            extras=doc.get("extras", {}),
        )


def published(layout: _Layout, job_id: str) -> ConvertResult | None:
    """The result of the job's finished publication: its manifest, naming the job, at the target."""
    for uri in layout.manifest_candidates():
        doc = _read_json(layout.storage, uri)
        if doc is not None and doc.get("job_id") == job_id:
            return ConvertResult.from_manifest(uri, doc)
    return None


def _resume(layout: _Layout, job_id: str | None) -> ConvertResult | None:
    """Idempotent redelivery: the finished result, or the publication of a staged one (any attempt's)."""
    if job_id is None:
        return None
    storage = layout.storage
    done = published(layout, job_id)
    if done is not None:
        _discard_job(layout, job_id)
        return done
    for staged in _attempt_stagings(layout, job_id):
        found = _staged_manifest(staged)
        if found is not None:
            abort_interrupted_copies(storage, found[2])
            return _publish(staged, job_id)
    return None


def _holds(storage: Storage, uri: str, entry: dict[str, Any]) -> bool:
    """True when ``uri`` exists and holds exactly the bytes the manifest entry describes."""
    try:
        if storage.stat(uri).size != entry["size"]:
            return False
    except ObjectNotFound:
        return False
    # In the hash the entry names: a manifest of an earlier version names sha256.
    algorithm, digest, blocks = entry_digests(entry)
    if digest is not None:
        return storage.digest(uri, algorithm) == digest
    if blocks is None:
        return False
    return stored_block_digest(storage, uri, blocks["block_size"], algorithm) == blocks[algorithm]


def _publish(layout: _Layout, job_id: str | None) -> ConvertResult:
    """Move staged files to the target, the manifest last. Safe to run again after a crash.

    Create-only: a final name that already exists is accepted only when it holds the staged bytes
    (this job's interrupted publication); anything else fails with TargetExists and nothing is
    replaced. A failure removes what this call placed, unless the attempt lost the job meanwhile
    (its successor may already rely on those bytes).
    """
    storage = layout.storage
    found = _staged_manifest(layout)
    if found is None:
        raise VerificationFailed("the staged output has no manifest; nothing was published")
    staged_manifest, final_manifest, doc = found
    if job_id is not None:
        record_placement(layout, doc)
    placed: list[str] = []
    try:
        for f in doc["files"]:
            staged = storage.join(layout.staging, f["path"])
            if storage.exists(f["uri"]):
                if not _holds(storage, f["uri"], f):
                    raise TargetExists(f"{f['uri']} already exists and was not written by this job", uri=f["uri"])
                with contextlib.suppress(ObjectNotFound):
                    storage.delete(staged)
                continue
            fence(job_id)
            try:
                # Publication checks the staged file first itself (one HEAD on S3, not two).
                storage.publish([(staged, f["uri"])], overwrite=False, owner=job_id)
            except ObjectNotFound as e:
                raise VerificationFailed(f"staged file {f['path']} vanished before publication") from e
            placed.append(f["uri"])
        fence(job_id)
        storage.publish([(staged_manifest, final_manifest)], overwrite=False, owner=job_id)
    except LeaseLost:
        raise
    except BaseException:
        if _unpublish(layout, placed, job_id):
            _discard_after_failure(layout)
        raise
    _discard_job(layout, job_id)
    return ConvertResult.from_manifest(final_manifest, doc)


def _unpublish(layout: _Layout, placed: list[str], job_id: str | None) -> bool:
    """Remove the files a failed publication placed (never anything else), if this attempt still
    owns the job; returns whether it does. A job's are removed only while still the files it placed
    (:func:`remove_placed`): another writer may have replaced one since."""
    try:
        fence(job_id)
    except LeaseLost:
        return False
    # Best effort: the original error is the one to report (the job's cleanup tries again).
    with contextlib.suppress(Exception):
        if job_id is not None:
            remove_placed(layout, placed, job_id)
        else:  # a run outside a job (the CLI) names no owner to check; it is the target's only writer
            for uri in reversed(placed):
                with contextlib.suppress(ObjectNotFound):
                    layout.storage.delete(uri)
    return True
