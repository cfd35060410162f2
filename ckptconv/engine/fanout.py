"""One conversion fanned out across several workers: parts cut by output bytes, one commit.

Formats whose byte layout is known before any value is read (safetensors; Cerebras H5 with
contiguous datasets, see :mod:`ckptconv.formats.layout`) can be written by several processes at
once, each its own byte ranges. The flow (all of it inside the job's staging area, under the
attempt that runs it, see :mod:`ckptconv.engine.run`):

1. **prepare** (the job's own worker): build the plan and the layout of every output file: the sink
   runs with every value that has a place in a file *reserved* and the rest (values, pickled
   objects, 0-d tensors) written, which leaves each file's *gap* bytes (headers, H5 metadata). A
   local file is created preallocated with its gaps in place; an S3 file gets a multipart upload.
   The bytes of all files are cut into ``parallelism`` parts balanced by bytes (on S3 along the
   upload's part grid, so each upload part has one writer), never by file or tensor names.
   ``.fanout/layout.json`` records files, gaps, uploads and the parts' byte ranges.
2. **parts** (any worker; the job's own worker runs the parts nobody claims): a part reads the
   values whose spans meet its ranges (a value cut by a part boundary is read by both parts),
   checks each against the hash of its source as read (the executor's xxh3 digests), writes its
   bytes with positioned writes (a preallocated file) or as upload parts, and records
   ``.fanout/part-NNNNN.json``: its ranges with the xxh3 of their bytes, the value digests, and
   its upload parts' ETags. A part whose record exists is never run again; a part is deterministic
   (same ranges, same bytes), so a redelivered or taken-over part rewrites identical bytes.
3. **commit** (the job's worker, fenced by its attempt): read every part record *from storage*
   (never from a task result), check their count and that their ranges tile every file, merge the
   digests (two parts that computed one value must agree) and compare them with the source's;
   complete the uploads (create-only), read each file once for its sha256 and the xxh3 of every
   part's ranges, then stage the manifest and publish as a single-worker run does (the manifest
   last). A commit run twice publishes once: the published manifest carries the job id.

A failure or cancellation stops the parts, waits for them to let go, and removes the staging area
with its incomplete multipart uploads: nothing reaches the target before the commit.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import xxhash

from ckptconv.core.bounded import load_json
from ckptconv.core.errors import (
    Cancelled,
    CkptconvError,
    InvalidRequest,
    ObjectNotFound,
    TargetExists,
    VerificationFailed,
)
from ckptconv.core.fencing import fence
from ckptconv.core.uri import normalize_uri
from ckptconv.engine.execute import (
    IDENTITY,
    CancelFn,
    ProgressFn,
    ProgressReporter,
    VerifyReport,
    check_produced,
    check_written,
    value_digest,
    verify_output,
)
from ckptconv.engine.plan import Plan, Step
from ckptconv.engine.prefetch import Prefetcher
from ckptconv.engine.run import (
    ConvertResult,
    _discard,
    _discard_after_failure,
    _Layout,
    _layout,
    _publish,
    _resume,
    stage_manifest,
    verify_mode,
)
from ckptconv.formats import sink_class, source_class, target_exists
from ckptconv.formats.base import OutputFile, TensorSource
from ckptconv.formats.detect import check_format
from ckptconv.formats.layout import FileLayout, Span, value_bytes
from ckptconv.storage import open_storage
from ckptconv.storage.base import Storage
from ckptconv.storage.local import LocalPatch
from ckptconv.storage.part_upload import DEFAULT_PART_SIZE, PartUpload, upload_buffer_bytes

__all__ = ["FANOUT_FORMATS", "InlineRunner", "PartRunner", "run_fanout", "run_part", "split_parts"]

FANOUT_FORMATS = ("safetensors", "cs-h5")
FANOUT_DIR = ".fanout"
LOCAL_UNIT = 1 << 20  # local files are cut anywhere; parts end on a MiB boundary
MIN_UNITS_PER_PART = 4  # S3: the part grid is made fine enough for this many units per part
POLL_SECONDS = 0.2
READ_BLOCK = 64 << 20  # the commit's reads: one buffer, reused


class PartRunner(Protocol):
    """How a job's parts are handed out: by the worker (part tasks on the queue, leases in Redis),
    or :class:`InlineRunner` (every part in this process, one after another)."""

    # Seconds a dispatched part may stay unclaimed before the job's own worker runs it itself.
    grace_seconds: float

    def dispatch(self, count: int) -> None:
        """Queue one task for each of parts ``0 .. count - 1``."""

    def claim(self, index: int) -> contextlib.AbstractContextManager[bool]:
        """Hold part ``index`` while it runs (yields False when another process holds it)."""

    def held(self, index: int) -> bool:
        """Whether a live process holds part ``index``."""

    def report(self, index: int, tensors: int, nbytes: int) -> None:
        """Part ``index`` has written ``tensors`` values and ``nbytes`` bytes so far."""

    def reported(self) -> tuple[int, int]:
        """Values and bytes written by every part so far."""

    def failure(self) -> dict[str, Any] | None:
        """The problem of a part that failed for good (the job fails with it), if any."""

    def stop(self) -> None:
        """Tell the parts still running to stop at their next check."""

    def wait_idle(self, count: int, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until no process holds any of the ``count`` parts."""


