"""A fanned-out conversion end to end: prepare the layout, hand out the parts, wait for them, commit."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from ckptconv.core.errors import Cancelled, CkptconvError, InvalidRequest, TargetExists
from ckptconv.core.uri import normalize_uri
from ckptconv.engine.execute import CancelFn, ProgressFn, ProgressReporter, value_digest
from ckptconv.engine.fanout.commit import _commit
from ckptconv.engine.fanout.part import _reading, compute, run_part
from ckptconv.engine.fanout.records import _doc_uri, _gaps_uri, _part_uri
from ckptconv.engine.fanout.runner import InlineRunner, PartRunner
from ckptconv.engine.fanout.split import grid_part_size, split_parts
from ckptconv.engine.plan import Plan
from ckptconv.engine.publish import ConvertResult, _publish, _resume
from ckptconv.engine.run import verify_mode
from ckptconv.engine.staging import _discard, _discard_after_failure, _Layout, _layout
from ckptconv.formats import sink_class, target_exists
from ckptconv.formats.base import OutputFile, TensorSource
from ckptconv.formats.detect import check_format
from ckptconv.storage import open_storage
from ckptconv.storage.part_upload import DEFAULT_PART_SIZE, PartUpload

FANOUT_FORMATS = ("safetensors", "cs-h5", "torch", "tf", "cs-s3")
POLL_SECONDS = 0.2


def _prepare(
    plan: Plan,
    src: TensorSource,
    layout: _Layout,
    *,
    to: str,
    parallelism: int,
    sink_options: dict[str, Any],
    extra_files: dict[str, bytes],
) -> dict[str, Any]:
    storage = layout.storage
    options = {k: v for k, v in sink_options.items() if v is not None}
    if to in ("cs-h5", "tf", "cs-s3"):
        options["skeleton"] = True
    sink = sink_class(to)(storage, layout.sink_uri, **options)
    entries = plan.entries()
    sink.check(entries)
    digests: dict[str, str] = {}
    read_digests: dict[str, str] = {}
    try:
        sink.begin(entries, plan.spec)
        placed = sink.placed_keys()
        for step in plan.steps:
            if step.out.kind == "link":
                continue
            if step.out.key in placed:
                if step.out.nbytes == 0:  # no byte of any part holds it: checked here
                    digests[step.out.key] = value_digest(compute(step, _reading(src, read_digests)))
                sink.reserve(step.out.key)
                continue
            value = compute(step, _reading(src, read_digests))
            sink.write(step.out.key, value)
            digests[step.out.key] = value_digest(value)
            del value
        files = sink.finish_skeleton()
        side = sink.side_files()
        late = sink.late_recipe()
    except BaseException:
        sink.abort()
        raise
    for rel, data in extra_files.items():  # written whole, as a single-worker run writes them
        uri = storage.join(layout.staging, rel)
        storage.write_bytes(uri, data)
        side.append(OutputFile(uri, len(data), hashlib.sha256(data).hexdigest(), "config"))
    layouts = [f for f, _ in files]
    remote = storage.local_path(layout.sink_uri) is None
    total = sum(f.size for f in layouts)
    part_size = grid_part_size(total, parallelism) if remote else None
    described = []
    for i, (f, gaps) in enumerate(files):
        storage.write_bytes(_gaps_uri(layout, i), gaps)
        upload_id = None
        if remote:
            upload = PartUpload(
                storage.backend(f.uri), f.uri, part_size=part_size or DEFAULT_PART_SIZE, metadata=f.metadata
            )
            upload_id = upload.upload_id
        described.append({**f.to_dict(), "upload_id": upload_id})
    doc = {
        "version": 1,
        "format": to,
        "part_size": part_size,
        "files": described,
        "side_files": [[o.uri, o.size, o.sha256, o.role] for o in side],
        "parts": [[list(r) for r in p] for p in split_parts(layouts, parallelism, part_size)],
        "digests": digests,
        "read_digests": read_digests,
        "late": late,
    }
    storage.write_bytes(_doc_uri(layout), json.dumps(doc).encode())
    return doc


def run_fanout(
    plan: Plan,
    src: TensorSource,
    *,
    to: str,
    target: str,
    parallelism: int,
    runner: PartRunner | None = None,
    sink_options: dict[str, Any] | None = None,
    extra_files: dict[str, bytes] | None = None,
    staging: str | None = None,
    progress: ProgressFn | None = None,
    cancelled: CancelFn | None = None,
    job_id: str | None = None,
    verify: bool | str = True,
    extras: dict[str, Any] | None = None,
) -> ConvertResult:
    """Run ``plan`` as ``parallelism`` parts (see the module docstring); the result is the same
    files, byte for byte, that a single worker writes with the same sink options (``extra_files``
    as :func:`~ckptconv.engine.run.run_plan` takes them)."""
    check_format(to)
    if to not in FANOUT_FORMATS:
        raise InvalidRequest(
            f"parallelism > 1 writes {' or '.join(FANOUT_FORMATS)} outputs, not {to}",
            hint="convert with parallelism 1, or to one of those formats",
        )
    runner = runner or InlineRunner()
    target = normalize_uri(target)
    storage = open_storage(target)
    layout = _layout(storage, target, staging, job_id)
    reporter = ProgressReporter(progress)
    mode = verify_mode(verify)
    done = _resume(layout, job_id)
    if done is not None:
        return done
    if target_exists(storage, layout.target, to):
        raise TargetExists(f"{layout.target} already exists")
    _discard(layout)  # a previous try of this attempt may have left a partial staging area
    t0 = time.monotonic()
    count = 0
    try:
        doc = _prepare(
            plan,
            src,
            layout,
            to=to,
            parallelism=parallelism,
            sink_options=sink_options or {},
            extra_files=extra_files or {},
        )
        count = len(doc["parts"])
        reporter.stage("converting", plan.tensors_total, sum(f["size"] for f in doc["files"]))
        runner.dispatch(count)
        _await_parts(plan, src, layout, count, runner, reporter, cancelled, job_id)
        timings = {"convert_s": round(time.monotonic() - t0, 3)}
        _commit(
            plan, src, layout, doc, to=to, job_id=job_id, mode=mode, reporter=reporter, timings=timings, extras=extras
        )
    except BaseException:
        runner.stop()
        runner.wait_idle(count, timeout=max(5.0, 3 * runner.grace_seconds))
        _discard_after_failure(layout)  # with the multipart uploads under it
        raise
    result = _publish(layout, job_id)
    reporter.complete("done", plan.tensors_total, plan.bytes_total)
    return result


def _await_parts(
    plan: Plan,
    src: TensorSource,
    layout: _Layout,
    count: int,
    runner: PartRunner,
    reporter: ProgressReporter,
    cancelled: CancelFn | None,
    job_id: str | None,
) -> None:
    """Until every part is recorded: run the parts nobody claimed (the last first: other workers
    take them from the front of the queue), relay progress, stop on a failed part or a cancel."""
    storage = layout.storage
    dispatched = time.monotonic()
    pending = set(range(count))
    mine = count - 1  # run at once: this worker is one of the job's workers
    while pending:
        if cancelled is not None and cancelled():
            raise Cancelled("cancelled by request; nothing was published")
        problem = runner.failure()
        if problem is not None:
            raise CkptconvError.from_problem(problem)
        recorded = {i for i in pending if storage.exists(_part_uri(layout, i))}
        pending -= recorded
        stealable = [
            i
            for i in sorted(pending, reverse=True)
            if (i == mine or time.monotonic() - dispatched >= runner.grace_seconds) and not runner.held(i)
        ]
        for i in stealable[:1]:
            with runner.claim(i) as claimed:
                if claimed:
                    run_part(
                        plan,
                        src,
                        target=layout.target,
                        index=i,
                        job_id=job_id,
                        staging=layout.staging,
                        cancelled=cancelled,
                        runner=runner,
                    )
                    pending.discard(i)
            mine = -1
        tensors, nbytes = runner.reported()
        reporter.current.tensors_done = min(tensors, plan.tensors_total)
        reporter.current.bytes_done = nbytes
        reporter.advance(0, 0)
        if pending and not stealable:
            time.sleep(POLL_SECONDS)
