"""One part of a fanned-out conversion: read the values its byte ranges meet, write those bytes, record them."""

from __future__ import annotations

import bisect
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from ckptconv.core.errors import CorruptCheckpoint, TargetExists, VerificationFailed
from ckptconv.core.fencing import fence
from ckptconv.core.uri import normalize_uri
from ckptconv.engine.execute import (
    CancelFn,
    apply_transform,
    check_cancelled,
    check_produced,
    check_written,
    value_digest,
)
from ckptconv.engine.fanout.records import _gaps_uri, _home, _part_uri, check_layout, layout_memory, plan_digest
from ckptconv.engine.fanout.runner import PartRunner
from ckptconv.engine.fanout.tail import HeldUpload, held_uri
from ckptconv.engine.plan import Plan, Step
from ckptconv.engine.prefetch import Prefetcher
from ckptconv.engine.staging import _layout
from ckptconv.formats.base import TensorSource
from ckptconv.formats.layout import FileLayout, Span, span_bytes, value_bytes
from ckptconv.formats.memory import POOL
from ckptconv.formats.sharding import WRITE_PIECE_BYTES
from ckptconv.storage import open_storage
from ckptconv.storage.base import Storage
from ckptconv.storage.digests import ALGORITHM, WrittenBlocks
from ckptconv.storage.local import LocalPatch
from ckptconv.storage.part_upload import DEFAULT_CONCURRENCY, PartUpload
from ckptconv.storage.pinned import hold_versions


def compute(step: Step, read: Callable[[str], Any]) -> Any:
    """The value of one step from its inputs as ``read`` gives them (tensors as bytes, for a
    transform that takes them so; torch tensors for any other)."""
    if not step.inputs:
        return step.out.value
    value = apply_transform(step.transform, [read(k) for k in step.inputs])
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


