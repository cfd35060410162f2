"""Running a plan: stage, execute, verify, publish with the manifest last.

The flow of one conversion (DESIGN.md):

1. open the source (metadata only) and build a plan (``ckptconv.engine.plan``);
2. execute it into a sink that writes under a **staging** prefix beside the target
   (``<parent>/.ckptconv-staging/<job id>/<attempt>/``: see ``ckptconv.core.fencing``), hashing
   every value on the way;
3. commit the sink (into staging), reopen what it wrote and compare every entry (``verify_output``);
   compute each file's sha256 meanwhile (unless the sink hashed it while writing; a file written
   out of order gets the block digest of ``ckptconv.storage.digests`` instead, and only
   ``verify: full`` reads it back); write ``manifest.json`` into staging;
4. publish: move every file to the target (hard link locally, server-side copy on S3), create-only
   (``os.link`` / ``If-None-Match: *``), the manifest last, then delete the staging prefix.

A failure or cancellation before step 4 deletes the staging prefix; a failure during step 4
removes the files this publication placed: nothing ever appears at the target without its
manifest. Publication never replaces bytes it did not write: a file already at a final name is
accepted only when it holds exactly the staged bytes (an interrupted publication of the same job),
otherwise the job fails with ``target_exists``. Under a worker, every move is fenced by the
attempt number. A redelivered job (same ``job_id``) is idempotent: a published manifest with that
id is returned as is; a staged, verified output of any attempt whose publication was interrupted
is published again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.bounded import load_json
from ckptconv.core.errors import (
    InvalidRequest,
    LeaseLost,
    ObjectNotFound,
    TargetExists,
    VerificationFailed,
)
from ckptconv.core.fencing import current_attempt, fence
from ckptconv.core.uri import basename, is_s3, normalize_uri
from ckptconv.core.uri import parent as parent_of
from ckptconv.core.version import __version__
from ckptconv.engine.execute import (
    CancelFn,
    Progress,
    ProgressFn,
    ProgressReporter,
    VerifyReport,
    check_written,
    execute,
    verify_output,
)
from ckptconv.engine.plan import Plan
from ckptconv.formats import sink_class, source_class, target_exists
from ckptconv.formats.base import OutputFile, TensorSink, TensorSource
from ckptconv.formats.detect import check_format
from ckptconv.storage import open_storage
from ckptconv.storage.base import Storage
from ckptconv.storage.digests import stored_digests

log = logging.getLogger(__name__)

__all__ = ["ConvertResult", "Progress", "discard_staging", "run_plan"]

STAGING_DIR = ".ckptconv-staging"
MANIFEST_NAME = "manifest.json"
MANIFEST_SUFFIX = ".manifest.json"


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
            "outputs": [_file_facts(o) for o in self.outputs],
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
            outputs=[
                OutputFile(f["uri"], f["size"], f.get("sha256"), f.get("role", "data"), f.get("sha256_blocks"))
                for f in doc["files"]
            ],
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


def source_facts(src: TensorSource) -> dict[str, Any]:
    """Provenance for the manifest: the source's files with sizes and ETags."""
    files = src.files()
    out = []
    for uri in files:
        try:
            info = src.storage.stat(uri)
            out.append({"uri": uri, "size": info.size, "etag": info.etag})
        except ObjectNotFound:
            out.append({"uri": uri})
    return {"uri": src.uri, "format": src.format, "files": out, "info": jsonable(src.info)}


def jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


# --- target layout ---------------------------------------------------------------------------


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


def _layout(storage: Storage, target: str, staging: str | None, job_id: str | None) -> _Layout:
    target = target.rstrip("/")
    parent = parent_of(target)
    if staging is None:
        staging = attempt_staging(storage, parent, job_id)
    return _Layout(storage, target, parent, staging.rstrip("/"))


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
    """Remove what a job (e.g. one whose worker died) left in its staging areas; idempotent."""
    target = normalize_uri(target)
    layout = _layout(open_storage(target), target, staging, job_id)
    if staging is not None:
        _discard(layout)
    else:
        _discard_job(layout, job_id)


