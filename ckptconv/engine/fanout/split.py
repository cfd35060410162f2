"""Where a fanned-out output's bytes are cut into parts: byte units and the balanced split."""

from __future__ import annotations

import math

from ckptconv.formats.layout import FileLayout
from ckptconv.storage.part_upload import DEFAULT_PART_SIZE, PartUpload

LOCAL_UNIT = 1 << 20  # local files are cut anywhere; parts end on a MiB boundary
MIN_UNITS_PER_PART = 4  # S3: the part grid is made fine enough for this many units per part


def _units(files: list[FileLayout], part_size: int | None) -> list[tuple[int, int, int]]:
    """``(file, start, end)`` pieces no part boundary may cut: upload parts on S3, MiB elsewhere;
    a file's tail is not cut into parts (the commit writes it)."""
    out = []
    for i, f in enumerate(files):
        size = f.written_by_parts
        if part_size is None:
            bounds = [(s, min(s + LOCAL_UNIT, size)) for s in range(0, size, LOCAL_UNIT)]
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
    files: list[FileLayout], parallelism: int, part_size: int | None = None
) -> list[list[tuple[int, int, int]]]:
    """The byte ranges ``[(file, start, end), ...]`` of each part: consecutive units of the files'
    concatenated bytes, each unit to the part its middle byte falls in, so every part holds about
    ``total / parallelism`` bytes. Never more parts than units; no part is empty."""
    units = _units(files, part_size)
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
