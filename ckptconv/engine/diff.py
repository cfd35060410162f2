"""Compare two checkpoints of any formats, entry by entry, one tensor pair in memory at a time.

``diff_checkpoints`` opens both sources from their metadata, lists the keys only one of them
holds, and for every shared key compares kind, dtype and shape, then the values: tensors bit for
bit (``op="equal"``) or within ``rtol``/``atol`` (``op="allclose"``, the Model Zoo's
``--tensor_comparison_op allclose``), values and opaque objects by their content. A tied weight
(a link) is compared as the tensor it points to, so a Cerebras checkpoint and its safetensors copy
(where ties are written out) compare equal. For tensors that differ, the largest absolute and
relative differences are reported; they are computed over slices of a bounded number of elements,
so memory stays at the two tensors being compared.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ckptconv.core.errors import InvalidRequest
from ckptconv.engine.execute import ProgressFn, ProgressReporter, value_digest
from ckptconv.formats.base import Entry, TensorSource
from ckptconv.formats.detect import open_source
from ckptconv.formats.links import link_root

__all__ = ["DiffResult", "KeyDiff", "diff_checkpoints"]

ComparisonOp = Literal["equal", "allclose"]
# Elements per slice when measuring differences: bounds the float64 temporaries to ~16 MB.
_SLICE = 1 << 21
_NUMERIC = ("tensor", "array")


@dataclass
class KeyDiff:
    """How one key present in both checkpoints differs."""

    key: str
    what: list[str]  # kind, dtype, shape, values
    a: dict[str, Any] = field(default_factory=dict)  # kind, dtype, shape (and value) on side A
    b: dict[str, Any] = field(default_factory=dict)
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None  # |a - b| / max(|a|, |b|)


@dataclass
class DiffResult:
    a: str
    b: str
    op: str
    only_in_a: list[str]
    only_in_b: list[str]
    differences: list[KeyDiff]
    compared: int  # keys present in both

    @property
    def identical(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.differences)

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["identical"] = self.identical
        return doc


def diff_checkpoints(
    a: str,
    b: str,
    *,
    format_a: str | None = None,
    format_b: str | None = None,
    op: ComparisonOp = "equal",
    rtol: float = 1e-5,
    atol: float = 1e-8,
    progress: ProgressFn | None = None,
    allow_incomplete: bool | None = None,
) -> DiffResult:
    """Compare checkpoint ``a`` with ``b`` (local paths or URIs, formats detected unless given)."""
    if op not in ("equal", "allclose"):
        raise InvalidRequest(f"unknown tensor comparison {op!r}", hint="use equal or allclose")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if not 0 <= value < math.inf:  # also refuses NaN
            raise InvalidRequest(f"{name} must be a finite number >= 0, not {value}", hint=f"e.g. --{name} 1e-5")
    src_a = open_source(a, format_a, allow_incomplete=allow_incomplete)
    try:
        src_b = open_source(b, format_b, allow_incomplete=allow_incomplete)
        try:
            return _diff(src_a, src_b, op, rtol, atol, ProgressReporter(progress))
        finally:
            src_b.close()
    finally:
        src_a.close()


def _diff(
    src_a: TensorSource, src_b: TensorSource, op: str, rtol: float, atol: float, reporter: ProgressReporter
) -> DiffResult:
    ea = {e.key: e for e in src_a.entries()}
    eb = {e.key: e for e in src_b.entries()}
    shared = [k for k in ea if k in eb]
    reporter.stage("comparing", len(shared), sum(_resolve(ea, k).nbytes for k in shared))
    diffs = []
    for key in shared:
        x, y = _resolve(ea, key), _resolve(eb, key)
        d = _compare_entries(key, src_a, x, src_b, y, op, rtol, atol)
        if d is not None:
            diffs.append(d)
        reporter.advance(1, x.nbytes)
    reporter.stage("done")
    return DiffResult(
        a=src_a.uri,
        b=src_b.uri,
        op=op,
        only_in_a=[k for k in ea if k not in eb],
        only_in_b=[k for k in eb if k not in ea],
        differences=diffs,
        compared=len(shared),
    )


def _resolve(entries: dict[str, Entry], key: str) -> Entry:
    """The entry holding the value of ``key`` (links followed), or the link itself when it leads to
    a key this checkpoint does not hold; LinkCycle on a cycle."""
    return entries.get(link_root(key, entries), entries[key])


def _describe(e: Entry) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": e.kind, "dtype": e.dtype, "shape": list(e.shape) if e.shape is not None else None}
    if e.kind == "value":
        doc["value"] = repr(e.value)
    return doc


def _compare_entries(
    key: str, src_a: TensorSource, x: Entry, src_b: TensorSource, y: Entry, op: str, rtol: float, atol: float
) -> KeyDiff | None:
    numeric = x.kind in _NUMERIC and y.kind in _NUMERIC
    what = []
    if x.kind != y.kind and not numeric:
        what.append("kind")
    if numeric and x.dtype != y.dtype:
        what.append("dtype")
    if numeric and x.shape != y.shape:
        what.append("shape")
    diff = KeyDiff(key, what, _describe(x), _describe(y))
    if "kind" in what or "shape" in what:
        return diff
    if not numeric:
        if x.kind == "value":
            same = value_digest(x.value) == value_digest(y.value)
        else:
            same = value_digest(src_a.read(x.key)) == value_digest(src_b.read(y.key))
        if not same:
            diff.what.append("values")
        return diff if diff.what else None
    ta, tb = src_a.read(x.key), src_b.read(y.key)
    if not _tensors_match(ta, tb, op, rtol, atol):
        diff.what.append("values")
        diff.max_abs_diff, diff.max_rel_diff = _max_differences(ta, tb)
    return diff if diff.what else None


def _tensors_match(ta: Any, tb: Any, op: str, rtol: float, atol: float) -> bool:
    import torch

    inexact = ta.is_floating_point() or ta.is_complex()
    if ta.dtype == tb.dtype and (op == "equal" or not inexact):
        # Bit for bit: NaN payloads and -0.0 count, as a checkpoint stores them.
        return torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8))
    common = _common_dtype(ta.dtype, tb.dtype)
    if not (common.is_floating_point or common.is_complex):
        return all(torch.equal(sa.to(common), sb.to(common)) for sa, sb in _slices(ta, tb))
    if op == "equal":
        rtol = atol = 0.0
    return all(
        torch.allclose(sa.to(common), sb.to(common), rtol=rtol, atol=atol, equal_nan=True) for sa, sb in _slices(ta, tb)
    )


def _common_dtype(da: Any, db: Any) -> Any:
    """The dtype both sides are compared in. torch has no promotion rules for float8 and for
    uint16/32/64 with other types, and no arithmetic kernels for float8: those go through a wider type
    that holds every value of both sides (float8 in float32; integers in int64, uint64 in float64)."""
    import torch

    try:
        common = torch.promote_types(da, db)
    except RuntimeError:
        exact = not (da.is_floating_point or db.is_floating_point) and torch.uint64 not in (da, db)
        common = torch.int64 if exact else torch.float64
    if common.is_floating_point and common.itemsize == 1:  # float8
        common = torch.float32
    return common


def _max_differences(ta: Any, tb: Any) -> tuple[float | None, float | None]:
    """Largest |a - b| and |a - b| / max(|a|, |b|) (0 where both are 0); None for non-numeric dtypes."""
    import torch

    if ta.dtype == torch.bool or tb.dtype == torch.bool or ta.is_complex() or tb.is_complex():
        return None, None
    max_abs = max_rel = 0.0
    for sa, sb in _slices(ta, tb):
        da, db = sa.to(torch.float64), sb.to(torch.float64)
        delta = (da - db).abs()
        scale = torch.maximum(da.abs(), db.abs())
        rel = torch.where(scale > 0, delta / scale, torch.zeros_like(delta))
        # Equal values (also inf and inf, NaN and NaN) differ by 0; NaN on one side only, by inf.
        same = (da == db) | (da.isnan() & db.isnan())
        delta = torch.where(same, 0.0, torch.nan_to_num(delta, nan=float("inf")))
        rel = torch.where(same, 0.0, torch.nan_to_num(rel, nan=float("inf")))
        if delta.numel():
            max_abs = max(max_abs, float(delta.max()))
            max_rel = max(max_rel, float(rel.max()))
    return max_abs, max_rel


def _slices(ta: Any, tb: Any) -> Any:
    fa, fb = ta.reshape(-1), tb.reshape(-1)
    for start in range(0, max(fa.numel(), 1), _SLICE):
        yield fa[start : start + _SLICE], fb[start : start + _SLICE]