def _read_json(storage: Storage, uri: str) -> dict[str, Any] | None:
    try:
        return load_json(storage.read_all(uri), what=f"the manifest {uri}")
    except ObjectNotFound:
        return None


# --- running a plan --------------------------------------------------------------------------


def writer_buffer_bytes(target: str, to: str, sink_options: dict[str, Any] | None = None) -> int:
    """Bytes the writers of format ``to`` hold in upload buffers at ``target``: their parts when
    it is on S3, nothing for a local file (the page cache is not the process's memory)."""
    if not target or not is_s3(target):
        return 0
    return sink_class(to).remote_buffer_bytes({k: v for k, v in (sink_options or {}).items() if v is not None})


def run_plan(
    plan: Plan,
    src: TensorSource,
    *,
    to: str,
    target: str,
    sink_options: dict[str, Any] | None = None,
    extra_files: dict[str, bytes] | None = None,
    staging: str | None = None,
    progress: ProgressFn | None = None,
    cancelled: CancelFn | None = None,
    job_id: str | None = None,
    verify: bool | str = True,
    extras: dict[str, Any] | None = None,
    sink_factory: Callable[..., TensorSink] | None = None,
    reopen: Callable[[Storage, str], TensorSource] | None = None,
    memory_budget: int | str | None = None,
) -> ConvertResult:
    """Execute ``plan`` from ``src`` into format ``to`` at ``target``; verify; publish atomically.

    ``verify``: ``"hashes"`` (the default, also ``True``) compares the hashes of what was written
    with those of what was read, without reading the output again; ``"full"`` reopens the output
    and compares every entry; ``False`` (or ``"off"``) skips verification.
    ``extra_files`` maps paths relative to the target's parent (e.g. ``config_to_cs-2.9.yaml`` or
    ``x_to_hf/config.json``) to their bytes; they are staged and published with the checkpoint.
    ``sink_factory`` (called as the format's sink class is, with ``sink_options``) and ``reopen``
    (``(storage, uri)``) replace the format's sink and source for outputs the format alone does
    not describe (a checkpoint split into component directories).
    """
    check_format(to)
    target = normalize_uri(target)
    storage = open_storage(target)
    layout = _layout(storage, target, staging, job_id)
    reporter = ProgressReporter(progress)
    timings: dict[str, float] = {}

    done = _resume(layout, job_id)
    if done is not None:
        return done
    if target_exists(storage, layout.target, to):
        raise TargetExists(f"{layout.target} already exists")

    options = {k: v for k, v in (sink_options or {}).items() if v is not None}
    buffers = writer_buffer_bytes(target, to, options)
    memory = plan.memory({e.key: e.nbytes for e in src.entries()}, memory_budget, buffers)
    # A previous attempt of this job may have left a partial staging area: start clean.
    _discard(layout)
    sink = (sink_factory or sink_class(to))(storage, layout.sink_uri, **options)
    t0 = time.monotonic()
    try:
        mode = verify_mode(verify)
        read_digests: dict[str, str] = {}
        digests = execute(
            plan,
            src,
            sink,
            reporter=reporter,
            cancelled=cancelled,
            read_ahead=memory["read_ahead_bytes"],
            read_digests=read_digests if mode == "hashes" else None,
        )
        outputs = list(sink.commit())
    except BaseException:
        _abort(sink, storage, layout)
        raise
    timings["convert_s"] = round(time.monotonic() - t0, 3)

    try:
        for rel, data in (extra_files or {}).items():
            uri = storage.join(layout.staging, rel)
            info = storage.write_bytes(uri, data)
            outputs.append(OutputFile(uri, info.size, hashlib.sha256(data).hexdigest(), "config"))
        t1 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptconv-sha256") as pool:
            # File checksums read the staged files while verification re-reads the tensors.
            hashed = pool.submit(_fill_sha256, storage, outputs, reread=mode == "full")
            report = None
            if mode == "hashes":
                reporter.stage("verifying", plan.tensors_total, plan.bytes_total)
                report = check_written(plan, digests, read_digests)
                reporter.advance(plan.tensors_total, plan.bytes_total)
                reporter.finish()
            if mode == "full":
                reopened = (reopen or source_class(to))(storage, layout.sink_uri)
                try:
                    report = verify_output(plan, digests, reopened, reporter=reporter, cancelled=cancelled)
                finally:
                    reopened.close()
            outputs = hashed.result()
        timings["verify_s"] = round(time.monotonic() - t1, 3)
        stage_manifest(
            layout,
            src,
            to=to,
            job_id=job_id,
            plan=plan,
            outputs=outputs,
            report=report,
            timings=timings,
            memory=memory,
            extras=extras,
        )
    except BaseException:
        _discard_after_failure(layout)
        raise
    result = _publish(layout, job_id)
    result.timings["publish_s"] = round(time.monotonic() - t0 - sum(timings.values()), 3)
    reporter.complete("done", plan.tensors_total, plan.bytes_total)
    return result


