"""The one storage interface: bytes behind a URI.

Contract (every backend passes ``tests/test_storage.py``):

- URIs are ``s3://bucket/key`` or local paths (absolute, relative, or ``file://``).
- Reads are ranged: ``read_range(uri, offset, length)`` (or ``read_into(uri, offset, buffer)``)
  returns exactly ``length`` bytes or raises
  :class:`~ckptconv.core.errors.CorruptCheckpoint` when the object is shorter (a truncated file is a bad
  checkpoint, not an I/O hiccup). ``open_reader`` gives a seekable read-only file object for
  libraries that want one (h5py), reading through ranged requests with a bounded read-ahead.
- Writes stream: ``open_writer(uri)`` returns a :class:`Writer`; bytes go out as they are written
  (S3: multipart parts of ``part_size``), nothing is visible at ``uri`` until ``commit()``, and
  ``abort()`` (or an exception inside ``with``) leaves nothing behind. Committing over an existing
  object is refused with :class:`~ckptconv.core.errors.TargetExists` unless ``overwrite=True``.
- ``publish(pairs)`` moves already-written staging objects to their final names; local storage
  renames, S3 copies server-side then deletes the staging key. Callers publish the manifest last,
  so a reader that sees the manifest sees every output.
- ``list(prefix)`` yields every object whose URI starts with ``prefix`` (a plain string prefix,
  not a directory walk), sorted by URI.
- Thread-safety: a Storage may be used from several threads; a Reader or Writer from one at a time.
"""

from __future__ import annotations

import abc
import collections
import io
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ckptconv.core.errors import ObjectNotFound
from ckptconv.storage.digests import ALGORITHM, new_hash
from ckptconv.storage.ranges import check_range

BLOCK_SIZE = 8 << 20

# Part size of a streaming writer whose caller does not choose one (``open_writer``).
STREAM_PART_SIZE = 64 << 20

# The first read of ``read_all``: all of nearly every object it reads (manifests, records, configs).
READ_ALL_FIRST = 4 << 20

# The user-metadata key (``x-amz-meta-ckptconv-job`` on S3) under which ``publish`` names the job
# that placed an object (S3 writes it already when a job's attempt creates the staged object).
OWNER_METADATA = "ckptconv-job"


def streaming_buffer_bytes(part_size: int = STREAM_PART_SIZE) -> int:
    """Bytes a streaming S3 writer buffers at most: the part being filled and the one uploading
    (see :class:`~ckptconv.storage.s3.S3Writer`). Memory budgets count it for S3 outputs."""
    return 2 * part_size


def read_blocks(f: BinaryIO, block_size: int = BLOCK_SIZE) -> Iterator[memoryview]:
    """The contents of ``f`` in blocks, all read into one reused buffer (each block is valid until
    the next is asked for). Fresh multi-MB blocks would each be a new mapping to fault in: on a
    3 GB output that was a measurable share of a conversion's time."""
    buf = memoryview(bytearray(block_size))
    while n := f.readinto(buf):
        yield buf[:n]


@dataclass(frozen=True)
class ObjectInfo:
    uri: str
    size: int
    etag: str | None = None
    mtime: float | None = None


