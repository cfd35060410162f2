"""Execute a plan: read source values, transform, write to a sink, one entry at a time.

Memory: reader threads read the next source values while the current one is transformed and
written (reading overlaps writing; :mod:`ckptconv.engine.prefetch`), under a byte budget, so the
values alive at once are bounded by ``max(budget, largest value) +`` one step's output. Values
are dropped as soon as no later step needs them (reference counts from ``Plan.input_uses``).

Every data value written is hashed (xxh3-128 of its raw bytes) on the way out, and every source
value as it is read (on the reader threads). ``check_written`` compares the two for every entry
written unchanged, without reading anything again (the default verification); ``verify_output``
reopens what the sink wrote and compares every entry against the written hashes (``verify: full``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from ckptconv.core.errors import Cancelled, CkptconvError, VerificationFailed
from ckptconv.engine.plan import IDENTITY, Plan
from ckptconv.engine.prefetch import Prefetcher
from ckptconv.formats.base import Entry, OpaqueObject, RawTensor, TensorSink, TensorSource, as_torch, value_dtype
from ckptconv.formats.links import link_root
from ckptconv.formats.memory import POOL


@dataclass
class Progress:
    """A snapshot passed to progress callbacks (at most a few per second, plus one per stage change)."""

    stage: str  # planning | converting | verifying | publishing | done
    tensors_done: int = 0
    tensors_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    elapsed: float = 0.0

    @property
    def throughput(self) -> float:
        """Bytes per second over the stage so far."""
        return self.bytes_done / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float | None:
        rate = self.throughput
        if rate <= 0 or self.bytes_total <= self.bytes_done:
            return None if self.bytes_done < self.bytes_total else 0.0
        return (self.bytes_total - self.bytes_done) / rate

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "tensors_done": self.tensors_done,
            "tensors_total": self.tensors_total,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "throughput_bytes_per_s": round(self.throughput, 1),
            "eta_seconds": None if self.eta is None else round(self.eta, 1),
        }


ProgressFn = Callable[[Progress], None]
CancelFn = Callable[[], bool]


def check_cancelled(cancelled: CancelFn | None) -> None:
    """Raise Cancelled when ``cancelled()`` says so (nothing has been published at any caller)."""
    if cancelled is not None and cancelled():
        raise Cancelled("cancelled by request; nothing was published")


class ProgressReporter:
    """Throttles progress callbacks to ``hz`` per second; stage changes always report."""

    def __init__(self, fn: ProgressFn | None, hz: float = 4.0) -> None:
        self.fn = fn
        self.min_interval = 1.0 / hz
        self.last = 0.0
        self.stage_start = time.monotonic()
        self.current = Progress("planning")

    def stage(self, name: str, tensors_total: int = 0, bytes_total: int = 0) -> None:
        self.stage_start = time.monotonic()
        self.current = Progress(name, 0, tensors_total, 0, bytes_total)
        self._emit(force=True)

    def advance(self, tensors: int, nbytes: int) -> None:
        self.current.tensors_done += tensors
        self.current.bytes_done += nbytes
        self._emit(force=False)

    def complete(self, name: str, tensors_total: int, bytes_total: int) -> None:
        """A final stage that is over when it starts: its counters read full, not zero."""
        self.stage(name, tensors_total, bytes_total)
        self.advance(tensors_total, bytes_total)
        self._emit(force=True)

    def finish(self) -> None:
        self._emit(force=True)

    def _emit(self, force: bool) -> None:
        if self.fn is None:
            return
        now = time.monotonic()
        if not force and now - self.last < self.min_interval:
            return
        self.last = now
        self.current.elapsed = now - self.stage_start
        self.fn(Progress(**vars(self.current)))


# --- hashing ---------------------------------------------------------------------------------


def value_digest(value: Any) -> str:
    """A digest of one value as a checkpoint stores it: raw bytes for tensors, payload for objects.

    A :class:`RawTensor` digests as its torch tensor does (same bytes, same dtype and shape text)."""
    if isinstance(value, RawTensor):
        h = xxhash.xxh3_128(value.data)
        h.update(f"|torch.{value.dtype}|{value.shape}".encode())
        return h.hexdigest()
    torch = sys.modules.get("torch")  # a torch tensor means torch is loaded; nothing else needs it
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous().reshape(-1)
        raw = t.view(torch.uint8).numpy() if t.numel() else b""
        h = xxhash.xxh3_128(raw)
        h.update(f"|{value.dtype!s}|{tuple(value.shape)}".encode())
        return h.hexdigest()
    if isinstance(value, OpaqueObject):
        return "bytes:" + xxhash.xxh3_128(value.payload).hexdigest()
    if isinstance(value, bytes | bytearray):
        return "bytes:" + xxhash.xxh3_128(bytes(value)).hexdigest()
    return "value:" + xxhash.xxh3_128(_canonical_repr(value).encode()).hexdigest()


def _canonical_repr(value: Any) -> str:
    # Floats by exact hex so NaN == NaN and -0.0 != 0.0 compare as a checkpoint would store them;
    # bool before int because bool is an int subclass.
    if isinstance(value, bool):
        return f"bool:{value}"
    if isinstance(value, float):
        return "float:" + (value.hex() if math.isfinite(value) else repr(value))
    if isinstance(value, int):
        return f"int:{value}"
    if value is None:
        return "none"
    if isinstance(value, str):
        return "str:" + value
    import numpy as np

    if isinstance(value, np.generic):
        return _canonical_repr(value.item())
    return f"{type(value).__name__}:{value!r}"


def value_nbytes(value: Any) -> int:
    if isinstance(value, RawTensor):
        return value.nbytes
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, OpaqueObject):
        return len(value.payload)
    if isinstance(value, bytes | bytearray):
        return len(value)
    return 0


def _first_use_order(plan: Plan) -> list[str]:
    seen: set[str] = set()
    order: list[str] = []
    for s in plan.steps:
        if s.out.kind == "link":
            continue
        for k in s.inputs:
            if k not in seen:
                seen.add(k)
                order.append(k)
    return order


def execute(
    plan: Plan,
    source: TensorSource,
    sink: TensorSink,
    *,
    reporter: ProgressReporter | None = None,
    cancelled: CancelFn | None = None,
    prefetch: bool = True,
    parallel_reads: bool = True,
    read_ahead: int | None = None,
    read_digests: dict[str, str] | None = None,
) -> dict[str, str]:
    """Run ``plan`` from ``source`` into ``sink`` (begin + writes; the caller commits or aborts).

    ``read_ahead`` bounds the bytes the reader threads hold ahead (default: the largest value;
    ``Plan.memory`` derives it from a memory budget); they are ``source.read_parallelism`` threads
    unless ``parallel_reads`` is false (see :mod:`ckptconv.engine.prefetch`). ``read_digests``, when given, receives the
    digest of every source value as read (for ``check_written``).

    Returns the digest of every value written, by output key. Raises Cancelled between entries when
    ``cancelled()`` turns true.
    """
    reporter = reporter or ProgressReporter(None)
    entries = plan.entries()
    sink.check(entries)
    src_sizes = {e.key: e.nbytes for e in source.entries()}
    uses = plan.input_uses()
    order = _first_use_order(plan)
    largest = max((src_sizes.get(k, 0) for k in order), default=0)
    budget = max(largest, read_ahead or 0)
    fetcher: Prefetcher | None = None

    def hashed_as_read(key: str, value: Any) -> None:
        if read_digests is not None:
            read_digests[key] = value_digest(value)

    def start_reading() -> None:
        # Called by the sink's begin once it will refuse nothing more (TensorSink.begin): the
        # reads overlap the rest of its preparation, and a refused job reads nothing.
        nonlocal fetcher
        if prefetch and order:
            fetcher = Prefetcher(
                source,
                order,
                src_sizes,
                budget,
                workers=source.read_parallelism if parallel_reads else 1,
                on_read=hashed_as_read,
            )

    # A sink that takes tensors as bytes gets them so from a source that can read them so: a
    # conversion that only moves bytes never imports torch. A transform gets torch tensors unless
    # it takes bytes too (``Transform.raw``).
    # The buffer pool's buffers (idle or partly lent) are one term of the estimate, the largest
    # value's size (Plan.memory, formats/memory.py).
    with source.reading_raw(sink.accepts_raw), POOL.capped(max(largest, plan.largest_entry_bytes())):
        cache: dict[str, Any] = {}
        digests: dict[str, str] = {}
        try:
            sink.begin(entries, plan.spec, on_checked=start_reading)
            reporter.stage("converting", plan.tensors_total, plan.bytes_total)
            for step in plan.steps:
                check_cancelled(cancelled)
                out = step.out
                if out.kind == "link":
                    continue
                if not step.inputs:
                    value = out.value
                else:
                    values = []
                    for k in step.inputs:
                        if k not in cache:
                            if fetcher:
                                cache[k] = fetcher.get(k)
                            else:
                                cache[k] = source.read(k)
                                if read_digests is not None:
                                    read_digests[k] = value_digest(cache[k])
                        values.append(cache[k])
                    value = apply_transform(step.transform, values)
                    del values
                check_produced(out, value)
                sink.write(out.key, value)
                # After the write: a sink that changed the value in place shows in the digest.
                digests[out.key] = value_digest(value)
                if out.is_data:
                    reporter.advance(1, out.nbytes)
                del value
                for k in step.inputs:
                    uses[k] -= 1
                    if uses[k] == 0:
                        cache.pop(k, None)
                        if fetcher:
                            fetcher.release(k)
            reporter.finish()
        finally:
            cache.clear()
            if fetcher:
                fetcher.stop()
    return digests


def apply_transform(transform: Any, values: list[Any]) -> Any:
    """``transform`` (None: the identity) of ``values``: tensors as bytes to a transform that takes
    them so (``Transform.raw``), as torch tensors to any other."""
    if transform is None or transform is IDENTITY:
        return values[0]
    if transform.raw:
        return transform(values)
    return transform([as_torch(v) for v in values])


def check_produced(out: Entry, value: Any) -> None:
    """A transform must produce exactly the entry the plan announced (the sink's header depends on it)."""
    if out.kind not in ("tensor", "array"):
        return
    if not isinstance(value, RawTensor):
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(value, torch.Tensor):
            raise VerificationFailed(f"{out.key}: the plan announced a tensor but {type(value).__name__} was produced")
    dtype = value_dtype(value)
    if dtype != out.dtype or tuple(value.shape) != tuple(out.shape or ()):
        raise VerificationFailed(
            f"{out.key}: produced {dtype}{list(value.shape)} but the plan announced {out.dtype}{list(out.shape or ())}"
        )


# --- verification ----------------------------------------------------------------------------


@dataclass
class VerifyReport:
    ok: bool
    entries_checked: int
    bytes_checked: int
    mismatches: list[str]
    hash: str = "xxh3_128"
    mode: str = "full"

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "mode": self.mode,
            "entries_checked": self.entries_checked,
            "bytes_checked": self.bytes_checked,
            "mismatches": self.mismatches[:50],
            "hash": self.hash,
        }