def stage_manifest(
    layout: _Layout,
    src: TensorSource,
    *,
    to: str,
    job_id: str | None,
    plan: Plan,
    outputs: list[OutputFile],
    report: VerifyReport | None,
    timings: dict[str, float],
    memory: dict[str, Any],
    extras: dict[str, Any] | None,
) -> None:
    """Refuse a failed verification; otherwise write ``manifest.json`` into staging (publication's input)."""
    if report is not None and not report.ok:
        raise VerificationFailed(
            f"{len(report.mismatches)} entries of the output differ from the source: "
            + "; ".join(report.mismatches[:5]),
            mismatches=report.mismatches[:50],
        )
    storage = layout.storage
    manifest_uri = _manifest_uri(layout, outputs)
    staged_manifest = storage.join(layout.staging, manifest_uri[len(layout.parent) + 1 :])
    doc = {
        "ckptconv_version": __version__,
        "job_id": job_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source_facts(src),
        "target": {"uri": layout.target, "format": to},
        "files": [
            {
                "uri": layout.final(o.uri),
                "path": o.uri[len(layout.staging) + 1 :],
                "size": o.size,
                "sha256": o.sha256,
                "role": o.role,
                **({"sha256_blocks": o.blocks} if o.blocks else {}),
            }
            for o in outputs
        ],
        "tensors": plan.tensors_total,
        "bytes": plan.bytes_total,
        "verify": report.to_dict() if report else {"ok": None, "skipped": True},
        "warnings": list(plan.warnings),
        "timings": timings,
        "memory": memory,
        **({"extras": jsonable(extras)} if extras else {}),
    }
    storage.write_bytes(staged_manifest, json.dumps(doc, indent=2).encode())


VERIFY_MODES = ("hashes", "full", "off")


