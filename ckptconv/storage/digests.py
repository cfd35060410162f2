"""Output digests: the checksum of every file a conversion writes, as its manifest records it.

Every output byte is hashed, so the hash is chosen for its cost: BLAKE3 (:data:`ALGORITHM`), about
0.19 CPU-s per GiB on one core against 0.90 for hashlib's sha256 (SHA-NI) on the same machine, where
sha256 was 20-35% of a whole conversion's CPU. A manifest or job result entry names its hash by its
keys: ``{"blake3": <hex of the whole file> | null, "blake3_blocks": {"block_size", "blake3"}}``.
Entries written by earlier versions name sha256 the same way (``sha256``, ``sha256_blocks``) and are
still read and checked (:func:`entry_digests`); everything new is BLAKE3.

The block digest is a checksum of a whole object that a writer filling it out of order can compute.
A plain digest needs the bytes in order. An object uploaded as positioned parts (an H5 file whose
metadata is written last, at the front) gets them in another order, and its digest would cost a
second full read. Its manifest records the **block digest** instead, computed as the parts go out:

    the object is cut into blocks of ``block_size`` bytes (the last one shorter; an empty object
    has no block); each block's digest is written as 64 lowercase hex digits and a newline; the
    block digest is the digest (hex) of that text.

With coreutils and ``b3sum`` (Debian package ``b3sum``), for a block size of 16777216::

    split -b 16777216 --filter=b3sum model.mdl | cut -c1-64 | b3sum

prints it (``sha256sum`` in both places for an entry that names sha256). The block size divides
every part of the upload, so each part is hashed block by block on its own, in any order, on the
thread that uploads it.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

import blake3

if TYPE_CHECKING:
    from ckptconv.storage.base import Storage

#: The hash of every output digest this version writes.
ALGORITHM = "blake3"
# Every hash an entry may name: the current one, and sha256, which earlier versions wrote.
_HASHES: dict[str, Callable[[], Any]] = {"blake3": blake3.blake3, "sha256": hashlib.sha256}


def new_hash(algorithm: str = ALGORITHM) -> Any:
    """A fresh hash object (``update``, ``copy``, ``hexdigest``) of ``algorithm``."""
    return _HASHES[algorithm]()


def hex_digest(data: bytes | bytearray | memoryview, algorithm: str = ALGORITHM) -> str:
    """The hex digest of ``data``."""
    h = new_hash(algorithm)
    h.update(data)
    return h.hexdigest()


def digest_facts(digest: str | None, blocks: dict[str, Any] | None, algorithm: str = ALGORITHM) -> dict[str, Any]:
    """How a manifest or job result entry records a file's digests: ``{<algorithm>: digest}``, and
    ``<algorithm>_blocks`` for a file with a block digest (``blocks``: ``{"block_size", <algorithm>}``)."""
    return {algorithm: digest, **({f"{algorithm}_blocks": blocks} if blocks else {})}


def entry_digests(entry: dict[str, Any]) -> tuple[str, str | None, dict[str, Any] | None]:
    """(algorithm, whole-file digest or None, block digest or None) of a manifest or job result
    entry, whichever hash it names (this version's or an earlier one's); ValueError when none."""
    for algorithm in _HASHES:
        if algorithm in entry or f"{algorithm}_blocks" in entry:
            return algorithm, entry.get(algorithm), entry.get(f"{algorithm}_blocks")
    raise ValueError(f"the entry names none of the digests {', '.join(_HASHES)}: {sorted(entry)}")


DEFAULT_BLOCK_SIZE = 16 << 20


def combine(block_digests: list[str], algorithm: str = ALGORITHM) -> str:
    """The block digest from the blocks' hex digests, in block order."""
    return hex_digest("".join(h + "\n" for h in block_digests).encode(), algorithm)


