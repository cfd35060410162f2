"""Tensor dtype names as ckptconv spells them (torch's names without ``torch.``), without torch.

The one place that says what a dtype's item size is and whether it is floating-point. float8
(``float8_e4m3fn``, ``float8_e5m2``) is floating-point: a ``--dtype`` cast converts it like any other
float, and NaN handling treats it as a float.
"""

from __future__ import annotations

from ckptconv.core.errors import UnsupportedDtype

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex64": 8,
    "complex128": 16,
}

FLOAT_DTYPES = frozenset(d for d in DTYPE_SIZES if d.startswith(("float", "bfloat")))
FLOAT8_DTYPES = frozenset(d for d in FLOAT_DTYPES if d.startswith("float8"))


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise UnsupportedDtype(f"unknown dtype {dtype!r}") from None


def is_float_dtype(dtype: str | None) -> bool:
    """Whether ``dtype`` is floating-point (float8 included)."""
    return dtype in FLOAT_DTYPES
