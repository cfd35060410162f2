"""Global heap collections checked before HDF5 parses them.

Variable-length strings (cstorch's ``__spec__``, ``__metadata__`` and ``dtypes`` attributes) live
in HDF5 global heap collections (signature ``GCOL``). HDF5 walks a collection object by object,
advancing by each object's declared size; a free-space object of size 0 (a zeroed or shifted
byte run does it) never advances, and the library loops forever holding the GIL, where nothing
in Python can interrupt it. :class:`HeapCheckingReader` sits between HDF5 (through h5py's
file-object driver) and the file, and refuses such a collection as it is read, before HDF5 sees
it: HDF5 then fails the read, which the reader reports as a damaged file.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from typing import IO

from ckptconv.core.errors import CorruptCheckpoint

SIGNATURE = b"GCOL"
_HEADER = 16  # signature, version, 3 reserved bytes, collection size (8)
_OBJECT_HEADER = 16  # index (2), reference count (2), reserved (4), object size (8)


# An object's index is 16 bits and index 0 is free space: a collection holds at most this many
# objects, which bounds the walk whatever the collection's declared size.
MAX_OBJECTS = 1 << 16


def check_global_heap(data: memoryview, where: str) -> None:
    """Refuse a collection at the start of ``data`` whose walk would not end within it.

    ``data`` may hold only the front of a collection: the objects it holds whole are checked.
    """
    if len(data) < _HEADER or data[:4] != SIGNATURE:
        return
    size = struct.unpack_from("<Q", data, 8)[0]
    if size < _HEADER:
        raise CorruptCheckpoint(f"{where}: an HDF5 global heap collection claims {size} bytes, less than its header")
    walk_global_heap(lambda p: data[p : p + _OBJECT_HEADER], size, min(size, len(data)), where)


def walk_global_heap(header_at: Callable[[int], bytes | memoryview], size: int, end: int, where: str) -> None:
    """Walk a ``size``-byte collection's objects that start before ``end - 16``, reading each
    object's header (``header_at(offset)``, 16 bytes) and nothing else: memory stays constant and
    the number of steps is at most :data:`MAX_OBJECTS` plus one, whatever the file claims."""
    p = _HEADER
    steps = 0
    while p + _OBJECT_HEADER <= end:
        steps += 1
        if steps > MAX_OBJECTS + 1:
            raise CorruptCheckpoint(f"{where}: an HDF5 global heap collection holds more objects than HDF5 allows")
        header = header_at(p)
        if len(header) < _OBJECT_HEADER:
            raise CorruptCheckpoint(f"{where}: an HDF5 global heap collection ends inside an object's header")
        index = struct.unpack_from("<H", header, 0)[0]
        length = struct.unpack_from("<Q", header, 8)[0]
        # An object takes its header plus its data padded to 8 bytes; free space (index 0) declares
        # its whole extent, header included.
        need = _OBJECT_HEADER + ((length + 7) & ~7) if index else length
        if need < _OBJECT_HEADER or need > size - p:
            raise CorruptCheckpoint(
                f"{where}: an HDF5 global heap object declares {length} bytes at byte {p} of a "
                f"{size}-byte collection (the library would loop or read past it)"
            )
        p += need


class HeapCheckingReader(io.RawIOBase):
    """A read-only file for h5py's file-object driver that checks every global heap collection it returns.

    Wraps a seekable binary file (a local file or a storage's ranged reader); not thread-safe, as
    h5py calls it under its own lock.
    """

    def __init__(self, raw: IO[bytes], uri: str, size: int) -> None:
        super().__init__()
        self._raw = raw
        self._uri = uri
        self._size = size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        start = self._raw.tell()
        done = self._read_at_most(view)
        if done >= _HEADER and view[:4] == SIGNATURE:
            check_global_heap(view[:done], self._uri)
            size = struct.unpack_from("<Q", view, 8)[0]
            if size > done:
                # HDF5 reads a collection's first 4 KiB, then only the bytes after them: the
                # whole collection is checked now, while its start is known.
                self._check_whole(start, size)
                self._raw.seek(start + done)
        return done

    def _read_at_most(self, view: memoryview) -> int:
        done = 0
        while done < len(view):  # h5py zero-fills a short read: read all that is there
            n = self._raw.readinto(view[done:])
            if not n:
                break
            done += n
        return done

    def _check_whole(self, start: int, size: int) -> None:
        if size > self._size - start:
            raise CorruptCheckpoint(
                f"{self._uri}: an HDF5 global heap collection at byte {start} claims {size} bytes, "
                f"past the end of the {self._size}-byte file"
            )

        def header_at(p: int) -> bytes:
            self._raw.seek(start + p)
            return self._raw.read(_OBJECT_HEADER) or b""

        # Object headers only: a collection that claims gigabytes costs no more memory than a small one.
        walk_global_heap(header_at, size, size, self._uri)

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()