class InlineRunner:
    """Every part in this process (the command line, the Python API): same bytes, no parallelism."""

    grace_seconds = 0.0

    def __init__(self) -> None:
        self._progress: dict[int, tuple[int, int]] = {}

    def dispatch(self, count: int) -> None:
        pass

    @contextlib.contextmanager
    def claim(self, index: int) -> Iterator[bool]:
        yield True

    def held(self, index: int) -> bool:
        return False

    def report(self, index: int, tensors: int, nbytes: int) -> None:
        self._progress[index] = (tensors, nbytes)

    def reported(self) -> tuple[int, int]:
        return sum(t for t, _ in self._progress.values()), sum(b for _, b in self._progress.values())

    def failure(self) -> dict[str, Any] | None:
        return None

    def stop(self) -> None:
        pass

    def wait_idle(self, count: int, timeout: float) -> None:
        pass


# --- cutting the output into parts -----------------------------------------------------------


def _units(files: list[FileLayout], part_size: int | None) -> list[tuple[int, int, int]]:
    """``(file, start, end)`` pieces no part boundary may cut: upload parts on S3, MiB elsewhere."""
    out = []
    for i, f in enumerate(files):
        if part_size is None:
            bounds = [(s, min(s + LOCAL_UNIT, f.size)) for s in range(0, f.size, LOCAL_UNIT)]
        else:
            grid = PartUpload.__new__(PartUpload)  # the grid arithmetic only: no upload, no pool
            grid.part_size = part_size
            bounds = []
            number = 1
            while f.size and grid.part_bounds(number)[0] < f.size:
                start, end = grid.part_bounds(number)
                bounds.append((start, min(end, f.size)))
                number += 1
        out += [(i, s, e) for s, e in bounds]
    return out


def split_parts(
    files: list[FileLayout], parallelism: int, part_size: int | None = None
) -> list[list[tuple[int, int, int]]]:
    """The byte ranges ``[(file, start, end), ...]`` of each part: consecutive units of the files'
    concatenated bytes, each unit to the part its middle byte falls in, so every part holds about
    ``total / parallelism`` bytes. Never more parts than units; no part is empty."""
    units = _units(files, part_size)
    total = sum(e - s for _, s, e in units)
    count = max(1, min(parallelism, len(units)))
    parts: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    done = 0
    for fi, s, e in units:
        k = min(count - 1, int((done + (e - s) / 2) * count / max(total, 1)))
        ranges = parts[k]
        if ranges and ranges[-1][0] == fi and ranges[-1][2] == s:
            ranges[-1] = (fi, ranges[-1][1], e)
        else:
            ranges.append((fi, s, e))
        done += e - s
    return [p for p in parts if p]


