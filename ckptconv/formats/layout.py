"""An output file's byte layout, known from the plan before any value is read.

Formats that can place every value before the data arrives (a safetensors file: its header gives
every offset; a contiguous Cerebras H5 file: its datasets are allocated up front) describe each
output file as a :class:`FileLayout`: its size and the :class:`Span` each value's bytes occupy.
Every other byte of the file (the safetensors header, the H5 metadata) is a *gap*, whose bytes the
format also knows up front. A file is then the gaps' bytes and each span's value, in any order:
one process writing front to back, or several writing their own byte ranges of one preallocated
file or multipart upload (``ckptconv.engine.fanout``) produce the same bytes.

Some formats also record a checksum of each value (``FileLayout.checksum``): a zip archive (a
torch file, written with stored entries) the CRC-32 of each member, after its data and again in
the central directory; a TensorFlow bundle the CRC-32C of each tensor, in its index. Whoever
computes a value computes its checksum. A zip's CRC fields are spans of kind ``crc32`` whose
source is the member's value; the central directory at the end holds every member's CRC, so it
is the file's *tail*: the bytes from ``tail`` on are written last, from the checksums the writers
of the rest recorded. A bundle's index is written last the same way, by the format
(:meth:`~ckptconv.formats.base.TensorSink.late_files`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from isal import isal_zlib

from ckptconv.formats.base import OpaqueObject
from ckptconv.formats.sharding import tensor_view
from ckptconv.formats.tf_table import crc32c_extend


@dataclass(frozen=True)
class Span:
    """Where one value's bytes sit in a file."""

    key: str  # the entry stored there
    source: str  # the entry whose value fills it: ``key`` itself, or the target of a link stored as a copy
    offset: int
    nbytes: int
    kind: str = "data"  # DATA: the value's bytes; CRC32: the CRC-32 of them, 4 bytes little-endian


DATA = "data"
CRC32 = "crc32"
# CRC-32 by ISA-L: the same values as zlib.crc32 at about seven times its speed.
CHECKSUMS = {"crc32": isal_zlib.crc32, "crc32c": lambda data: crc32c_extend(0, data)}


@dataclass
class FileLayout:
    """One output file: its URI, size, and value spans (sorted by offset, never overlapping).

    ``tail``: where the bytes that depend on every value start (None: no such bytes); they hold
    only gaps and ``crc32`` spans. ``checksum``: what the format records of each value whose bytes
    are in the file (a key of :data:`CHECKSUMS`), or None."""

    uri: str
    size: int
    spans: list[Span] = field(default_factory=list)
    tail: int | None = None
    checksum: str | None = None
    metadata: dict[str, str] | None = None  # an S3 object's user metadata (cs-s3 payloads)

    @property
    def written_by_parts(self) -> int:
        """The end of the bytes that are written before the tail (all of them without one)."""
        return self.size if self.tail is None else self.tail

    def gaps(self) -> list[tuple[int, int]]:
        """The ``[start, end)`` ranges no span covers, in order."""
        out, cursor = [], 0
        for s in self.spans:
            if s.offset > cursor:
                out.append((cursor, s.offset))
            cursor = max(cursor, s.offset + s.nbytes)
        if cursor < self.size:
            out.append((cursor, self.size))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "size": self.size,
            "spans": [[s.key, s.source, s.offset, s.nbytes] + ([s.kind] if s.kind != DATA else []) for s in self.spans],
            "tail": self.tail,
            "checksum": self.checksum,
            "metadata": self.metadata,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> FileLayout:
        spans = [Span(d[0], d[1], int(d[2]), int(d[3]), *d[4:5]) for d in doc["spans"]]
        return cls(doc["uri"], int(doc["size"]), spans, doc.get("tail"), doc.get("checksum"), doc.get("metadata"))


class LayoutRecorder:
    """An output that lays a file out instead of writing it: what is written is gap bytes, what is
    placed (:meth:`place`) a span; :meth:`layout` is the result."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.gaps = bytearray()
        self.spans: list[Span] = []
        self.pos = 0

    def write(self, data: bytes | memoryview, each: Callable[[memoryview], None] | None = None) -> None:
        self.gaps += data
        self.pos += data.nbytes if isinstance(data, memoryview) else len(data)
        if each is not None:
            each(memoryview(data).cast("B"))

    def place(self, key: str, nbytes: int, kind: str) -> None:
        self.spans.append(Span(key, key, self.pos, nbytes, kind))
        self.pos += nbytes

    def layout(self, tail: int | None = None, checksum: str | None = None) -> FileLayout:
        return FileLayout(self.uri, self.pos, list(self.spans), tail, checksum)


def gap_bytes(layout: FileLayout, read: Any) -> bytes:
    """The bytes of every gap of ``layout``, concatenated in order; ``read(start, end)`` gives a range."""
    return b"".join(read(start, end) for start, end in layout.gaps())


def span_bytes(f: FileLayout, span: Span, data: memoryview, checksums: dict[str, int]) -> memoryview:
    """What ``span`` of ``f`` holds for a value whose bytes are ``data``. The value's checksum (when
    the format records one) is computed once and kept in ``checksums`` by source: the tail and the
    files written last are made from them."""
    if f.checksum is not None and span.source not in checksums:
        checksums[span.source] = CHECKSUMS[f.checksum](data)
    if span.kind == DATA:
        return data
    return memoryview(struct.pack("<I", checksums[span.source]))


def tail_bytes(layout: FileLayout, gaps: bytes, crcs: dict[str, int]) -> bytes:
    """The bytes of ``layout``'s tail: its gaps (``gaps`` are the file's, see :func:`gap_bytes`)
    with every CRC field filled from ``crcs``, which must hold each one's source."""
    if layout.tail is None:
        return b""
    rest = memoryview(gaps)[sum(min(e, layout.tail) - s for s, e in layout.gaps() if s < layout.tail) :]
    out = bytearray()
    cursor, at = layout.tail, 0
    for s in layout.spans:
        if s.offset < layout.tail:
            continue
        out += rest[at : at + s.offset - cursor]
        at += s.offset - cursor
        out += struct.pack("<I", crcs[s.source])  # a tail holds CRC fields only
        cursor = s.offset + s.nbytes
    out += rest[at:]
    return bytes(out)


def value_bytes(value: Any) -> memoryview:
    """The bytes a span holds for ``value``: a tensor's raw little-endian C-order bytes, an opaque
    object's payload (safetensors and contiguous H5 store both as they are)."""
    if isinstance(value, OpaqueObject):
        return memoryview(value.payload)
    return tensor_view(value)


__all__ = [
    "CRC32",
    "DATA",
    "FileLayout",
    "LayoutRecorder",
    "Span",
    "gap_bytes",
    "span_bytes",
    "tail_bytes",
    "value_bytes",
]
