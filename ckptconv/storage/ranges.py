"""Byte-range checks shared by the storage backends.

Offsets and lengths usually come from checkpoint headers, i.e. from untrusted input, so a bad or
short range is reported as a corrupt checkpoint rather than as an I/O failure.
"""

from __future__ import annotations

from ckptconv.core.errors import CorruptCheckpoint


def check_range(uri: str, offset: int, length: int) -> None:
    """Refuse negative offsets and lengths before any I/O."""
    if offset < 0 or length < 0:
        raise CorruptCheckpoint(
            f"invalid byte range at offset {offset}, length {length} in {uri}",
            uri=uri,
            offset=offset,
            length=length,
        )


def short_read(uri: str, offset: int, length: int, got: int, size: int | None = None) -> CorruptCheckpoint:
    """The error for a range that runs past the end of the object (a truncated file)."""
    where = f" (object size {size})" if size is not None else ""
    return CorruptCheckpoint(
        f"{uri} ends early: wanted {length} bytes at offset {offset}, got {got}{where}",
        uri=uri,
        offset=offset,
        length=length,
        got=got,
        size=size,
    )


def replaced(uri: str, why: str) -> CorruptCheckpoint:
    """The error for a read of an object that is no longer the version read before (``why``)."""
    return CorruptCheckpoint(
        f"{uri} was replaced {why}",
        hint="convert again once nothing writes the source any more",
        uri=uri,
    )