def grid_part_size(total: int, parallelism: int) -> int:
    """An upload part size small enough for several units per part, within S3's limits."""
    from ckptconv.storage.s3 import MIN_PART_SIZE

    want = math.ceil(total / max(1, parallelism * MIN_UNITS_PER_PART))
    size = max(MIN_PART_SIZE, min(DEFAULT_PART_SIZE, want))
    return -(-size // (1 << 20)) << 20


# --- where things are in staging ---------------------------------------------------------------


def _doc_uri(layout: _Layout) -> str:
    return layout.storage.join(layout.staging, FANOUT_DIR, "layout.json")


def _part_uri(layout: _Layout, index: int) -> str:
    return layout.storage.join(layout.staging, FANOUT_DIR, f"part-{index:05d}.json")


def _gaps_uri(layout: _Layout, index: int) -> str:
    return layout.storage.join(layout.staging, FANOUT_DIR, f"gaps-{index:05d}.bin")


def _read_doc(storage: Storage, uri: str) -> dict[str, Any] | None:
    try:
        return load_json(storage.read_all(uri), what=uri)
    except ObjectNotFound:
        return None


def compute(step: Step, read: Callable[[str], Any]) -> Any:
    """The value of one step from its inputs as ``read`` gives them."""
    if not step.inputs:
        return step.out.value
    value = (step.transform or IDENTITY)([read(k) for k in step.inputs])
    check_produced(step.out, value)
    return value


def _reading(src: TensorSource, read_digests: dict[str, str]) -> Callable[[str], Any]:
    """Reads one source value at a time, recording its digest."""

    def read(key: str) -> Any:
        value = src.read(key)
        read_digests[key] = value_digest(value)
        return value

    return read


def _part_inputs(files: list[FileLayout], ranges: list[list[int]], steps: dict[str, Step]) -> list[str]:
    """The source keys a part reads, in the order it reads them (see run_part's loop)."""
    keys: list[str] = []
    last = None
    for fi, start, end in ranges:
        for _, _, span, _ in _pieces(files[fi], start, end):
            if span is not None and span.source != last:
                keys += steps[span.source].inputs
                last = span.source
    return keys


# --- 1. prepare ------------------------------------------------------------------------------------


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
    if to == "cs-h5":
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
            upload_id = PartUpload(storage.backend(f.uri), f.uri, part_size=part_size or DEFAULT_PART_SIZE).upload_id
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
    }
    storage.write_bytes(_doc_uri(layout), json.dumps(doc).encode())
    return doc


# --- 2. one part -----------------------------------------------------------------------------------


def _pieces(f: FileLayout, start: int, end: int) -> Iterator[tuple[int, int, Span | None, int]]:
    """``(offset, length, span, at)`` covering ``[start, end)`` of ``f`` in order: ``span`` None is
    a gap whose bytes start at ``at`` of the file's gap bytes; otherwise ``at`` is the offset in
    the span's value."""
    offsets = [s.offset for s in f.spans]
    gap_at, gap_starts = 0, []
    for gs, ge in f.gaps():
        gap_starts.append((gs, ge, gap_at))
        gap_at += ge - gs
    pos = start
    i = max(0, bisect.bisect_right(offsets, pos) - 1)
    g = max(0, bisect.bisect_right([gs for gs, _, _ in gap_starts], pos) - 1)
    while pos < end:
        while i < len(f.spans) and f.spans[i].offset + f.spans[i].nbytes <= pos:
            i += 1
        if i < len(f.spans) and f.spans[i].offset <= pos:
            s = f.spans[i]
            n = min(end, s.offset + s.nbytes) - pos
            yield pos, n, s, pos - s.offset
        else:
            while gap_starts[g][1] <= pos:
                g += 1
            gs, ge, at = gap_starts[g]
            n = min(end, ge) - pos
            yield pos, n, None, at + pos - gs
        pos += n