def verify_mode(verify: bool | str) -> str:
    """``hashes``, ``full`` or ``off`` from a run's ``verify`` argument (``True`` means ``hashes``)."""
    if verify is True:
        return "hashes"
    if verify is False or verify is None:
        return "off"
    if verify not in VERIFY_MODES:
        raise InvalidRequest(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")
    return verify


def _abort(sink: Any, storage: Storage, layout: _Layout) -> None:
    try:
        sink.abort()
    finally:
        _discard_after_failure(layout)


def _discard_after_failure(layout: _Layout) -> None:
    """Discard staging on a failure path; a failure to clean up (storage down past the retry
    budget) is logged, never raised over the error being handled. A later attempt of the job,
    or ``discard_staging``, removes what is left."""
    try:
        _discard(layout)
    except Exception as e:
        log.warning("could not discard the staging area %s: %s", layout.staging, e)


def _manifest_uri(layout: _Layout, outputs: list[OutputFile]) -> str:
    inside = all(o.uri.startswith(layout.sink_uri + "/") for o in outputs)
    return layout.manifest_candidates()[0 if inside else 1]


def _file_facts(o: OutputFile) -> dict[str, Any]:
    facts = {"uri": o.uri, "size": o.size, "sha256": o.sha256, "role": o.role}
    return {**facts, "sha256_blocks": o.blocks} if o.blocks else facts


def _fill_sha256(storage: Storage, outputs: list[OutputFile], *, reread: bool) -> list[OutputFile]:
    """Every output's sha256, reading back the files whose sink did not hash them as written.

    A file with a block digest (written out of order) is read back only when ``reread`` (``verify:
    full``): then its sha256 is added and its block digest checked against the bytes stored.
    """
    done = []
    for o in outputs:
        if o.sha256 is None and o.blocks is None:
            o = dataclasses.replace(o, sha256=storage.sha256(o.uri))
        elif o.sha256 is None and reread:
            assert o.blocks is not None
            sha256, blocks = stored_digests(storage, o.uri, o.blocks["block_size"])
            if blocks != o.blocks["sha256"]:
                raise VerificationFailed(
                    f"{o.uri}: the stored bytes differ from those written (block digest {blocks},"
                    f" {o.blocks['sha256']} as written)",
                    uri=o.uri,
                )
            o = dataclasses.replace(o, sha256=sha256)
        done.append(o)
    return done


def _resume(layout: _Layout, job_id: str | None) -> ConvertResult | None:
    """Idempotent redelivery: the finished result, or the publication of a staged one (any attempt's)."""
    if job_id is None:
        return None
    storage = layout.storage
    for uri in layout.manifest_candidates():
        doc = _read_json(storage, uri)
        if doc is not None and doc.get("job_id") == job_id:
            _discard_job(layout, job_id)
            return ConvertResult.from_manifest(uri, doc)
    for staged in _attempt_stagings(layout, job_id):
        if _staged_manifest(staged) is not None:
            return _publish(staged, job_id)
    return None


def _staged_manifest(layout: _Layout) -> tuple[str, str, dict[str, Any]] | None:
    """(staged URI, final URI, document) of the manifest in this staging area, if it has one."""
    for uri in layout.manifest_candidates():
        candidate = layout.storage.join(layout.staging, uri[len(layout.parent) + 1 :])
        doc = _read_json(layout.storage, candidate)
        if doc is not None:
            return candidate, uri, doc
    return None


def _holds(storage: Storage, uri: str, entry: dict[str, Any]) -> bool:
    """True when ``uri`` exists and holds exactly the bytes the manifest entry describes."""
    try:
        if storage.stat(uri).size != entry["size"]:
            return False
    except ObjectNotFound:
        return False
    if entry.get("sha256") is not None:
        return storage.sha256(uri) == entry["sha256"]
    blocks = entry.get("sha256_blocks")
    return blocks is not None and stored_digests(storage, uri, blocks["block_size"])[1] == blocks["sha256"]


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
            if not storage.exists(staged):
                raise VerificationFailed(f"staged file {f['path']} vanished before publication")
            fence(job_id)
            storage.publish([(staged, f["uri"])], overwrite=False)
            placed.append(f["uri"])
        fence(job_id)
        storage.publish([(staged_manifest, final_manifest)], overwrite=False)
    except LeaseLost:
        raise
    except BaseException:
        if _unpublish(storage, placed, job_id):
            _discard_after_failure(layout)
        raise
    _discard_job(layout, job_id)
    return ConvertResult.from_manifest(final_manifest, doc)


def _unpublish(storage: Storage, placed: list[str], job_id: str | None) -> bool:
    """Remove the files a failed publication placed (never anything else), if this attempt still
    owns the job; returns whether it does."""
    try:
        fence(job_id)
    except LeaseLost:
        return False
    for uri in reversed(placed):
        with contextlib.suppress(Exception):  # best effort: the original error is the one to report
            storage.delete(uri)
    return True