class BlockHasher:
    """Hashes an object's blocks as they arrive, in any order, from any thread."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, algorithm: str = ALGORITHM) -> None:
        self.block_size = block_size
        self.algorithm = algorithm
        self._blocks: dict[int, str] = {}
        self._lock = threading.Lock()

    def add(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Hash ``data``, the bytes at ``offset``: whole blocks, and the object's last one (shorter)."""
        if offset % self.block_size:
            raise ValueError(f"offset {offset} is not on a {self.block_size}-byte block boundary")
        view = memoryview(data).cast("B")
        size = self.block_size
        found = {
            (offset + at) // size: hex_digest(view[at : at + size], self.algorithm) for at in range(0, len(view), size)
        }
        with self._lock:
            self._blocks.update(found)

    def hashed(self) -> dict[int, str]:
        """The digest of every block hashed so far, by block number: one writer's share of an object."""
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
        return combine([self._blocks[i] for i in range(count)], self.algorithm)

    def to_dict(self, size: int) -> dict[str, int | str]:
        """How a manifest records it: ``{"block_size", <algorithm>}``."""
        return {"block_size": self.block_size, self.algorithm: self.digest(size)}


class WrittenBlocks:
    """The block digest of a local file written partly by us at known positions, partly by a
    library we cannot watch (HDF5 writing its metadata).

    Bytes handed to :meth:`wrote` are hashed as they are written. A block is taken from them only
    when they cover it whole, front to back, in one run of writes; every other block (those that
    hold a byte someone else wrote, the file's last, shorter block) is read back from the finished
    file by :meth:`finish`. Correct as long as nobody else writes over the bytes reported here.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, algorithm: str = ALGORITHM) -> None:
        self.block_size = block_size
        self.algorithm = algorithm
        self._done: dict[int, str] = {}
        self._open: dict[int, tuple[int, Any]] = {}  # block -> (bytes hashed so far, hash state)
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
                    h = state[1] if state else new_hash(self.algorithm)
                    h.update(view[pos : pos + take])
                    if within + take == size:
                        self._done[block] = h.hexdigest()
                    else:
                        self._open[block] = (within + take, h)
                else:
                    self._broken.add(block)
                pos += take

    def hashed(self, size: int) -> dict[int, str]:
        """The digest of every block hashed whole as written, by block number, with the ``size``-byte
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
                digest = hex_digest(_pread_exact(fd, min(self.block_size, size - start), start), self.algorithm)
            blocks.append(digest)
        return {"block_size": self.block_size, self.algorithm: combine(blocks, self.algorithm)}


def _pread_exact(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise OSError(f"file shorter than expected: {offset + len(data)} < {offset + length}")
        data += more
    return data


def stored_digests(storage: Storage, uri: str, block_size: int, algorithm: str = ALGORITHM) -> tuple[str, str]:
    """(digest, block digest) of the object at ``uri``, read once (``verify: full``)."""
    with storage.open_reader(uri) as f:
        return file_digests(f, block_size, algorithm)


def stored_block_digest(storage: Storage, uri: str, block_size: int, algorithm: str = ALGORITHM) -> str:
    """The block digest alone of the object at ``uri`` (no whole-file hash beside it)."""
    with storage.open_reader(uri) as f:
        return combine([hex_digest(block, algorithm) for block in _blocks(f, block_size)], algorithm)


def file_digests(f: BinaryIO, block_size: int, algorithm: str = ALGORITHM) -> tuple[str, str]:
    """(digest, block digest) of everything ``f`` reads, in one pass."""
    whole = new_hash(algorithm)
    blocks: list[str] = []
    for block in _blocks(f, block_size):
        whole.update(block)
        blocks.append(hex_digest(block, algorithm))
    return whole.hexdigest(), combine(blocks, algorithm)


def _blocks(f: BinaryIO, block_size: int) -> Iterator[memoryview]:
    """What ``f`` reads, block by block (each whole, whatever the reads return; the last may be
    shorter), in one reused buffer: a block is valid until the next is asked for."""
    buf = memoryview(bytearray(block_size))
    while True:
        n = 0
        while n < block_size and (got := f.readinto(buf[n:])):
            n += got
        if n == 0:
            return
        yield buf[:n]


def holds_output(data: bytes, entry: dict[str, Any]) -> bool:
    """True when ``data`` is the file a manifest or result entry describes: its size, and its
    digest or, for a file written out of order, its block digest (in the hash the entry names)."""
    if len(data) != entry["size"]:
        return False
    try:
        algorithm, digest, blocks = entry_digests(entry)
    except ValueError:
        return False  # nothing to compare: not held
    block_size = blocks["block_size"] if blocks else DEFAULT_BLOCK_SIZE
    whole, block_digest = file_digests(io.BytesIO(data), block_size, algorithm)
    if digest is not None:
        return whole == digest
    return blocks is not None and block_digest == blocks[algorithm]
