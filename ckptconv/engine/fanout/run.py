"""A fanned-out conversion end to end: take over (or clean up) an earlier attempt's fan-out, prepare
the layout, hand out the parts, wait for them, commit."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

from ckptconv.core.errors import CkptconvError, InvalidRequest, ObjectNotFound
from ckptconv.core.fencing import fence
from ckptconv.core.uri import basename, normalize_uri
from ckptconv.core.version import __version__
from ckptconv.engine.execute import CancelFn, ProgressFn, ProgressReporter, check_cancelled, value_digest
from ckptconv.engine.fanout.commit import _commit
from ckptconv.engine.fanout.part import _reading, compute, run_part
from ckptconv.engine.fanout.records import (
    LAYOUT_VERSION,
    _adopt,
    _doc_uri,
    _gaps_uri,
    _home,
    _part_uri,
    _read_doc,
    _recorded_parts,
    plan_digest,
)
from ckptconv.engine.fanout.runner import InlineRunner, PartRunner
from ckptconv.engine.fanout.split import grid_part_size, local_block_size, split_parts
from ckptconv.engine.plan import Plan
from ckptconv.engine.publish import ConvertResult, _publish
from ckptconv.engine.run import fit_uploads, resume_or_refuse, source_facts, verify_mode
from ckptconv.engine.staging import _attempt_stagings, _discard, _discard_after_failure, _Layout, _layout
from ckptconv.formats import sink_class
from ckptconv.formats.base import OutputFile, TensorSource, given_options
from ckptconv.formats.detect import check_format
from ckptconv.storage import open_storage
from ckptconv.storage.digests import hex_digest
from ckptconv.storage.direct_io import staging_bytes
from ckptconv.storage.part_upload import DEFAULT_PART_SIZE, PartUpload, upload_buffer_bytes

log = logging.getLogger(__name__)

FANOUT_FORMATS = ("safetensors", "cs-h5", "torch", "tf", "cs-s3")
POLL_SECONDS = 0.2
MAX_POLL_SECONDS = 1.0


def _prepare(
    plan: Plan,
    src: TensorSource,
    layout: _Layout,
    *,
    to: str,
    parallelism: int,
    sink_options: dict[str, Any],
    extra_files: dict[str, bytes],
    plan_key: str,
    planned: str,
    job_id: str | None,
    memory_budget: int | str | None = None,
) -> dict[str, Any]:
    """Lay the output out in staging and write its layout document (``planned``: the plan's
    digest, also part of ``plan_key``)."""
    storage = layout.storage
    options = given_options(sink_options)
    if to in ("cs-h5", "tf", "cs-s3"):
        options["skeleton"] = True
    sink = sink_class(to)(storage, layout.sink_uri, **options)
    entries = plan.entries()
    sink.check(entries)
    digests: dict[str, str] = {}
    read_digests: dict[str, str] = {}
    with src.reading_raw(sink.accepts_raw):  # as the single-worker executor reads
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
        side.append(OutputFile(uri, len(data), hex_digest(data), "config"))
    layouts = [f for f, _ in files]
    remote = storage.local_path(layout.sink_uri) is None
    total = sum(f.size for f in layouts)
    part_size = grid_part_size(total, parallelism) if remote else None
    # A local file's block digest is composed from the blocks its parts hash as they write them.
    block_size = None if remote else local_block_size(total, parallelism)
    memory = _part_memory(plan, src, memory_budget, part_size)
    described = []
    for i, (f, gaps) in enumerate(files):
        storage.write_bytes(_gaps_uri(layout, i), gaps)
        upload_id = None
        if remote:
            upload = PartUpload(
                storage.backend(f.uri),
                f.uri,
                part_size=part_size or DEFAULT_PART_SIZE,
                metadata=f.metadata,
            )
            upload_id = upload.upload_id
        described.append({**f.to_dict(), "upload_id": upload_id})
    doc = {
        "version": LAYOUT_VERSION,
        "plan_key": plan_key,
        "format": to,
        "part_size": part_size,
        "block_size": block_size,
        "files": described,
        "side_files": [[o.uri, o.size, o.digest, o.role] for o in side],
        "parts": [[list(r) for r in p] for p in split_parts(layouts, parallelism, part_size, block_size)],
        "digests": digests,
        "read_digests": read_digests,
        "late": late,
        "memory": memory,
        # The versions of the source's files the plan read (size, ETag) and what the plan is: each
        # part reads those versions and checks the plan it rebuilds from them.
        "sources": source_facts(src)["files"],
        "plan_digest": planned,
    }
    # The layout document makes this staging area adoptable by a later attempt: a stale attempt
    # never writes it (it discards its staging area instead, see run_fanout).
    fence(job_id)
    storage.write_bytes(_doc_uri(layout), json.dumps(doc).encode())
    return doc


def _part_memory(
    plan: Plan, src: TensorSource, budget: int | str | None, part_size: int | None
) -> dict[str, int | None]:
    """What each part's process may hold (``plan.memory``): the budget sizes every part's read-ahead
    and, on S3, how many upload parts of the grid it sends at once (fewer when the budget is tight)."""
    sizes = {e.key: e.nbytes for e in src.entries()}
    if part_size is None:  # local files: the staging buffers of the part's direct writes
        return plan.memory(sizes, budget, staging_bytes())
    return fit_uploads(plan, sizes, budget, lambda concurrency: upload_buffer_bytes(part_size, concurrency))[0]


def _plan_key(
    planned: str,
    src: TensorSource,
    *,
    to: str,
    parallelism: int,
    sink_options: dict[str, Any],
    extra_files: dict[str, bytes],
) -> str:
    """What decides a fan-out's layout and bytes: the plan (``planned``: its digest, of its entries,
    recipes and constant values), the source's files (sizes and ETags), the format and its options,
    the parts, the extra files and this version's code. Two attempts with one key write the same
    bytes to the same places."""
    facts = {
        "version": __version__,
        "layout": LAYOUT_VERSION,
        "plan": planned,
        "source": source_facts(src)["files"],
        "to": to,
        "parallelism": parallelism,
        "sink_options": given_options(sink_options),
        "extra_files": {rel: hashlib.sha256(data).hexdigest() for rel, data in extra_files.items()},
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


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
    memory_budget: int | str | None = None,
) -> ConvertResult:
    """Run ``plan`` as ``parallelism`` parts (see the module docstring); the result is the same
    files, byte for byte, that a single worker writes with the same sink options (``extra_files``
    as :func:`~ckptconv.engine.run.run_plan` takes them). ``memory_budget`` is each part's process's
    (see :func:`_part_memory`)."""
    check_format(to)
    if to not in FANOUT_FORMATS:
        raise InvalidRequest(
            f"parallelism > 1 writes {' or '.join(FANOUT_FORMATS)} outputs, not {to}",
            hint="convert with parallelism 1, or to one of those formats",
        )
    refused = sink_class(to).unsplittable(given_options(sink_options))
    if refused:
        raise InvalidRequest(f"parallelism > 1: {refused}", hint="convert with parallelism 1, or without compression")
    runner = runner or InlineRunner()
    target = normalize_uri(target)
    storage = open_storage(target)
    layout = _layout(storage, target, staging, job_id)
    reporter = ProgressReporter(progress)
    mode = verify_mode(verify)
    done = resume_or_refuse(layout, job_id, to, extra_files)
    if done is not None:
        return done
    _discard(layout)  # a previous try of this attempt may have left a partial staging area
    options = {"sink_options": sink_options or {}, "extra_files": extra_files or {}}
    planned = plan_digest(plan)
    key = _plan_key(planned, src, to=to, parallelism=parallelism, **options)
    t0 = time.monotonic()
    count = 0
    home, doc = layout, None
    try:
        home, doc = _take_over(layout, job_id, runner, key)
        reused = _recorded(home, doc)
        if doc is None:
            doc = _prepare(
                plan,
                src,
                layout,
                to=to,
                parallelism=parallelism,
                plan_key=key,
                planned=planned,
                job_id=job_id,
                memory_budget=memory_budget,
                **options,
            )
        count = len(doc["parts"])
        reporter.stage("converting", plan.tensors_total, sum(f["size"] for f in doc["files"]))
        runner.dispatch(count)
        _await_parts(plan, src, home, count, runner, reporter, cancelled, job_id, reused)
        timings = {"convert_s": round(time.monotonic() - t0, 3)}
        facts = {**(extras or {}), **({"parts_reused": len(reused)} if reused else {})}
        _commit(
            plan,
            src,
            home,
            doc,
            to=to,
            job_id=job_id,
            mode=mode,
            reporter=reporter,
            timings=timings,
            extras=facts,
            cancelled=cancelled,
        )
    except BaseException:
        runner.stop()
        runner.wait_idle(count, timeout=max(5.0, 3 * runner.grace_seconds))
        # A layout document makes the staging area adoptable: once this attempt is stale, its
        # successor may work there, and removes it itself (with its uploads) when it does not.
        if doc is None or _still_current(job_id):
            for area in {layout.staging: layout, home.staging: home}.values():
                _discard_after_failure(area)  # with the multipart uploads under it
        raise
    result = _publish(home, job_id)
    reporter.complete("done", plan.tensors_total, plan.bytes_total)
    return result


def _still_current(job_id: str | None) -> bool:
    """Whether the attempt in scope still owns the job (True outside a worker and when Redis
    cannot tell: then the job's next attempt, which takes over the staging areas, cleans up)."""
    try:
        fence(job_id)
    except Exception:  # LeaseLost, or Redis away
        return False
    return True


def _take_over(
    layout: _Layout, job_id: str | None, runner: PartRunner, plan_key: str
) -> tuple[_Layout, dict[str, Any] | None]:
    """Before a takeover fans out: stop the parts of the job's earlier attempts and wait until they
    let go of them; then adopt the newest earlier fan-out with this plan's key whose files are
    intact (its completed parts are not run again), and remove every other earlier staging area
    with its multipart uploads. Returns where the fan-out lives and its layout document (None:
    prepare afresh in ``layout``)."""
    if job_id is None:
        return layout, None
    own = basename(layout.staging)
    earlier = [
        s
        for s in _attempt_stagings(layout, job_id)
        if s.staging != layout.staging and not (own.isdigit() and _number(s) >= int(own))
    ]
    if not earlier:
        return layout, None
    fence(job_id)  # a stale attempt stops nobody's parts
    found = [(s, *_home(s)) for s in earlier]
    for area, _, doc in found:
        if doc is not None and _number(area) >= 0:
            prior = runner.for_attempt(_number(area))
            prior.stop()
            prior.wait_idle(len(doc["parts"]), timeout=max(5.0, 3 * runner.grace_seconds))
    adoptable = [(home, doc) for _, home, doc in found if doc is not None and doc.get("plan_key") == plan_key]
    adopted = next(((home, doc) for home, doc in adoptable if _intact(home, doc)), None)
    fence(job_id)
    if adopted is not None:
        _adopt(layout, adopted[0])
        log.info("job %s: adopting the fan-out staged by attempt %s", job_id, basename(adopted[0].staging))
    for area in earlier:
        if adopted is None or area.staging != adopted[0].staging:
            _discard(area)  # with its multipart uploads
    return adopted or (layout, None)


def _number(area: _Layout) -> int:
    """The attempt number of a staging area (-1 for a name that is not one)."""
    name = basename(area.staging)
    return int(name) if name.isdigit() else -1


def _intact(home: _Layout, doc: dict[str, Any]) -> bool:
    """Whether an earlier attempt's fan-out can be carried on: its gaps and side files are there,
    each local file whole, each S3 upload still open (no commit completed one)."""
    storage = home.storage
    try:
        for i, f in enumerate(doc["files"]):
            if not storage.exists(_gaps_uri(home, i)):
                return False
            if f["upload_id"] is not None:
                if storage.exists(f["uri"]):
                    return False
            elif storage.stat(f["uri"]).size != f["size"]:
                return False
        return all(storage.exists(uri) for uri, *_ in doc["side_files"])
    except ObjectNotFound:
        return False


def _recorded(home: _Layout, doc: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """The part records an adopted fan-out already holds, by part."""
    if doc is None:
        return {}
    present = _recorded_parts(home) & set(range(len(doc["parts"])))
    records = {i: _read_doc(home.storage, _part_uri(home, i)) for i in sorted(present)}
    return {i: r for i, r in records.items() if r is not None}


def _await_parts(
    plan: Plan,
    src: TensorSource,
    layout: _Layout,
    count: int,
    runner: PartRunner,
    reporter: ProgressReporter,
    cancelled: CancelFn | None,
    job_id: str | None,
    reused: dict[int, dict[str, Any]],
) -> None:
    """Until every part is recorded: run the parts nobody claimed (the last first: other workers
    take them from the front of the queue), relay progress, stop on a failed part or a cancel."""
    dispatched = time.monotonic()
    pending = set(range(count)) - set(reused)
    # Progress counts the parts an earlier attempt completed as done.
    reused_tensors = sum(len(r["digests"]) for r in reused.values())
    reused_bytes = sum(e - s for r in reused.values() for _, s, e, *_ in r["ranges"])
    mine = max(pending, default=-1)  # run at once: this worker is one of the job's workers
    interval = POLL_SECONDS
    while pending:
        check_cancelled(cancelled)
        problem = runner.failure()
        if problem is not None:
            raise CkptconvError.from_problem(problem)
        recorded = pending & _recorded_parts(layout)
        pending -= recorded
        late = time.monotonic() - dispatched >= runner.grace_seconds
        candidates = [i for i in sorted(pending, reverse=True) if late or i == mine]
        held = runner.held(candidates)
        orphan = next((i for i in candidates if i not in held), None)
        if orphan is not None:
            with runner.claim(orphan) as claimed:
                if claimed:
                    run_part(
                        plan,
                        src,
                        target=layout.target,
                        index=orphan,
                        job_id=job_id,
                        staging=layout.staging,
                        cancelled=cancelled,
                        runner=runner,
                    )
                    pending.discard(orphan)
            mine = -1
        tensors, nbytes = runner.reported()
        reporter.current.tensors_done = min(tensors + reused_tensors, plan.tensors_total)
        reporter.current.bytes_done = nbytes + reused_bytes
        reporter.advance(0, 0)
        if recorded:
            interval = POLL_SECONDS
        if pending and orphan is None:
            # Polled less often while nothing changes: a long part need not be asked after five
            # times a second, and a part just recorded is often followed by others.
            time.sleep(interval)
            interval = min(interval * 1.5, MAX_POLL_SECONDS)
