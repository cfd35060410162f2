"""Where a fanned-out output's bytes are cut into parts: byte units and the balanced split."""

from __future__ import annotations

import math

from ckptconv.formats.layout import FileLayout
from ckptconv.storage.digests import DEFAULT_BLOCK_SIZE
from ckptconv.storage.part_upload import DEFAULT_PART_SIZE, PartUpload

MIN_UNITS_PER_PART = 4  # the part grid (S3) or block size (local) is made fine enough for this many units per part


def _units(files: list[FileLayout], part_size: int | None, block_size: int) -> list[tuple[int, int, int]]:
    """``(file, start, end)`` pieces no part boundary may cut: upload parts on S3, blocks of the
    block digest elsewhere (each block hashed whole by the one part that writes it); a file's
    tail is not cut into parts (the commit writes it)."""
    out = []
    for i, f in enumerate(files):
        size = f.written_by_parts
        if part_size is None:
            bounds = [(s, min(s + block_size, size)) for s in range(0, size, block_size)]
        else:
            grid = PartUpload.__new__(PartUpload)  # the grid arithmetic only: no upload, no pool
            grid.part_size = part_size
            bounds = []
            number = 1
            while size and grid.part_bounds(number)[0] < size:
                start, end = grid.part_bounds(number)
                bounds.append((start, min(end, size)))
                number += 1
        out += [(i, s, e) for s, e in bounds]
    return out


def split_parts(
    files: list[FileLayout], parallelism: int, part_size: int | None = None, block_size: int | None = None
) -> list[list[tuple[int, int, int]]]:
    """The byte ranges ``[(file, start, end), ...]`` of each part: consecutive units of the files'
    concatenated bytes (upload parts of ``part_size`` on S3, else blocks of ``block_size``, 16 MiB by default), each
    unit to the part its middle byte falls in, so every part holds about ``total / parallelism``
    bytes. Never more parts than units; no part is empty."""
    units = _units(files, part_size, block_size or DEFAULT_BLOCK_SIZE)
    total = sum(e - s for _, s, e in units)
    count = max(1, min(parallelism, len(units)))
    parts: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    done = 0
    for fi, s, e in units:
        k = min(count - 1, int((done + (e - s) / 2) * count / max(total, 1)))
        ranges = parts[k]
        if ranges and ranges[-1][0] == fi and ranges[-1][2] == s:
            ranges[-1] = (fi, ranges[-1][1], e)
        else:
            ranges.append((fi, s, e))
        done += e - s
    return [p for p in parts if p]


def grid_part_size(total: int, parallelism: int) -> int:
    """An upload part size small enough for several units per part, within S3's limits."""
    # Deferred: the S3 backend imports boto3, which a local fan-out never needs.
    from ckptconv.storage.s3 import MIN_PART_SIZE

    want = math.ceil(total / max(1, parallelism * MIN_UNITS_PER_PART))
    size = max(MIN_PART_SIZE, min(DEFAULT_PART_SIZE, want))
    return -(-size // (1 << 20)) << 20


def local_block_size(total: int, parallelism: int) -> int:
    """The block size of a local fan-out's block digest, and so its split's unit: the single
    worker's (16 MiB), or smaller, whole MiB, when that leaves fewer than several units per part."""
    want = math.ceil(total / max(1, parallelism * MIN_UNITS_PER_PART))
    return max(1, min(DEFAULT_BLOCK_SIZE >> 20, -(-want // (1 << 20)))) << 20
