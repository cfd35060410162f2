"""Running a plan: stage, execute, verify, publish with the manifest last.

The flow of one conversion (DESIGN.md):

1. open the source (metadata only) and build a plan (``ckptconv.engine.plan``);
2. execute it into a sink that writes under a **staging** prefix beside the target
   (``<parent>/.ckptconv-staging/<job id>/<attempt>/``: see ``ckptconv.core.fencing``), hashing
   every value on the way;
3. commit the sink (into staging), reopen what it wrote and compare every entry (``verify_output``);
   compute each file's digest meanwhile (unless the sink hashed it while writing; a file written
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

The staging area is :mod:`ckptconv.engine.staging`; step 4 is :mod:`ckptconv.engine.publish`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from ckptconv.core.errors import (
    InvalidRequest,
    ObjectNotFound,
    TargetExists,
    VerificationFailed,
)
from ckptconv.core.fencing import fence
from ckptconv.core.uri import is_s3, normalize_uri
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
from ckptconv.engine.publish import ConvertResult, _publish, _resume, published
from ckptconv.engine.staging import _discard, _discard_after_failure, _Layout, _layout, discard_staging
from ckptconv.formats import sink_class, source_class
from ckptconv.formats.base import OutputFile, TensorSink, TensorSource, given_options
from ckptconv.formats.detect import check_format
from ckptconv.storage import open_storage
from ckptconv.storage.base import Storage
from ckptconv.storage.digests import hex_digest, stored_digests
from ckptconv.storage.direct_io import staging_bytes
from ckptconv.storage.part_upload import DEFAULT_CONCURRENCY

log = logging.getLogger(__name__)

__all__ = ["ConvertResult", "Progress", "discard_staging", "end_unpublished", "run_plan"]


def source_facts(src: TensorSource) -> dict[str, Any]:
    """Provenance for the manifest: the source's files with sizes and ETags."""
    files = src.files()
    out = []
    for uri in files:
        try:
            info = src.file_info(uri)
            out.append({"uri": uri, "size": info.size, "etag": info.etag})
        except ObjectNotFound:
            out.append({"uri": uri})
    return {"uri": src.uri, "format": src.format, "files": out, "info": jsonable(src.info)}


def jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


# --- target layout ---------------------------------------------------------------------------


# --- running a plan --------------------------------------------------------------------------


def writer_buffer_bytes(target: str, to: str, sink_options: dict[str, Any] | None = None) -> int:
    """Bytes the writers of format ``to`` hold in buffers at ``target``: their upload parts when it
    is on S3; for a local file (or no target yet), the staging buffers of its direct writes (the
    page cache is not the process's memory, those buffers are)."""
    if not target or not is_s3(target):
        return staging_bytes()
    return sink_class(to).remote_buffer_bytes(given_options(sink_options))


def fit_memory(
    plan: Plan,
    sizes: dict[str, int],
    budget: int | str | None,
    target: str,
    to: str,
    sink_options: dict[str, Any] | None = None,
) -> tuple[dict[str, int | None], dict[str, Any]]:
    """``plan.memory`` for a run into format ``to`` at ``target``, and the sink options that keep it.

    Under a ``budget`` too small for an S3 upload's default parts in flight, the upload runs fewer
    at once (down to one) when the sink lets its caller choose (``concurrency``): the budget bounds
    what the writer allocates rather than being refused. InvalidRequest when even one does not fit.
    """
    options = given_options(sink_options)

    def buffers(concurrency: int) -> int:
        return writer_buffer_bytes(target, to, {**options, "concurrency": concurrency})

    if buffers(1) == buffers(2):  # this sink's buffers do not depend on it
        return plan.memory(sizes, budget, writer_buffer_bytes(target, to, options)), options
    if "concurrency" in options:  # the caller's choice
        chosen = int(options["concurrency"])
        return {**plan.memory(sizes, budget, buffers(chosen)), "upload_concurrency": chosen}, options
    memory, concurrency = fit_uploads(plan, sizes, budget, buffers)
    return memory, (options if concurrency == DEFAULT_CONCURRENCY else {**options, "concurrency": concurrency})