def check_written(plan: Plan, digests: dict[str, str], read_digests: dict[str, str]) -> VerifyReport:
    """Verification without a second read: every entry the plan writes was handed to the sink, and
    each one written unchanged (a copy of one source value) hashes as that value did when read.

    Transformed entries (casts, layout rules) are checked for presence only; ``verify_output``
    (``verify: full``) re-reads the output and compares everything.
    """
    mismatches: list[str] = []
    checked = 0
    nbytes = 0
    for step in plan.steps:
        out = step.out
        if out.kind == "link":
            continue
        if out.key not in digests:
            mismatches.append(f"{out.key}: never written")
            continue
        unchanged = len(step.inputs) == 1 and step.transform in (None, IDENTITY)
        if unchanged and step.inputs[0] in read_digests:
            if digests[out.key] != read_digests[step.inputs[0]]:
                mismatches.append(f"{out.key}: written bytes differ from {step.inputs[0]!r} as read")
                continue
            checked += 1
            nbytes += out.nbytes if out.is_data else 0
    return VerifyReport(not mismatches, checked, nbytes, mismatches, mode="hashes")


def verify_output(
    plan: Plan,
    digests: dict[str, str],
    reopened: TensorSource,
    *,
    reporter: ProgressReporter | None = None,
    cancelled: CancelFn | None = None,
) -> VerifyReport:
    """Reopen what was written and compare every entry with what the plan wrote.

    Entry kinds are compared by what the target can express: a format without a separate numpy
    kind returns arrays as tensors; one that cannot alias returns links as copies of their target.
    """
    reporter = reporter or ProgressReporter(None)
    written = {s.out.key: s.out for s in plan.steps}
    got = {e.key: e for e in reopened.entries()}
    mismatches: list[str] = []
    missing = [k for k in written if k not in got]
    extra = [k for k in got if k not in written]
    mismatches += [f"{k}: missing from the output" for k in missing]
    mismatches += [f"{k}: in the output but not in the plan" for k in extra]
    reporter.stage("verifying", plan.tensors_total, plan.bytes_total)
    checked = 0
    nbytes = 0
    # The values read back take buffers of the pool as the run's did, after the run's cap is gone:
    # capped the same way, it holds at most the largest value, and nothing once this returns.
    with POOL.capped(plan.largest_entry_bytes()):
        for key, want in written.items():
            if key not in got:
                continue
            check_cancelled(cancelled)
            have = got[key]
            if want.kind == "link":
                if have.kind == "link":
                    if have.target != want.target:
                        mismatches.append(f"{key}: links to {have.target!r}, expected {want.target!r}")
                    continue
                expected = digests.get(want.target or "")
            else:
                expected = digests.get(key)
            ref = written.get(link_root(key, written), want)
            if have.kind in ("tensor", "array") and (
                have.dtype != ref.dtype or tuple(have.shape or ()) != tuple(ref.shape or ())
            ):
                mismatches.append(f"{key}: {have.dtype}{list(have.shape or ())} != {ref.dtype}{list(ref.shape or ())}")
                continue
            if have.kind == "link":
                expected_target = digests.get(have.target or "")
                if expected_target != expected:
                    mismatches.append(f"{key}: output links to {have.target!r} whose content differs")
                continue
            value = have.value if have.kind == "value" else reopened.read(key)
            digest = value_digest(value)
            if digest != expected:
                mismatches.append(f"{key}: content differs from what was written")
            checked += 1
            size = value_nbytes(value)
            nbytes += size
            del value
            if have.is_data:
                reporter.advance(1, size)
    reporter.finish()
    return VerifyReport(not mismatches, checked, nbytes, mismatches)


def describe_error(err: BaseException) -> dict[str, Any]:
    if isinstance(err, CkptconvError):
        return err.to_problem()
    return {"code": "internal_error", "title": "Internal error", "detail": f"{type(err).__name__}: {err}"}
