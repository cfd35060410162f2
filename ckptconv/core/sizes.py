"""Byte sizes written by people: ``5GB`` (10^9), ``5GiB`` (2^30), ``500MiB``, ``"1024"`` or an int."""

from __future__ import annotations

import re

from ckptconv.core.errors import InvalidRequest

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*")


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB`` (10^9), ``5GiB`` (2^30), ``500MiB``, ``"1024"`` or an int. Must be > 0."""
    if isinstance(size, bool):
        raise InvalidRequest(f"invalid size {size!r}")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        m = _SIZE.fullmatch(size)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise InvalidRequest(
                f"invalid size {size!r}",
                hint="write a size as bytes or with a unit: 5GB, 500MB, 2GiB, 512MiB, 64KiB",
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise InvalidRequest(f"invalid size {size!r}")
    if value <= 0:
        raise InvalidRequest(f"size must be positive, got {size!r}")
    return value
