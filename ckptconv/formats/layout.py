"""An output file's byte layout, known from the plan before any value is read.

Formats that can place every value before the data arrives (a safetensors file: its header gives
every offset; a contiguous Cerebras H5 file: its datasets are allocated up front) describe each
output file as a :class:`FileLayout`: its size and the :class:`Span` each value's bytes occupy.
Every other byte of the file (the safetensors header, the H5 metadata) is a *gap*, whose bytes the
format also knows up front. A file is then the gaps' bytes and each span's value, in any order:
one process writing front to back, or several writing their own byte ranges of one preallocated
file or multipart upload (``ckptconv.engine.fanout``) produce the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptconv.formats.base import OpaqueObject
from ckptconv.formats.sharding import tensor_view


@dataclass(frozen=True)
class Span:
    """Where one value's bytes sit in a file."""

    key: str  # the entry stored there
    source: str  # the entry whose value fills it: ``key`` itself, or the target of a link stored as a copy
    offset: int
    nbytes: int


@dataclass
class FileLayout:
    """One output file: its URI, size, and value spans (sorted by offset, never overlapping)."""

    uri: str
    size: int
    spans: list[Span] = field(default_factory=list)

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
            "spans": [[s.key, s.source, s.offset, s.nbytes] for s in self.spans],
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> FileLayout:
        return cls(doc["uri"], int(doc["size"]), [Span(k, src, int(o), int(n)) for k, src, o, n in doc["spans"]])


def gap_bytes(layout: FileLayout, read: Any) -> bytes:
    """The bytes of every gap of ``layout``, concatenated in order; ``read(start, end)`` gives a range."""
    return b"".join(read(start, end) for start, end in layout.gaps())


def value_bytes(value: Any) -> memoryview:
    """The bytes a span holds for ``value``: a tensor's raw little-endian C-order bytes, an opaque
    object's payload (safetensors and contiguous H5 store both as they are)."""
    if isinstance(value, OpaqueObject):
        return memoryview(value.payload)
    return tensor_view(value)


__all__ = ["FileLayout", "Span", "gap_bytes", "value_bytes"]