def _read_ahead(plan: Plan, sizes: dict[str, int], doc: dict[str, Any], largest: int) -> int:
    """The bytes a part reads ahead: its largest value, or what a memory budget leaves (see
    fanout.run._part_memory and records.layout_memory)."""
    memory = layout_memory(plan, sizes, doc)
    return max(largest, int(memory["read_ahead_bytes"] or 0)) if memory.get("budget_bytes") else largest


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
    layout, doc = _home(_layout(storage, target, staging, job_id))  # the attempt's own, or the one it adopted
    if doc is None:
        raise VerificationFailed("the fan-out layout is missing from staging (the attempt was discarded)")
    check_layout(doc)
    if storage.exists(_part_uri(layout, index)):
        return False
    # This process opened the source anew: it must read what the plan read, not an object put
    # under the same key since (ckptconv.storage.pinned).
    hold_versions(src.storage, [(f["uri"], f.get("etag")) for f in doc["sources"]])
    if plan_digest(plan) != doc["plan_digest"]:
        raise CorruptCheckpoint(
            "this part's plan differs from the job's: the checkpoint (or the model's config) changed since the "
            "job planned it",
            hint="convert again once nothing writes the source any more",
        )
    files = [FileLayout.from_dict(f) for f in doc["files"]]
    steps = {s.out.key: s for s in plan.steps}
    gaps: dict[int, bytes] = {}
    writers: dict[int, Any] = {}
    local_blocks: dict[int, WrittenBlocks] = {}  # a local file's blocks, hashed as this part writes them
    digests: dict[str, str] = {}
    read_digests: dict[str, str] = {}
    crcs: dict[str, int] = {}  # the checksums the format records of the values this part computed
    recorded, tensors, written = [], 0, 0
    current: tuple[str, memoryview, Any] | None = None
    # Values are read ahead while the previous one is written, within a budget that counts the one
    # being written (as the executor reads them).
    keys = _part_inputs(files, doc["parts"][index], steps)
    sizes = {e.key: e.nbytes for e in src.entries()}

    def hashed_as_read(key: str, value: Any) -> None:
        read_digests[key] = value_digest(value)

    largest = max((sizes.get(k, 0) for k in keys), default=0)
    # A part writes the bytes of its values: a source that can read tensors as bytes does (a part
    # that only moves bytes never imports torch), as the single-worker executor does. Its estimate
    # is the plan's, as a single worker's: the buffer pool holds no more than the largest value
    # (formats/memory.py), and nothing once the part is done.
    with src.reading_raw(True), POOL.capped(max(largest, plan.largest_entry_bytes())):
        fetcher = Prefetcher(
            src,
            keys,
            sizes,
            _read_ahead(plan, sizes, doc, largest),
            workers=src.read_parallelism,
            on_read=hashed_as_read,
        )

        taken: list[str] = []  # the source keys of the value being written

        def read(key: str) -> Any:
            taken.append(key)
            return fetcher.get(key)

        def let_go() -> None:
            # The reads ahead claim the bytes of a value once it is written and gone, as the
            # executor's do: its buffer is back in the pool for the next value, which is read into
            # it rather than into fresh memory the kernel must zero first (as much CPU as the read).
            for key in taken:
                fetcher.release(key)
            taken.clear()

        try:
            ranges = doc["parts"][index]
            for k, (fi, start, end) in enumerate(ranges):
                f = files[fi]
                if fi not in gaps:
                    gaps[fi] = storage.read_all(_gaps_uri(layout, fi))
                    writers[fi] = _writer(storage, f, doc, held_uri(layout, fi))
                    if isinstance(writers[fi], LocalPatch):
                        local_blocks[fi] = WrittenBlocks(doc["block_size"])
                for offset, n, span, at in _pieces(f, start, end):
                    if span is None:
                        _write_piece(writers[fi], local_blocks.get(fi), offset, memoryview(gaps[fi])[at : at + n])
                    else:
                        if current is None or current[0] != span.source:
                            check_cancelled(cancelled)
                            current = None  # the previous value's last reference: gone before the next is read
                            let_go()
                            value = compute(steps[span.source], read)
                            digests[span.source] = value_digest(value)
                            current = (span.source, value_bytes(value), value)
                            del value
                            tensors += 1
                        _write_piece(
                            writers[fi],
                            local_blocks.get(fi),
                            offset,
                            span_bytes(f, span, current[1], crcs)[at : at + n],
                        )
                    written += n
                    if runner is not None:
                        runner.report(index, tensors, written)
                recorded.append([fi, start, end])
                if isinstance(writers[fi], LocalPatch) and all(r[0] != fi for r in ranges[k + 1 :]):
                    # Done with this file: its staging buffers go now, not when the part ends (a
                    # part across many files would otherwise hold them all).
                    writers[fi].close(sync=True)
            current = None
            uploaded, blocks = {}, {}
            for fi, w in writers.items():
                if not isinstance(w, LocalPatch):
                    uploaded[str(fi)] = w.flush(files[fi].size)
                    # Hashed as they went out: the commit composes the file's block digest from these.
                    blocks[str(fi)] = w.blocks.hashed()
                else:
                    w.close(sync=True)
                    # Its ranges are whole blocks (but where a tail cuts one: the commit hashes that).
                    blocks[str(fi)] = local_blocks[fi].hashed(files[fi].size)
        except BaseException:
            # Before the lease goes: an upload part still in flight would reach the store after
            # another attempt took the part over.
            for w in writers.values():
                if isinstance(w, LocalPatch):
                    w.abandon()
                else:
                    w.stop()
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
        "digest": ALGORITHM,  # the hash of "blocks"
        "blocks": blocks,
        "digests": digests,
        "read_digests": read_digests,
        "crcs": crcs,
    }
    fence(job_id)  # a part of an attempt that lost the job records nothing
    with contextlib.suppress(TargetExists):  # a duplicate that ran meanwhile wrote the same record
        storage.write_bytes(_part_uri(layout, index), json.dumps(record).encode())
    return True


def _write_piece(writer: Any, blocks: WrittenBlocks | None, offset: int, piece: memoryview) -> None:
    """Write ``piece`` at ``offset``, in pieces, each hashed into ``blocks`` (a local file's) right
    after it is written, while still in the CPU's caches: a whole value (up to hundreds of MB) would
    be read from memory twice, and single writes that large into the page cache cost more per byte."""
    for done in range(0, len(piece), WRITE_PIECE_BYTES):
        chunk = piece[done : done + WRITE_PIECE_BYTES]
        writer.write_at(offset + done, chunk)
        if blocks is not None:
            blocks.wrote(offset + done, chunk)


def _writer(storage: Storage, f: FileLayout, doc: dict[str, Any], held: str) -> Any:
    described = next(d for d in doc["files"] if d["uri"] == f.uri)
    if described["upload_id"] is None:
        return LocalPatch(f.uri, direct=True)
    upload = PartUpload(
        storage.backend(f.uri),
        f.uri,
        part_size=doc["part_size"],
        concurrency=(doc.get("memory") or {}).get("upload_concurrency") or DEFAULT_CONCURRENCY,
        upload_id=described["upload_id"],
    )
    return upload if f.tail is None else HeldUpload(storage, upload, f.tail, held)


def _sub_plan(plan: Plan, keys: dict[str, str]) -> Plan:
    """The steps of ``plan`` whose outputs are in ``keys`` (what one part or the prepare wrote)."""
    return Plan([s for s in plan.steps if s.out.key in keys], plan.spec)
