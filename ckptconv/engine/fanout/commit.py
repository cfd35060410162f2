"""The commit of a fanned-out conversion: check the part records tile every file, merge their digests."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import xxhash

from ckptconv.core.errors import VerificationFailed
from ckptconv.core.fencing import fence
from ckptconv.engine.execute import (
    CancelFn,
    ProgressReporter,
    VerifyReport,
    check_cancelled,
    check_written,
    verify_output,
)
from ckptconv.engine.fanout.records import _part_uri, _read_doc
from ckptconv.engine.fanout.tail import write_late_files, write_tails
from ckptconv.engine.plan import Plan
from ckptconv.engine.run import _fill_sha256, stage_manifest
from ckptconv.engine.staging import _Layout
from ckptconv.formats import source_class
from ckptconv.formats.base import OutputFile, TensorSource
from ckptconv.formats.layout import FileLayout
from ckptconv.storage.base import Storage
from ckptconv.storage.digests import BlockHasher
from ckptconv.storage.part_upload import PartUpload, upload_buffer_bytes

READ_BLOCK = 64 << 20  # the commit's reads: one buffer, reused


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
    tails, tail_parts, tail_blocks = write_tails(layout, doc, records)
    expected.update(tails)
    for fi, described in enumerate(doc["files"]):
        f = FileLayout.from_dict(described)
        ranges = sorted((s, e) for (i, s, e) in expected if i == fi)
        if described["upload_id"] is None:
            # A local file is hashed from the page cache, as a single worker's output is.
            sha256, hashes = _hash_file(storage, f.uri, ranges, cancelled)
            bad = [r for r in ranges if hashes[r] != expected[(fi, *r)]]
            if bad:
                raise VerificationFailed(f"{f.uri}: bytes {bad[0][0]}..{bad[0][1]} differ from what their part wrote")
            outputs.append(OutputFile(f.uri, f.size, sha256, "data"))
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
    outputs += [OutputFile(uri, size, sha, role) for uri, size, sha, role in doc["side_files"]]
    if mode == "full":
        # Read back once: each uploaded file's sha256, and its stored bytes against the blocks sent.
        outputs = _fill_sha256(storage, outputs, reread=True)
        reopened = source_class(to)(storage, layout.sink_uri)
        try:
            report = verify_output(plan, digests, reopened, reporter=reporter, cancelled=cancelled)
        finally:
            reopened.close()
    timings["verify_s"] = round(time.monotonic() - t1, 3)
    # What each part's process was given (fanout.run._part_memory); a layout written before it was
    # recorded there: the default, with a part upload of the grid's part size on S3.
    memory = doc.get("memory") or plan.memory(
        {e.key: e.nbytes for e in src.entries()},
        writer_buffers=upload_buffer_bytes(doc["part_size"]) if doc["part_size"] else 0,
    )
    facts = {"parallelism": len(doc["parts"]), **(extras or {})}
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


def _hash_file(
    storage: Storage, uri: str, ranges: list[tuple[int, int]], cancelled: CancelFn | None = None
) -> tuple[str, dict[tuple[int, int], str]]:
    """One read of the file: its sha256 and the xxh3 of each of ``ranges`` (which tile it in order);
    ``cancelled`` is asked between blocks (a large output takes a while)."""
    sha = hashlib.sha256()
    out = {}
    buf = memoryview(bytearray(min(READ_BLOCK, max((e - s for s, e in ranges), default=0))))
    for s, e in ranges:
        h = xxhash.xxh3_128()
        pos = s
        while pos < e:
            check_cancelled(cancelled)
            block = buf[: min(len(buf), e - pos)]
            storage.read_into(uri, pos, block)  # one block in several ranged GETs at once on S3
            sha.update(block)
            h.update(block)
            pos += len(block)
        out[(s, e)] = h.hexdigest()
    return sha.hexdigest(), out
