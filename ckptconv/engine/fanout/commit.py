"""The commit of a fanned-out conversion: check the part records tile every file, merge their digests."""

from __future__ import annotations

import time
from typing import Any

from ckptconv.core.errors import VerificationFailed
from ckptconv.core.fencing import fence
from ckptconv.engine.execute import (
    CancelFn,
    ProgressReporter,
    VerifyReport,
    check_cancelled,
    check_written,
)
from ckptconv.engine.fanout.records import _part_uri, _read_doc, check_layout, check_record, layout_memory
from ckptconv.engine.fanout.tail import write_late_files, write_tails
from ckptconv.engine.plan import Plan
from ckptconv.engine.run import fill_digests, stage_manifest, verify_reopened
from ckptconv.engine.staging import _Layout
from ckptconv.formats import source_class
from ckptconv.formats.base import OutputFile, TensorSource
from ckptconv.formats.layout import FileLayout
from ckptconv.storage.digests import BlockHasher
from ckptconv.storage.part_upload import PartUpload


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
    cancelled: CancelFn | None = None,
) -> None:
    storage = layout.storage
    check_cancelled(cancelled)  # the parts may all have been recorded since the last look
    t1 = time.monotonic()
    check_layout(doc)
    records = []
    for i, ranges in enumerate(doc["parts"]):
        record = _read_doc(storage, _part_uri(layout, i))
        if record is None:
            raise VerificationFailed(f"part {i} of {len(doc['parts'])} has no record; nothing was published")
        check_record(record, i)
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
    tail_parts, tail_blocks = write_tails(layout, doc, records)
    for fi, described in enumerate(doc["files"]):
        f = FileLayout.from_dict(described)
        if described["upload_id"] is None:
            # Its blocks were hashed as its parts wrote them: its block digest, without reading
            # it back (``verify: full`` reads it, below).
            blocks = _block_digest(records, fi, f, doc["block_size"], tail_blocks.get(fi, {}))
            outputs.append(OutputFile(f.uri, f.size, None, "data", blocks=blocks))
            continue
        # An upload's parts were hashed as they went out: its block digest, without reading it back.
        blocks = _block_digest(records, fi, f, doc["part_size"], tail_blocks.get(fi, {}))
        parts = [p for record in records for p in record["uploaded"].get(str(fi), [])] + tail_parts.get(fi, [])
        check_cancelled(cancelled)
        fence(job_id)
        upload = PartUpload(storage.backend(f.uri), f.uri, part_size=doc["part_size"], upload_id=described["upload_id"])
        upload.complete_parts(parts, f.size)
        outputs.append(OutputFile(f.uri, f.size, None, "data", blocks=blocks))
    outputs += write_late_files(layout, doc, records, to)
    outputs += [OutputFile(uri, size, digest, role) for uri, size, digest, role in doc["side_files"]]
    if mode == "full":
        # Read back once: each file's digest, and its stored bytes against the blocks written.
        outputs = fill_digests(storage, outputs, reread=True)
        report = verify_reopened(plan, digests, layout, source_class(to), reporter, cancelled)
    timings["verify_s"] = round(time.monotonic() - t1, 3)
    # What each part's process was given, as the parts split it (records.layout_memory).
    memory = layout_memory(plan, {e.key: e.nbytes for e in src.entries()}, doc)
    # The processes the run used: with no bytes for parts to write (a cs-s3 output of empty
    # tensors only) there are no parts, and the prepare and the commit did it all, as one.
    facts = {"parallelism": max(1, len(doc["parts"])), **(extras or {})}
    check_cancelled(cancelled)
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
    """The parts' ranges cover every byte of every file exactly once (but a tail, see write_tails)."""
    for fi, f in enumerate(doc["files"]):
        end = f["size"] if f.get("tail") is None else f["tail"]
        ranges = sorted((s, e) for part in doc["parts"] for i, s, e in part if i == fi)
        cursor = 0
        for s, e in ranges:
            if s != cursor:
                raise VerificationFailed(f"{f['uri']}: the parts leave bytes {cursor}..{s} unwritten or overlap")
            cursor = e
        if cursor != end:
            raise VerificationFailed(f"{f['uri']}: the parts stop at byte {cursor} of {end}")


def _block_digest(
    records: list[dict[str, Any]], fi: int, f: FileLayout, block_size: int, tail: dict[int, str]
) -> dict[str, Any]:
    """The block digest of file ``fi`` from the blocks each part (and the commit, of a ``tail``)
    hashed as it sent them."""
    hasher = BlockHasher(block_size)
    try:
        hasher.merge(tail)
        for record in records:
            hasher.merge({int(n): h for n, h in record.get("blocks", {}).get(str(fi), {}).items()})
        return hasher.to_dict(f.size)
    except ValueError as e:
        raise VerificationFailed(f"{f.uri}: the parts' records do not hash every block once: {e}", uri=f.uri) from e
