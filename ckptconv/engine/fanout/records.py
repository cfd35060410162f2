"""Where a fanned-out run keeps its records in the staging area: the layout and each part's record.

An attempt that took over a job may *adopt* the fan-out of an earlier attempt (same plan, same
layout: see :mod:`ckptconv.engine.fanout.run`): its own staging area then holds only
``.fanout/adopted.json``, naming the earlier attempt whose staging area holds the layout, the
files and the part records; its parts and its commit work there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from ckptconv.core.bounded import load_json
from ckptconv.core.errors import ObjectNotFound, VerificationFailed
from ckptconv.core.uri import basename, parent
from ckptconv.engine.execute import value_digest
from ckptconv.engine.plan import Plan
from ckptconv.engine.staging import _Layout
from ckptconv.storage.base import Storage
from ckptconv.storage.digests import ALGORITHM
from ckptconv.storage.direct_io import staging_bytes
from ckptconv.storage.part_upload import upload_buffer_bytes

FANOUT_DIR = ".fanout"
# The layout document's version, part of the plan key: an earlier fan-out of another version (a
# local one whose parts recorded no blocks; 2: block hashes in sha256, not BLAKE3; 3: no source
# versions and plan digest for the parts to check) is never adopted.
# Raised whenever a field this code reads is added or changes meaning.
LAYOUT_VERSION = 4
# What this version reads of the layout document and of a part's record. In a rolling deploy a part
# or a commit may meet either written by another version: a typed failure of the job, not a KeyError.
_LAYOUT_FIELDS = (
    "files",
    "parts",
    "part_size",
    "block_size",
    "digests",
    "read_digests",
    "side_files",
    "sources",
    "plan_digest",
)
_RECORD_FIELDS = ("ranges", "uploaded", "digest", "digests", "read_digests")
_OTHER_VERSION_HINT = "nothing was published; submit the job again once every worker runs the same version of ckptconv"


def _doc_uri(layout: _Layout) -> str:
    return layout.storage.join(layout.staging, FANOUT_DIR, "layout.json")


def _part_uri(layout: _Layout, index: int) -> str:
    return layout.storage.join(layout.staging, FANOUT_DIR, f"part-{index:05d}.json")


_PART_RECORD = re.compile(r"part-(\d{5,})\.json")


def _recorded_parts(layout: _Layout) -> set[int]:
    """The parts whose records are in the staging area, from one listing of their names: a request
    per thousand records on S3, where asking for each part's record would be a request per part
    per poll (at 256 parts and five polls a second, over a thousand a second, each counting
    against the prefix's request rate)."""
    storage = layout.storage
    found = set()
    for info in storage.list(storage.join(layout.staging, FANOUT_DIR, "part-")):
        match = _PART_RECORD.fullmatch(basename(info.uri))
        if match:
            found.add(int(match.group(1)))
    return found


def _gaps_uri(layout: _Layout, index: int) -> str:
    return layout.storage.join(layout.staging, FANOUT_DIR, f"gaps-{index:05d}.bin")


def _adopted_uri(layout: _Layout) -> str:
    return layout.storage.join(layout.staging, FANOUT_DIR, "adopted.json")


def _adopt(layout: _Layout, home: _Layout) -> None:
    """Record in ``layout``'s staging area that its attempt works in ``home``'s (a sibling attempt)."""
    doc = {"attempt": basename(home.staging)}
    layout.storage.write_bytes(_adopted_uri(layout), json.dumps(doc).encode())


def _home(layout: _Layout) -> tuple[_Layout, dict[str, Any] | None]:
    """Where the fan-out of ``layout``'s attempt lives (its own staging area, or the one it
    adopted) and its layout document (None when there is none yet)."""
    doc = _read_doc(layout.storage, _doc_uri(layout))
    if doc is not None:
        return layout, doc
    pointer = _read_doc(layout.storage, _adopted_uri(layout))
    if pointer is None:
        return layout, None
    attempt = str(pointer.get("attempt", ""))
    if not attempt.isdigit():  # only ever a sibling attempt of the same job, by number
        return layout, None
    home = dataclasses.replace(layout, staging=layout.storage.join(parent(layout.staging), attempt))
    return home, _read_doc(layout.storage, _doc_uri(home))


def _read_doc(storage: Storage, uri: str) -> dict[str, Any] | None:
    try:
        return load_json(storage.read_all(uri), what=uri)
    except ObjectNotFound:
        return None


def plan_digest(plan: Plan) -> str:
    """A digest of what a part rebuilds from the source's metadata (and a model's config): the
    plan's entries and recipes and its constant values. Equal in every process that read the same
    metadata; a part whose digest differs from the layout's read other metadata than the job's."""
    constants = {
        s.out.key: value_digest(s.out.value)
        for s in plan.steps
        if not s.inputs and s.out.kind != "link" and s.out.value is not None
    }
    facts = {"plan": plan.to_dict(), "constants": constants}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def check_layout(doc: dict[str, Any]) -> None:
    """Refuse a layout document this version cannot read (another layout version, a field missing)."""
    missing = [f for f in _LAYOUT_FIELDS if f not in doc]
    if doc.get("version") != LAYOUT_VERSION or missing:
        lacking = f", without {', '.join(repr(f) for f in missing)}" if missing else ""
        raise VerificationFailed(
            f"the fan-out layout was written by another version of ckptconv (layout version "
            f"{doc.get('version')!r}{lacking}; this one reads version {LAYOUT_VERSION})",
            hint=_OTHER_VERSION_HINT,
        )


def check_record(record: dict[str, Any], index: int) -> None:
    """Refuse a part's record this version cannot read (a field missing, its blocks hashed in
    another hash than this version's: they cannot be merged into one block digest)."""
    missing = [f for f in _RECORD_FIELDS if f not in record]
    if missing:
        raise VerificationFailed(
            f"part {index}'s record was written by another version of ckptconv (without "
            f"{', '.join(repr(f) for f in missing)})",
            hint=_OTHER_VERSION_HINT,
        )
    if record["digest"] != ALGORITHM:
        raise VerificationFailed(
            f"part {index}'s record was written by another version of ckptconv (block hashes in"
            f" {record['digest']}, not {ALGORITHM})",
            hint=_OTHER_VERSION_HINT,
        )


def layout_memory(plan: Plan, sizes: dict[str, int], doc: dict[str, Any]) -> dict[str, Any]:
    """How a part of this layout uses memory: the budget and upload buffers the layout recorded
    (fanout.run._part_memory), split by this version's model (``Plan.memory``). A layout prepared
    by code that counted less beside the read-ahead would otherwise have its parts pass the
    budget by the difference; one whose budget this model finds too small runs with the smallest
    read-ahead and says so in its estimate, rather than failing a job that was accepted."""
    recorded = doc.get("memory") or {}
    writer_buffers = recorded.get("writer_buffer_bytes")
    if writer_buffers is None:  # recorded by none: a part upload of the grid's size on S3, or staging
        writer_buffers = upload_buffer_bytes(doc["part_size"]) if doc.get("part_size") else staging_bytes()
    mine = plan.memory(sizes, recorded.get("budget_bytes"), writer_buffers, refuse_short=False)
    return {**recorded, **mine}
