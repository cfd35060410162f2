"""The block digest: a checksum of a whole object that a writer filling it out of order can compute.

A plain sha256 needs the bytes in order. An object uploaded as positioned parts (an H5 file whose
metadata is written last, at the front) gets them in another order, and its sha256 would cost a
second full read. Its manifest records the **block digest** instead, computed as the parts go out:

    the object is cut into blocks of ``block_size`` bytes (the last one shorter; an empty object
    has no block); each block's sha256 is written as 64 lowercase hex digits and a newline; the
    block digest is the sha256 (hex) of that text.

With coreutils, for a block size of 16777216::

    split -b 16777216 --filter=sha256sum model.mdl | cut -c1-64 | sha256sum

prints it. The block size divides every part of the upload, so each part is hashed block by
block on its own, in any order, on the thread that uploads it.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import threading
from typing import Any, BinaryIO

from ckptconv.storage.base import Storage

DEFAULT_BLOCK_SIZE = 16 << 20


def combine(block_sha256: list[str]) -> str:
    """The block digest from the blocks' hex sha256s, in block order."""
    return hashlib.sha256("".join(h + "\n" for h in block_sha256).encode()).hexdigest()


class BlockHasher:
    """Hashes an object's blocks as they arrive, in any order, from any thread."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._blocks: dict[int, str] = {}
        self._lock = threading.Lock()

    def add(self, offset: int, data: bytes | bytearray | memoryview, *, sha256: str | None = None) -> None:
        """Hash ``data``, the bytes at ``offset``: whole blocks, and the object's last one (shorter).

        ``sha256``: the hex sha256 of ``data``, when it is known already; used when ``data`` is one block."""
        if offset % self.block_size:
            raise ValueError(f"offset {offset} is not on a {self.block_size}-byte block boundary")
        view = memoryview(data).cast("B")
        size = self.block_size
        if sha256 is not None and 0 < len(view) <= size:
            found = {offset // size: sha256}
        else:
            found = {
                (offset + at) // size: hashlib.sha256(view[at : at + size]).hexdigest()
                for at in range(0, len(view), size)
            }
        with self._lock:
            self._blocks.update(found)

    def hashed(self) -> dict[int, str]:
        """The sha256 of every block hashed so far, by block number: one writer's share of an object."""
        with self._lock:
            return dict(self._blocks)

    def merge(self, blocks: dict[int, str]) -> None:
        """Take the blocks another writer hashed (its :meth:`hashed`); ValueError when one of them
        was hashed here already with other bytes."""
        with self._lock:
            clash = [n for n, h in blocks.items() if self._blocks.setdefault(n, h) != h]
        if clash:
            raise ValueError(f"blocks {sorted(clash)[:5]} were hashed twice with different bytes")

    def digest(self, size: int) -> str:
        """The block digest of the ``size``-byte object; ValueError when a block was never hashed."""
        count = math.ceil(size / self.block_size)
        missing = [i for i in range(count) if i not in self._blocks]
        if missing or len(self._blocks) != count:
            raise ValueError(f"blocks {missing[:5]} of a {size}-byte object were never hashed")
        return combine([self._blocks[i] for i in range(count)])

    def to_dict(self, size: int) -> dict[str, int | str]:
        """How a manifest records it: ``{"block_size", "sha256"}``."""
        return {"block_size": self.block_size, "sha256": self.digest(size)}


class WrittenBlocks:
    """The block digest of a local file written partly by us at known positions, partly by a
    library we cannot watch (HDF5 writing its metadata).

    Bytes handed to :meth:`wrote` are hashed as they are written. A block is taken from them only
    when they cover it whole, front to back, in one run of writes; every other block (those that
    hold a byte someone else wrote, the file's last, shorter block) is read back from the finished
    file by :meth:`finish`. Correct as long as nobody else writes over the bytes reported here.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._done: dict[int, str] = {}
        self._open: dict[int, tuple[int, Any]] = {}  # block -> (bytes hashed so far, sha256 state)
        self._broken: set[int] = set()
        self._lock = threading.Lock()

    def wrote(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """``data`` now sits at ``offset`` in the file."""
        view = memoryview(data).cast("B")
        size = self.block_size
        pos = 0
        with self._lock:
            while pos < len(view):
                at = offset + pos
                block, within = divmod(at, size)
                take = min(len(view) - pos, size - within)
                state = self._open.pop(block, None)
                if block in self._done or block in self._broken:
                    self._done.pop(block, None)  # written over: only a read-back knows it now
                    self._broken.add(block)
                elif within == (state[0] if state else 0):
                    h = state[1] if state else hashlib.sha256()
                    h.update(view[pos : pos + take])
                    if within + take == size:
                        self._done[block] = h.hexdigest()
                    else:
                        self._open[block] = (within + take, h)
                else:
                    self._broken.add(block)
                pos += take

    def hashed(self, size: int) -> dict[int, str]:
        """The sha256 of every block hashed whole as written, by block number, with the ``size``-byte
        file's last, shorter block when it was written whole too: one writer's share of the file
        (see :meth:`BlockHasher.merge`)."""
        last, within = divmod(size, self.block_size)
        with self._lock:
            out = dict(self._done)
            state = self._open.get(last)
            if within and state is not None and state[0] == within:
                out[last] = state[1].copy().hexdigest()
        return out

    def hashed_bytes(self) -> int:
        """Bytes whose blocks need no read-back (so far)."""
        return len(self._done) * self.block_size

    def finish(self, fd: int, size: int) -> dict[str, int | str]:
        """The block digest of the closed file (open as ``fd``, ``size`` bytes), as a manifest
        records it; blocks not hashed as written are read back now."""
        blocks = []
        for i in range(math.ceil(size / self.block_size)):
            start = i * self.block_size
            digest = self._done.get(i) if start + self.block_size <= size else None
            if digest is None:
                digest = hashlib.sha256(_pread_exact(fd, min(self.block_size, size - start), start)).hexdigest()
            blocks.append(digest)
        return {"block_size": self.block_size, "sha256": combine(blocks)}


def _pread_exact(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise OSError(f"file shorter than expected: {offset + len(data)} < {offset + length}")
        data += more
    return data


def stored_digests(storage: Storage, uri: str, block_size: int) -> tuple[str, str]:
    """(sha256, block digest) of the object at ``uri``, read once (``verify: full``)."""
    with storage.open_reader(uri) as f:
        return file_digests(f, block_size)


def file_digests(f: BinaryIO, block_size: int) -> tuple[str, str]:
    """(sha256, block digest) of everything ``f`` reads, in one pass."""
    whole = hashlib.sha256()
    blocks: list[str] = []
    buf = memoryview(bytearray(block_size))
    while True:
        n = 0
        while n < block_size and (got := f.readinto(buf[n:])):  # a block whole, whatever the reads return
            n += got
        if n == 0:
            break
        whole.update(buf[:n])
        blocks.append(hashlib.sha256(buf[:n]).hexdigest())
    return whole.hexdigest(), combine(blocks)


def holds_output(data: bytes, entry: dict[str, Any]) -> bool:
    """True when ``data`` is the file a manifest or result entry describes: its size, and its
    sha256 or, for a file written out of order, its block digest (``sha256_blocks``)."""
    if len(data) != entry["size"]:
        return False
    blocks = entry.get("sha256_blocks")
    whole, block_digest = file_digests(io.BytesIO(data), blocks["block_size"] if blocks else DEFAULT_BLOCK_SIZE)
    if entry.get("sha256") is not None:
        return whole == entry["sha256"]
    return blocks is not None and block_digest == blocks["sha256"]
