"""What the commit of a fan-out writes from the checksums the parts recorded (see
:mod:`ckptconv.formats.layout`): a file's tail (a zip's central directory, which holds every
member's CRC-32), and the files a format writes last (a TensorFlow bundle's index).

Locally the commit writes the tail in place and hashes the blocks of the file's block digest that
the tail is in (of the block it starts in, the bytes before it are read back: at most one block).
On S3 the upload part the tail starts in cannot be sent before the commit, so the part whose range
ends at the tail *holds* its bytes of that upload part (a staging object of at most one upload
part, :class:`HeldUpload`) and the commit sends them with the tail as the upload's last part(s).
"""

from __future__ import annotations

import contextlib
from typing import Any

from ckptconv.core.errors import TargetExists, VerificationFailed
from ckptconv.engine.fanout.records import FANOUT_DIR, _gaps_uri
from ckptconv.engine.staging import _Layout
from ckptconv.formats import sink_class
from ckptconv.formats.base import OutputFile
from ckptconv.formats.layout import FileLayout, tail_bytes
from ckptconv.storage.base import Storage
from ckptconv.storage.digests import BlockHasher, hex_digest
from ckptconv.storage.local import LocalPatch
from ckptconv.storage.part_upload import PartUpload


def held_uri(layout: _Layout, index: int) -> str:
    """Where the part before file ``index``'s tail leaves its bytes of the tail's upload part."""
    return layout.storage.join(layout.staging, FANOUT_DIR, f"held-{index:05d}.bin")


def held_from(upload: PartUpload, tail: int) -> int:
    """The start of the upload part the tail starts in."""
    return upload.part_bounds(upload.part_of(tail))[0]


class HeldUpload:
    """A part's writer of an S3 file with a tail: bytes before the tail's upload part are upload
    parts, bytes of it are held and staged at :meth:`flush` for the commit."""

    def __init__(self, storage: Storage, upload: PartUpload, tail: int, held: str) -> None:
        self.storage = storage
        self.upload = upload
        self.blocks = upload.blocks  # the upload parts sent from here, hashed as they went out
        self.start = held_from(upload, tail)
        self.held_uri = held
        self.held = bytearray(tail - self.start)
        self.holding = False

    def write_at(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        cut = max(0, min(len(view), self.start - offset))
        if cut:
            self.upload.write_at(offset, view[:cut])
        if cut < len(view):
            at = offset + cut - self.start
            self.held[at : at + len(view) - cut] = view[cut:]
            self.holding = True

    def stop(self) -> None:
        """Stop the upload's parts in flight (see :meth:`PartUpload.stop`); nothing is staged."""
        self.upload.stop()

    def flush(self, size: int) -> list[dict[str, Any]]:
        """Stage the held bytes (this part wrote all of them: they are one unit of the split) and
        send the upload parts before them; returns those, as :meth:`PartUpload.flush`."""
        if self.holding:
            with contextlib.suppress(TargetExists):  # a redelivered part stages the same bytes
                self.storage.write_bytes(self.held_uri, bytes(self.held))
        return self.upload.flush(self.start) if self.start else []


def merged_checksums(records: list[dict[str, Any]]) -> dict[str, int]:
    """The checksum of every value some part computed; two parts that computed one must agree."""
    checksums: dict[str, int] = {}
    for record in records:
        for key, crc in record.get("crcs", {}).items():
            if checksums.setdefault(key, crc) != crc:
                raise VerificationFailed(f"{key}: two parts computed different checksums; nothing was published")
    return checksums


def write_late_files(layout: _Layout, doc: dict[str, Any], records: list[dict[str, Any]], to: str) -> list[OutputFile]:
    """The files the format writes last from the values' checksums (a TensorFlow bundle's index)."""
    if not doc.get("late"):
        return []
    checksums = merged_checksums(records)
    out = []
    try:
        files = sink_class(to).late_files(doc["late"], checksums)
    except KeyError as e:
        raise VerificationFailed(f"no part recorded the checksum of {e.args[0]!r}; nothing was published") from None
    for uri, data, role in files:
        layout.storage.write_bytes(uri, data, overwrite=True)  # a commit run again writes the same bytes
        out.append(OutputFile(uri, len(data), hex_digest(data), role))
    return out


def write_tails(
    layout: _Layout, doc: dict[str, Any], records: list[dict[str, Any]]
) -> tuple[dict[int, list[dict[str, Any]]], dict[int, dict[int, str]]]:
    """Write the tail of every file that has one: the upload parts sent here, by file, and the
    digest of the blocks hashed here (those the tail is in), by file. Two parts that computed one
    CRC must agree."""
    crcs = merged_checksums(records)
    sent, blocks = {}, {}
    for fi, described in enumerate(doc["files"]):
        f = FileLayout.from_dict(described)
        if f.tail is None:
            continue
        missing = [s.source for s in f.spans if s.offset >= f.tail and s.source not in crcs]
        if missing:
            raise VerificationFailed(f"{f.uri}: no part recorded the CRC-32 of {missing[0]!r}; nothing was published")
        data = tail_bytes(f, layout.storage.read_all(_gaps_uri(layout, fi)), crcs)
        if described["upload_id"] is None:
            patch = LocalPatch(f.uri)
            try:
                patch.write_at(f.tail, data)
            finally:
                patch.close(sync=True)
            hasher = BlockHasher(doc["block_size"])
            start = f.tail - f.tail % hasher.block_size
            before = bytearray(f.tail - start)
            if before:
                layout.storage.read_into(f.uri, start, memoryview(before))
            hasher.add(start, before + data)
            blocks[fi] = hasher.hashed()
            continue
        upload = PartUpload(
            layout.storage.backend(f.uri), f.uri, part_size=doc["part_size"], upload_id=described["upload_id"]
        )
        start = held_from(upload, f.tail)
        held = layout.storage.read_all(held_uri(layout, fi)) if start < f.tail else b""
        if len(held) != f.tail - start:
            raise VerificationFailed(f"{f.uri}: the bytes before the tail were not staged; nothing was published")
        upload.write_at(start, held + data)
        sent[fi] = upload.flush(f.size)
        blocks[fi] = upload.blocks.hashed()
    return sent, blocks
