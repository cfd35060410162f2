"""Plans: the full list of output entries with their recipes, computed before any data moves.

A plan is pure data built from source metadata (``TensorSource.entries()``) and, for model-layout
conversions, a layout's rules. It powers dry runs (what would be written, what is unmatched, peak
memory), progress totals, and execution (``ckptconv.engine.execute``).

Each :class:`Step` produces one output entry from zero or more source keys through a
:class:`Transform`. The executor reads a step's inputs, applies the transform, writes the result,
and forgets every input no later step needs, so memory holds at most one step's inputs plus its
output (a fused QKV weight holds its three sources, nothing else).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ckptconv.core.dtypes import DTYPE_SIZES, is_float_dtype
from ckptconv.core.errors import InvalidRequest, UnsupportedDtype
from ckptconv.core.sizes import parse_size
from ckptconv.formats.base import Entry
from ckptconv.formats.tree import TreeSpec

# Memory a conversion needs besides tensor data: interpreter, libraries, I/O buffers.
BASE_MEMORY = 300 << 20


@dataclass(frozen=True)
class Transform:
    """A named function of a step's input values (in ``Step.inputs`` order) to the output value.

    ``name`` and ``params`` describe it in dry runs; ``fn`` must be pure and must not keep
    references to its inputs. ``peak_factor`` estimates the memory ``fn`` holds at its peak beyond
    its inputs, its output included, in units of the output size (1.0 for a contiguous transpose
    or a cast; 0.0 for the identity, whose output is its input).
    """

    name: str
    fn: Callable[[list[Any]], Any]
    params: dict[str, Any] = field(default_factory=dict)
    peak_factor: float = 1.0
    # ``fn`` takes RawTensor inputs (formats.base) as they are; otherwise they reach it as torch tensors.
    raw: bool = False

    def __call__(self, values: list[Any]) -> Any:
        return self.fn(values)

    def describe(self) -> str:
        if not self.params:
            return self.name
        args = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name}({args})"


def _identity(values: list[Any]) -> Any:
    return values[0]


IDENTITY = Transform("copy", _identity, peak_factor=0.0)


@dataclass(frozen=True)
class Step:
    """One output entry and how to build it.

    - ``out.kind == "value"`` with no inputs: the value is ``out.value`` itself;
    - ``out.kind == "link"``: nothing is computed; the sink aliases ``out.target``;
    - otherwise ``transform(values of inputs)`` (IDENTITY when None) gives the value.
    """

    out: Entry
    inputs: tuple[str, ...] = ()
    transform: Transform | None = None

    @property
    def recipe(self) -> str:
        if self.out.kind == "link":
            return f"link -> {self.out.target}"
        if not self.inputs:
            return "value"
        t = self.transform or IDENTITY
        return f"{t.describe()}({', '.join(self.inputs)})"


@dataclass
class Plan:
    steps: list[Step]
    spec: TreeSpec | None = None
    warnings: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # source keys no rule matched
    dropped: list[str] = field(default_factory=list)  # source keys deliberately not written
    config: dict[str, Any] | None = None  # converted model config, for layout conversions
    extras: dict[str, Any] = field(default_factory=dict)  # layout-specific facts for the dry run

    def entries(self) -> list[Entry]:
        return [s.out for s in self.steps]

    def data_steps(self) -> list[Step]:
        return [s for s in self.steps if s.out.is_data]

    @property
    def tensors_total(self) -> int:
        return len(self.data_steps())

    @property
    def bytes_total(self) -> int:
        return sum(s.out.nbytes for s in self.data_steps())

    def largest_entry_bytes(self) -> int:
        return max((s.out.nbytes for s in self.data_steps()), default=0)

    def input_uses(self) -> dict[str, int]:
        """How many steps read each source key (the executor frees a value at zero)."""
        uses: dict[str, int] = {}
        for s in self.steps:
            for k in s.inputs:
                uses[k] = uses.get(k, 0) + 1
        return uses

    def memory(
        self,
        source_sizes: dict[str, int],
        budget: int | str | None = None,
        writer_buffers: int = 0,
        *,
        refuse_short: bool = True,
    ) -> dict[str, int | None]:
        """How a run of this plan uses memory, within ``budget`` bytes when one is given.

        A run holds four things at once (:mod:`ckptconv.engine.prefetch`, ``execute``):

        - source values read and not yet released: at most the read-ahead, which is never less
          than the largest value, or the inputs one step needs together (a fused QKV) when those
          are more (:meth:`step_bytes`);
        - the buffer pool's idle buffers, capped at the largest value (``BufferPool.capped``);
        - the value a transform makes beside its inputs (a cast, a transpose:
          ``Transform.peak_factor``; nothing for a copy);
        - ``writer_buffers`` bytes of upload parts (an S3 target's;
          ``TensorSink.remote_buffer_bytes``) and a fixed allowance for the interpreter and
          libraries, :data:`BASE_MEMORY`.

        With a budget the read-ahead gets whatever the other three leave; a budget that leaves it
        less than the inputs of the largest step cannot be kept: InvalidRequest, naming the minimum
        (unless ``refuse_short`` is false: the read-ahead is then the largest value, and the
        estimate says by how much the run passes the budget).
        """
        largest = max([*source_sizes.values(), self.largest_entry_bytes()], default=0)
        inputs, transient = self.step_bytes(source_sizes)
        working = max(largest, inputs)
        others = largest + transient + BASE_MEMORY + writer_buffers
        minimum = working + others
        if budget is None:
            read_ahead = largest
        else:
            budget = parse_size(budget)
            if budget < minimum and refuse_short:
                raise InvalidRequest(
                    f"a memory budget of {budget} bytes is too small for this checkpoint: it needs at least"
                    f" {minimum} (a working set of {working + transient} bytes: the most inputs one step"
                    f" holds, {working}, and the largest output a transform makes beside its inputs,"
                    f" {transient}; the buffer pool's {largest} bytes, {writer_buffers} bytes of the"
                    f" writers' buffers (upload parts, direct-write staging) and {BASE_MEMORY} bytes)",
                    hint=f"raise memory_budget to {minimum} or more",
                )
            read_ahead = max(largest, budget - others)
        return {
            "budget_bytes": budget,
            "minimum_bytes": minimum,
            "read_ahead_bytes": read_ahead,
            "writer_buffer_bytes": writer_buffers,
            "estimated_peak_bytes": max(read_ahead, working) + others,
        }

    def step_bytes(self, source_sizes: dict[str, int]) -> tuple[int, int]:
        """The most source bytes one step holds at once (its inputs and those a later step still
        needs), and the most a step's transform makes beside them (``Transform.peak_factor`` times
        its output; nothing for a copy).

        Simulates the executor's reference counting over the step order.
        """
        remaining = self.input_uses()
        alive: dict[str, int] = {}
        inputs = transient = 0
        for s in self.steps:
            for k in s.inputs:
                alive.setdefault(k, source_sizes.get(k, 0))
            inputs = max(inputs, sum(alive.values()))
            out_bytes = s.out.nbytes if s.out.is_data else 0
            transient = max(transient, int(out_bytes * (s.transform or IDENTITY).peak_factor))
            for k in s.inputs:
                remaining[k] -= 1
                if remaining[k] == 0:
                    alive.pop(k, None)
        return inputs, transient

    def peak_memory_estimate(self, source_sizes: dict[str, int]) -> int:
        """Bytes of tensor data alive at once in a run with the default read-ahead (:meth:`memory`
        without its fixed share)."""
        m = self.memory(source_sizes)
        return int(m["estimated_peak_bytes"] or 0) - BASE_MEMORY

    def to_dict(self, *, source_sizes: dict[str, int] | None = None, limit: int | None = None) -> dict[str, Any]:
        """JSON-able summary for dry runs."""
        steps = self.steps if limit is None else self.steps[:limit]
        out: dict[str, Any] = {
            "tensors": self.tensors_total,
            "bytes": self.bytes_total,
            "largest_tensor_bytes": self.largest_entry_bytes(),
            "entries": [
                {
                    "key": s.out.key,
                    "kind": s.out.kind,
                    "dtype": s.out.dtype,
                    "shape": list(s.out.shape) if s.out.shape is not None else None,
                    "bytes": s.out.nbytes,
                    "recipe": s.recipe,
                }
                for s in steps
            ],
            "warnings": list(self.warnings),
            "unmatched_keys": list(self.unmatched),
            "dropped_keys": list(self.dropped),
        }
        if limit is not None and len(self.steps) > limit:
            out["entries_truncated"] = len(self.steps) - limit
        if source_sizes is not None:
            out["estimated_peak_memory_bytes"] = self.peak_memory_estimate(source_sizes)
        if self.config is not None:
            out["config"] = self.config
        if self.extras:
            out.update(self.extras)
        return out


def cast_transform(dtype: str) -> Transform:
    def fn(values: list[Any]) -> Any:
        import torch

        v = values[0]
        return v.to(getattr(torch, dtype)) if isinstance(v, torch.Tensor) else v

    return Transform("cast", fn, {"dtype": dtype}, peak_factor=1.0)


CASTABLE_KINDS = ("tensor", "array")


def identity_plan(
    entries: Sequence[Entry],
    spec: TreeSpec | None,
    *,
    dtype: str | None = None,
    cast_only: Iterable[str] | None = None,
) -> Plan:
    """The plan of a container conversion: every entry unchanged, optionally cast to ``dtype``.

    ``dtype`` casts floating-point tensors only (integer and bool tensors, step counters and masks,
    keep their dtype: casting them would change their meaning). ``cast_only`` restricts the cast to
    the given source dtypes.
    """
    if dtype is not None and dtype not in DTYPE_SIZES:
        raise UnsupportedDtype(f"unknown target dtype {dtype!r}", hint=f"choose one of {', '.join(DTYPE_SIZES)}")
    only = set(cast_only) if cast_only is not None else None
    steps: list[Step] = []
    warnings: list[str] = []
    cast = cast_transform(dtype) if dtype else None
    for e in entries:
        if e.kind == "link" or e.kind == "value":
            steps.append(Step(e))
        elif (
            cast is not None
            and e.kind in CASTABLE_KINDS
            and e.dtype != dtype
            and is_float_dtype(e.dtype)
            and (only is None or e.dtype in only)
        ):
            steps.append(Step(replace(e, dtype=dtype), (e.key,), cast))
        else:
            steps.append(Step(e, (e.key,)))
    if cast is not None:
        kept = sorted({e.dtype for e in entries if e.kind in CASTABLE_KINDS and not is_float_dtype(e.dtype)})
        if kept:
            warnings.append(f"non-floating tensors keep their dtype ({', '.join(str(d) for d in kept)})")
    return Plan(steps, spec, warnings=warnings)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)