class Writer(abc.ABC):
    """A streaming write of one object. Use as a context manager: commit on success, abort on error."""

    uri: str

    @abc.abstractmethod
    def write(self, data: bytes | bytearray | memoryview) -> int: ...

    @abc.abstractmethod
    def commit(self) -> ObjectInfo:
        """Make the object visible at its URI (atomically) and return its info."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything written; idempotent."""

    @property
    @abc.abstractmethod
    def bytes_written(self) -> int: ...

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class Storage(abc.ABC):
    """Bytes behind URIs. One instance per scheme; get one with ``open_storage(uri)``."""

    scheme: str
    #: Positioned reads worth having in flight at once (readers of independent byte ranges use
    #: up to this many threads).
    read_parallelism: int = 2
    #: Bytes below which neighbouring ranges of one object are worth reading as one request
    #: (:meth:`read_scattered`): where every request costs more than its bytes, as on an object
    #: store. 0: each range is read on its own (a local file's reads cost a system call each).
    coalesce_bytes: int = 0

    @abc.abstractmethod
    def stat(self, uri: str) -> ObjectInfo:
        """Size and etag of one object; ObjectNotFound if absent."""

    def exists(self, uri: str) -> bool:
        try:
            self.stat(uri)
        except ObjectNotFound:
            return False
        return True

    @abc.abstractmethod
    def read_range(self, uri: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes starting at ``offset``."""

    def read_into(self, uri: str, offset: int, buf: bytearray | memoryview) -> None:
        """Fill ``buf`` with the ``len(buf)`` bytes at ``offset`` (same rules as ``read_range``).

        Backends override it to read straight into ``buf`` without an intermediate copy."""
        memoryview(buf).cast("B")[:] = self.read_range(uri, offset, len(memoryview(buf).cast("B")))

    def read_scattered(self, uri: str, offset: int, bufs: Sequence[memoryview]) -> None:
        """Fill ``bufs`` in turn with the bytes from ``offset``: the first ``len(bufs[0])`` bytes go to
        ``bufs[0]``, the next to ``bufs[1]``... (neighbouring values of one file, each into its own
        memory). Backends where a request costs more than its bytes read them with one request
        when together they are shorter than :attr:`coalesce_bytes`."""
        for buf in bufs:
            self.read_into(uri, offset, buf)
            offset += len(buf)

    def read_all(self, uri: str) -> bytes:
        """A whole (small) object: indexes, configs, headers. Never used for tensor data.

        Read as :meth:`read_head` reads, whose first answer tells the size: on an object store one
        GET for an object within :data:`READ_ALL_FIRST` bytes, not a HEAD and a GET."""
        data, info = self.read_head(uri, READ_ALL_FIRST)
        if len(data) < info.size:
            data += self.read_range(uri, len(data), info.size - len(data))
        return data

    def read_head(self, uri: str, length: int, *, offset: int = 0) -> tuple[bytes, ObjectInfo]:
        """Up to ``length`` bytes from ``offset`` (fewer where the object ends first, none past its
        end) and the object's info: what opening a file reads (a header and its length prefix).

        Object stores override it to answer with one ranged GET, whose headers carry the size and
        ETag, instead of a HEAD and a GET: a plan over many shards pays per request."""
        check_range(uri, offset, length)
        info = self.stat(uri)
        n = max(0, min(length, info.size - offset))
        return (self.read_range(uri, offset, n) if n else b""), info

    @abc.abstractmethod
    def open_reader(self, uri: str) -> BinaryIO:
        """A seekable, read-only binary file object over the object."""

    def digest(self, uri: str, algorithm: str = ALGORITHM, block_size: int = BLOCK_SIZE) -> str:
        """Hex digest of the object (its output digest: ``ckptconv.storage.digests``), read in blocks
        through two reused buffers: the next block is read on another thread while this one is
        hashed (both release the GIL), so hashing a file costs about the longer of the two, not
        their sum."""
        h = new_hash(algorithm)
        buffers = (bytearray(block_size), bytearray(block_size))
        with self.open_reader(uri) as f, ThreadPoolExecutor(max_workers=1, thread_name_prefix="digest-read") as pool:
            current = 0
            n = f.readinto(buffers[current])
            while n:
                following = pool.submit(f.readinto, buffers[1 - current])
                try:
                    h.update(memoryview(buffers[current])[:n])
                finally:
                    n = following.result()  # the reader is used by one thread at a time
                current = 1 - current
        return h.hexdigest()

    @abc.abstractmethod
    def open_writer(self, uri: str, *, overwrite: bool = False, part_size: int = STREAM_PART_SIZE) -> Writer: ...

    def write_bytes(self, uri: str, data: bytes, *, overwrite: bool = False) -> ObjectInfo:
        with self.open_writer(uri, overwrite=overwrite) as w:
            w.write(data)
        return self.stat(uri)

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]: ...

    @abc.abstractmethod
    def delete(self, uri: str) -> None:
        """Delete one object; deleting a missing object is not an error."""

    def delete_prefix(self, prefix: str) -> int:
        n = 0
        for info in list(self.list(prefix)):
            self.delete(info.uri)
            n += 1
        return n

    @abc.abstractmethod
    def publish(self, pairs: Iterable[tuple[str, str]], *, overwrite: bool = False, owner: str | None = None) -> None:
        """Move each (staging_uri, final_uri) in order; TargetExists if a final URI exists.

        ``owner`` (a job id) is recorded with each placed object where the backend keeps user
        metadata (under :data:`OWNER_METADATA`): what tells a job's files from others' bytes when
        the job removes what a killed publication of it placed."""

    def backend(self, uri: str) -> Storage:
        """The backend itself, for code that drives its own interface on ``uri`` and nothing else (an
        S3 multipart upload of one object). A confined storage checks ``uri`` before handing it out."""
        return self

    def local_path(self, uri: str) -> Path | None:
        """The filesystem path behind ``uri`` when there is one (lets h5py open files directly)."""
        return None

    @abc.abstractmethod
    def join(self, base: str, *parts: str) -> str:
        """Join key parts under ``base``, refusing any part that would escape it (PathEscape)."""


class RangeReader(io.RawIOBase):
    """A seekable read-only file object built on ``Storage.read_range``, with a cache of blocks.

    h5py and tarfile-style consumers issue many small reads. A small read that misses the cache
    fetches a block around it and keeps it: ``block_size`` bytes when it continues where the last
    block ended (or is the first read: a file's metadata usually starts at its front), otherwise
    ``jump_block`` bytes aligned to that size (an HDF5 file's object headers and B-tree nodes lie
    scattered between its datasets: fetching 8 MiB for each cost a plan over S3 most of the file).
    The ``cached_blocks`` most recently used blocks are kept, so memory stays bounded by about
    ``block_size + cached_blocks * jump_block``; reads of ``block_size`` or more go straight to
    storage. ``first_block``: the object's first bytes when the caller has them already (a
    ``Storage.read_head``, which told the size too). With ``start``, the reader is a window:
    position 0 is byte ``start`` of the object and ``size`` bytes follow (a file stored inside
    another, such as the records of a PyTorch distributed checkpoint).
    """

    def __init__(
        self,
        storage: Storage,
        uri: str,
        size: int,
        block_size: int = 8 << 20,
        *,
        start: int = 0,
        jump_block: int = 256 << 10,
        cached_blocks: int = 32,
        first_block: bytes | None = None,
    ) -> None:
        super().__init__()
        self._storage = storage
        self._uri = uri
        self._size = size
        self._start = start
        self._pos = 0
        self._block_size = block_size
        self._jump_block = min(jump_block, block_size)
        self._cached_blocks = max(1, cached_blocks)
        self._blocks: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # start -> bytes, LRU order
        self._last_end: int | None = None  # where the last fetched block ended
        self.fetches = 0  # ranged reads made (for tests)
        if first_block:  # the object's first bytes, already read by the caller (with its size)
            self._blocks[0] = first_block
            self._last_end = len(first_block)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._size + offset
        else:
            raise ValueError(f"bad whence {whence}")
        if pos < 0:
            raise ValueError("negative seek position")
        self._pos = pos
        return pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        want = min(len(view), max(0, self._size - self._pos))
        if want == 0:
            return 0
        if want >= self._block_size:
            view[:want] = self._fetch(self._pos, want)
        else:
            block_start, block = self._block_for(self._pos, want)
            at = self._pos - block_start
            view[:want] = block[at : at + want]
        self._pos += want
        return want

    def _block_for(self, pos: int, want: int) -> tuple[int, bytes]:
        """A cached block holding ``[pos, pos + want)``, fetched on a miss."""
        for block_start, block in self._blocks.items():
            if block_start <= pos and pos + want <= block_start + len(block):
                self._blocks.move_to_end(block_start)
                return block_start, block
        if self._last_end is None or pos == self._last_end:
            begin, length = pos, self._block_size  # first or sequential: read ahead far
        else:
            begin = pos - pos % self._jump_block
            length = max(self._jump_block, pos + want - begin)
        length = min(length, self._size - begin)
        block = self._fetch(begin, length)
        self._last_end = begin + length
        self._blocks[begin] = block
        # Bounded in bytes too: a jump read of a few MB (a small dataset's data) is a block as well.
        limit = self._block_size + self._cached_blocks * self._jump_block
        while len(self._blocks) > 1 and (
            len(self._blocks) > self._cached_blocks or sum(map(len, self._blocks.values())) > limit
        ):
            self._blocks.popitem(last=False)
        return begin, block

    def _fetch(self, pos: int, length: int) -> bytes:
        self.fetches += 1
        return self._storage.read_range(self._uri, self._start + pos, length)