def run_part(
    plan: Plan,
    src: TensorSource,
    *,
    target: str,
    index: int,
    job_id: str | None,
    staging: str | None = None,
    cancelled: CancelFn | None = None,
    runner: PartRunner | None = None,
) -> bool:
    """Write part ``index`` of a prepared fan-out and record it; False when it was recorded before."""
    target = normalize_uri(target)
    storage = open_storage(target)
    layout = _layout(storage, target, staging, job_id)
    doc = _read_doc(storage, _doc_uri(layout))
    if doc is None:
        raise VerificationFailed("the fan-out layout is missing from staging (the attempt was discarded)")
    if storage.exists(_part_uri(layout, index)):
        return False
    files = [FileLayout.from_dict(f) for f in doc["files"]]
    steps = {s.out.key: s for s in plan.steps}
    gaps: dict[int, bytes] = {}
    writers: dict[int, Any] = {}
    digests: dict[str, str] = {}
    read_digests: dict[str, str] = {}
    recorded, tensors, written = [], 0, 0
    current: tuple[str, memoryview, Any] | None = None
    # Values are read ahead (as the executor reads them) while the previous one is written.
    keys = _part_inputs(files, doc["parts"][index], steps)
    sizes = {e.key: e.nbytes for e in src.entries()}

    def hashed_as_read(key: str, value: Any) -> None:
        read_digests[key] = value_digest(value)

    fetcher = Prefetcher(
        src,
        keys,
        sizes,
        max((sizes.get(k, 0) for k in keys), default=0),
        workers=src.read_parallelism,
        on_read=hashed_as_read,
    )

    def read(key: str) -> Any:
        value = fetcher.get(key)
        fetcher.release(key)  # held by the step being computed only
        return value

    try:
        for fi, start, end in doc["parts"][index]:
            f = files[fi]
            if fi not in gaps:
                gaps[fi] = storage.read_all(_gaps_uri(layout, fi))
                writers[fi] = _writer(storage, f, doc)
            h = xxhash.xxh3_128()
            for offset, n, span, at in _pieces(f, start, end):
                if span is None:
                    piece = memoryview(gaps[fi])[at : at + n]
                else:
                    if current is None or current[0] != span.source:
                        if cancelled is not None and cancelled():
                            raise Cancelled("cancelled by request; nothing was published")
                        current = None  # drop the previous value before reading the next
                        value = compute(steps[span.source], read)
                        digests[span.source] = value_digest(value)
                        current = (span.source, value_bytes(value), value)
                        tensors += 1
                    piece = current[1][at : at + n]
                writers[fi].write_at(offset, piece)
                h.update(piece)
                written += n
                if runner is not None:
                    runner.report(index, tensors, written)
            recorded.append([fi, start, end, h.hexdigest()])
        current = None
        uploaded = {}
        for fi, w in writers.items():
            if isinstance(w, PartUpload):
                uploaded[str(fi)] = w.flush(files[fi].size)
            else:
                w.close(sync=True)
    except BaseException:
        for w in writers.values():
            if isinstance(w, LocalPatch):
                w.close(sync=False)
        raise
    finally:
        fetcher.stop()
    mismatches = check_written(_sub_plan(plan, digests), digests, read_digests).mismatches
    if mismatches:
        raise VerificationFailed(f"part {index}: " + "; ".join(mismatches[:5]), mismatches=mismatches[:50])
    record = {
        "index": index,
        "ranges": recorded,
        "uploaded": uploaded,
        "digests": digests,
        "read_digests": read_digests,
    }
    fence(job_id)  # a part of an attempt that lost the job records nothing
    with contextlib.suppress(TargetExists):  # a duplicate that ran meanwhile wrote the same record
        storage.write_bytes(_part_uri(layout, index), json.dumps(record).encode())
    return True


def _writer(storage: Storage, f: FileLayout, doc: dict[str, Any]) -> Any:
    described = next(d for d in doc["files"] if d["uri"] == f.uri)
    if described["upload_id"] is None:
        return LocalPatch(f.uri)
    return PartUpload(
        storage.backend(f.uri),
        f.uri,
        part_size=doc["part_size"],
        upload_id=described["upload_id"],
    )


def _sub_plan(plan: Plan, keys: dict[str, str]) -> Plan:
    """The steps of ``plan`` whose outputs are in ``keys`` (what one part or the prepare wrote)."""
    return Plan([s for s in plan.steps if s.out.key in keys], plan.spec)


# --- the job's own worker: prepare, await the parts, commit ---------------------------------------


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


# --- 3. commit ------------------------------------------------------------------------------------


