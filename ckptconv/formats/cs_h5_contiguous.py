"""The contiguous H5 layout: every numeric dataset allocated up front, so its bytes can go straight
to their final place (a positioned write locally, a part of a multipart upload on S3).

How: at ``begin`` every tensor/array dataset is created contiguous, uncompressed, with its space
allocated at creation (``H5D_ALLOC_TIME_EARLY``) and its fill value never written. The file is
then a sparse *skeleton*: HDF5 metadata plus holes where the data goes, at offsets
``dset.id.get_offset()`` tells. Values arriving later are placed at those offsets; HDF5 never
touches the holes, and the metadata it adds later (per-key records, object payloads, the
``__SUCCESS__`` flag) lands outside them.

On S3 (:class:`StreamedPlacement`) the output object is a grid of multipart parts. A part made of
dataset bytes only is uploaded as soon as its bytes arrived; a part that holds any metadata byte
(the head of the file, the gaps between datasets, everything after the last dataset) is written
into the skeleton and uploaded from it at commit, once HDF5 closed the file. Local disk use is
the metadata plus the dataset bytes that share a part with metadata, not the checkpoint.

Locally (:class:`LocalPlacement`) the skeleton is the output file and every value is a
``pwrite`` into it (in pieces of ``WRITE_PIECE_BYTES``). Both produce the same bytes for the same input.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import h5py
import numpy as np

from ckptconv.formats.sharding import WRITE_PIECE_BYTES
from ckptconv.storage.digests import WrittenBlocks
from ckptconv.storage.direct_io import pwrite_all
from ckptconv.storage.local import LocalPatch
from ckptconv.storage.part_upload import PartUpload

# The metadata block of a contiguous file: room for each dataset's object header and attributes
# (about 1 KiB measured) plus the root group's, capped; unused room is a hole in the file.
META_BYTES_PER_DATASET = 2048
META_BLOCK_BASE = 1 << 20
META_BLOCK_MAX = 64 << 20


@dataclass(frozen=True)
class Region:
    """Where one dataset's bytes live in the file."""

    offset: int
    nbytes: int


def create_contiguous(f: h5py.File, key: str, shape: tuple[int, ...], dtype: np.dtype) -> h5py.Dataset:
    """A contiguous dataset whose file space is allocated now and never filled by HDF5."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return f.create_dataset(key, shape=shape, dtype=dtype, dcpl=dcpl)


def region_of(ds: h5py.Dataset) -> Region | None:
    """The dataset's byte range in the file (None for an empty one, which has no storage)."""
    offset = ds.id.get_offset()
    if offset is None:
        return None
    return Region(int(offset), int(ds.id.get_storage_size()))


class LocalPlacement:
    """Positioned writes into the skeleton, which is the output file; each reported to
    ``written`` (the file's block digest) when given. The values go around the page cache and
    land behind the caller (:mod:`ckptconv.storage.direct_io`): :meth:`finish` waits for them. A
    failed write (a full disk where no reservation stands) is a typed storage error naming ``uri``,
    raised by the next call."""

    def __init__(self, path: str, uri: str, written: WrittenBlocks | None = None) -> None:
        self._file = LocalPatch(uri, path, direct=True)
        self._written = written

    def place(self, region: Region, data: memoryview) -> None:
        # In pieces, each hashed right after its write while it is still in the caches (see
        # WRITE_PIECE_BYTES): one pwrite of a whole value costs the kernel more per byte.
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        for at in range(0, len(view), WRITE_PIECE_BYTES):
            piece = view[at : at + WRITE_PIECE_BYTES]
            self._file.write_at(region.offset + at, piece)
            if self._written is not None:
                self._written.wrote(region.offset + at, piece)

    def finish(self) -> None:
        """Every value placed is in the file, which is let go: before HDF5 writes its last
        metadata and the file is measured (the sink fsyncs it once HDF5 has closed it)."""
        self._file.close(sync=False)

    def close(self) -> None:
        """Let go, dropping what is not written yet (an output being discarded)."""
        self._file.abandon()


class SkeletonOnly:
    """No dataset bytes here: a skeleton whose datasets other processes fill (every region is
    reserved, never placed)."""

    def place(self, region: Region, data: memoryview) -> None:
        raise RuntimeError("a skeleton sink places no dataset bytes")

    def close(self) -> None:
        pass


class StreamedPlacement:
    """Dataset bytes to a :class:`PartUpload`; parts that share bytes with metadata via the skeleton."""

    def __init__(self, path: str, upload: PartUpload, regions: list[Region]) -> None:
        self._fd = os.open(path, os.O_WRONLY)
        self.upload = upload
        self._pure = _pure_parts(regions, upload)
        end = max((r.offset + r.nbytes for r in regions), default=0)
        self._data_parts = upload.part_of(end - 1) if end else 0

    @property
    def deferred_parts(self) -> int:
        """Parts up to the end of the data area that wait for commit (they hold metadata bytes)."""
        return self._data_parts - len(self._pure)

    def place(self, region: Region, data: memoryview) -> None:
        pos, end = region.offset, region.offset + region.nbytes
        while pos < end:
            number = self.upload.part_of(pos)
            take = min(self.upload.part_bounds(number)[1], end) - pos
            piece = data[pos - region.offset : pos - region.offset + take]
            if number in self._pure:
                self.upload.write_at(pos, piece)
            else:
                pwrite_all(self._fd, piece, pos)
            pos += take

    def finish(self, path: str, size: int) -> None:
        """Upload every part that is not made of dataset bytes alone from the closed skeleton."""
        self.close()
        # One buffer for every part read back: a fresh block per part stayed alive beside the next
        # one's and the part it was copied into (three parts for one).
        block = bytearray()
        with open(path, "rb") as f:
            for number in range(1, self.upload.part_of(size - 1) + 1):
                if number in self._pure:
                    continue
                start, end = self.upload.part_bounds(number)
                end = min(end, size)
                if len(block) < end - start:
                    block = bytearray(end - start)
                view = memoryview(block)[: end - start]
                f.seek(start)
                if f.readinto(view) != end - start:
                    raise OSError(f"{path}: short read at {start}")
                self.upload.write_at(start, view)
        self.upload.complete(size)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _pure_parts(regions: list[Region], upload: PartUpload) -> set[int]:
    """Grid parts that lie entirely inside dataset bytes (adjacent datasets merged)."""
    merged: list[list[int]] = []
    for r in sorted(regions, key=lambda r: r.offset):
        if r.nbytes == 0:
            continue
        if merged and r.offset <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], r.offset + r.nbytes)
        else:
            merged.append([r.offset, r.offset + r.nbytes])
    pure: set[int] = set()
    for start, end in merged:
        first = upload.part_of(start)
        if upload.part_bounds(first)[0] < start:
            first += 1
        number = first
        while upload.part_bounds(number)[1] <= end:
            pure.add(number)
            number += 1
    return pure


__all__ = [
    "META_BLOCK_BASE",
    "META_BLOCK_MAX",
    "META_BYTES_PER_DATASET",
    "LocalPlacement",
    "Region",
    "SkeletonOnly",
    "StreamedPlacement",
    "create_contiguous",
    "region_of",
]