def fit_uploads(
    plan: Plan, sizes: dict[str, int], budget: int | str | None, buffers: Callable[[int], int]
) -> tuple[dict[str, int | None], int]:
    """``plan.memory`` with the most S3 upload parts in flight, ``DEFAULT_CONCURRENCY`` down to
    one, whose buffers (``buffers(concurrency)`` bytes) the budget leaves room for, and that
    number (``upload_concurrency`` in the facts, so that a plan says what a budget made of the
    upload). InvalidRequest, naming the minimum with one part in flight, when none fits."""
    refused: InvalidRequest | None = None
    for concurrency in range(DEFAULT_CONCURRENCY, 0, -1):
        try:
            memory = plan.memory(sizes, budget, buffers(concurrency))
        except InvalidRequest as e:
            refused = e
            continue
        return {**memory, "upload_concurrency": concurrency}, concurrency
    assert refused is not None
    raise refused


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

    done = resume_or_refuse(layout, job_id, to, extra_files)
    if done is not None:
        return done

    memory, options = fit_memory(
        plan, {e.key: e.nbytes for e in src.entries()}, memory_budget, target, to, sink_options
    )
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
            outputs.append(OutputFile(uri, info.size, hex_digest(data), "config"))
        t1 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptconv-digest") as pool:
            # File checksums read the staged files while verification re-reads the tensors.
            hashed = pool.submit(fill_digests, storage, outputs, reread=mode == "full")
            report = None
            if mode == "hashes":
                reporter.stage("verifying", plan.tensors_total, plan.bytes_total)
                report = check_written(plan, digests, read_digests)
                reporter.advance(plan.tensors_total, plan.bytes_total)
                reporter.finish()
            if mode == "full":
                report = verify_reopened(plan, digests, layout, reopen or source_class(to), reporter, cancelled)
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


def resume_or_refuse(
    layout: _Layout, job_id: str | None, to: str, extra_files: dict[str, bytes] | None
) -> ConvertResult | None:
    """What a run settles before converting anything: a redelivered job whose output an earlier
    attempt published (or staged and verified, then published now) ends with that result; otherwise
    None, once the target's final names are free (TargetExists names the first one taken)."""
    done = _resume(layout, job_id)
    if done is not None:
        return done
    occupied = layout.occupied(to, extra_files)
    if occupied is not None:
        raise TargetExists(f"{occupied} already exists", uri=occupied)
    return None


def verify_reopened(
    plan: Plan,
    digests: dict[str, str],
    layout: _Layout,
    reopen: Callable[[Storage, str], TensorSource],
    reporter: ProgressReporter,
    cancelled: CancelFn | None,
) -> VerifyReport:
    """``verify: full``: the staged output read back through ``reopen`` (its format's reader) and
    compared entry by entry with what was written; the reader is closed whatever the outcome."""
    reopened = reopen(layout.storage, layout.sink_uri)
    try:
        return verify_output(plan, digests, reopened, reporter=reporter, cancelled=cancelled)
    finally:
        reopened.close()


def end_unpublished(target: str, job_id: str) -> dict[str, Any] | None:
    """For a job about to end without publishing in this attempt (cancelled, failed, out of
    attempts): the result of its publication (as a job records it) if an earlier attempt finished
    it (its manifest, naming the job, is at the target; the worker was lost before recording it),
    which is then the job's outcome: its output is complete and stays. Otherwise None, once what
    its attempts left is removed (:func:`discard_staging`). Either way no staging is left."""
    target = normalize_uri(target)
    done = published(_layout(open_storage(target), target, None, job_id), job_id)
    discard_staging(target, job_id)
    return done.to_dict() if done is not None else None


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
        "files": [{**o.facts(), "uri": layout.final(o.uri), "path": o.uri[len(layout.staging) + 1 :]} for o in outputs],
        "tensors": plan.tensors_total,
        "bytes": plan.bytes_total,
        "verify": report.to_dict() if report else {"ok": None, "skipped": True},
        "warnings": list(plan.warnings),
        "timings": timings,
        "memory": memory,
        **({"extras": jsonable(extras)} if extras else {}),
    }
    fence(job_id)  # a staged manifest is publishable by any later attempt: a stale one stages none
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


def _manifest_uri(layout: _Layout, outputs: list[OutputFile]) -> str:
    inside = all(o.uri.startswith(layout.sink_uri + "/") for o in outputs)
    return layout.manifest_candidates()[0 if inside else 1]


def fill_digests(storage: Storage, outputs: list[OutputFile], *, reread: bool) -> list[OutputFile]:
    """Every output's digest, reading back the files whose sink did not hash them as written.

    A file with a block digest (written out of order) is read back only when ``reread`` (``verify:
    full``): then its digest is added and its block digest checked against the bytes stored.
    """
    done = []
    for o in outputs:
        if o.digest is None and o.blocks is None:
            o = dataclasses.replace(o, digest=storage.digest(o.uri, o.algorithm))
        elif o.digest is None and reread:
            assert o.blocks is not None
            digest, blocks = stored_digests(storage, o.uri, o.blocks["block_size"], o.algorithm)
            if blocks != o.blocks[o.algorithm]:
                raise VerificationFailed(
                    f"{o.uri}: the stored bytes differ from those written (block digest {blocks},"
                    f" {o.blocks[o.algorithm]} as written)",
                    uri=o.uri,
                )
            o = dataclasses.replace(o, digest=digest)
        done.append(o)
    return done