def _commit(
    plan: Plan,
    src: TensorSource,
    layout: _Layout,
    doc: dict[str, Any],
    *,
    to: str,
    job_id: str | None,
    mode: str,
    reporter: ProgressReporter,
    timings: dict[str, float],
    extras: dict[str, Any] | None,
) -> None:
    storage = layout.storage
    t1 = time.monotonic()
    records = []
    for i, ranges in enumerate(doc["parts"]):
        record = _read_doc(storage, _part_uri(layout, i))
        if record is None:
            raise VerificationFailed(f"part {i} of {len(doc['parts'])} has no record; nothing was published")
        if [r[:3] for r in record["ranges"]] != ranges:
            raise VerificationFailed(f"part {i} recorded other byte ranges than it was given")
        records.append(record)
    _check_tiling(doc)
    digests, read_digests = dict(doc["digests"]), dict(doc["read_digests"])
    conflicts = []
    for record in records:
        for key, d in record["digests"].items():
            if digests.setdefault(key, d) != d:
                conflicts.append(f"{key}: two parts wrote different values")
        for key, d in record["read_digests"].items():
            if read_digests.setdefault(key, d) != d:
                conflicts.append(f"{key}: two parts read different values")
    report: VerifyReport | None = None
    if mode != "off":
        reporter.stage("verifying", plan.tensors_total, plan.bytes_total)
        report = check_written(plan, digests, read_digests)
        report.mismatches[:0] = conflicts
        report.ok = report.ok and not conflicts
    outputs: list[OutputFile] = []
    expected = {(fi, s, e): h for record in records for fi, s, e, h in record["ranges"]}
    for fi, described in enumerate(doc["files"]):
        f = FileLayout.from_dict(described)
        if described["upload_id"] is not None:
            parts = [p for record in records for p in record["uploaded"].get(str(fi), [])]
            fence(job_id)
            upload = PartUpload(
                storage.backend(f.uri),
                f.uri,
                part_size=doc["part_size"],
                upload_id=described["upload_id"],
            )
            upload.complete_parts(parts, f.size)
        ranges = sorted((s, e) for (i, s, e) in expected if i == fi)
        sha256, hashes = _hash_file(storage, f.uri, ranges)
        bad = [r for r in ranges if hashes[r] != expected[(fi, *r)]]
        if bad:
            raise VerificationFailed(f"{f.uri}: bytes {bad[0][0]}..{bad[0][1]} differ from what their part wrote")
        outputs.append(OutputFile(f.uri, f.size, sha256, "data"))
    outputs += [OutputFile(uri, size, sha, role) for uri, size, sha, role in doc["side_files"]]
    if mode == "full":
        reopened = source_class(to)(storage, layout.sink_uri)
        try:
            report = verify_output(plan, digests, reopened, reporter=reporter)
        finally:
            reopened.close()
    timings["verify_s"] = round(time.monotonic() - t1, 3)
    # Each part's process uploads its ranges of an S3 target through a part upload of the grid's part size.
    buffers = upload_buffer_bytes(doc["part_size"]) if doc["part_size"] else 0
    memory = plan.memory({e.key: e.nbytes for e in src.entries()}, writer_buffers=buffers)
    facts = {"parallelism": len(doc["parts"]), **(extras or {})}
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
        extras=facts,
    )


def _check_tiling(doc: dict[str, Any]) -> None:
    """The parts' ranges cover every byte of every file exactly once."""
    for fi, f in enumerate(doc["files"]):
        ranges = sorted((s, e) for part in doc["parts"] for i, s, e in part if i == fi)
        cursor = 0
        for s, e in ranges:
            if s != cursor:
                raise VerificationFailed(f"{f['uri']}: the parts leave bytes {cursor}..{s} unwritten or overlap")
            cursor = e
        if cursor != f["size"]:
            raise VerificationFailed(f"{f['uri']}: the parts stop at byte {cursor} of {f['size']}")


def _hash_file(storage: Storage, uri: str, ranges: list[tuple[int, int]]) -> tuple[str, dict[tuple[int, int], str]]:
    """One read of the file: its sha256 and the xxh3 of each of ``ranges`` (which tile it in order)."""
    sha = hashlib.sha256()
    out = {}
    buf = memoryview(bytearray(min(READ_BLOCK, max((e - s for s, e in ranges), default=0))))
    for s, e in ranges:
        h = xxhash.xxh3_128()
        pos = s
        while pos < e:
            block = buf[: min(len(buf), e - pos)]
            storage.read_into(uri, pos, block)  # one block in several ranged GETs at once on S3
            sha.update(block)
            h.update(block)
            pos += len(block)
        out[(s, e)] = h.hexdigest()
    return sha.hexdigest(), out
