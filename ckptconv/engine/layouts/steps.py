"""One plan step of a layout rule: how its inputs are read (plain, muP-scaled, LoRA-folded, masked),
its output's shape and dtype from a ``meta`` run of the transform, and NaN zeroing for sideband sparsity."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckptconv.core.dtypes import DTYPE_SIZES, is_float_dtype
from ckptconv.core.errors import (
    CkptconvError,
    ConversionError,
)
from ckptconv.engine.layouts import folding
from ckptconv.engine.layouts.dictpath import get_path
from ckptconv.engine.layouts.transforms import FLOAT_OP_PEAK, LORA_FOLD_BYTES_PER_ELEMENT, TRANSFORMS, lora_fold
from ckptconv.engine.plan import IDENTITY, Step, Transform
from ckptconv.formats.base import Entry, torch_dtype

# The bytes a rule input's function holds at its peak besides the values it reads (its result
# included), given the entries of its keys.
Cost = Callable[[Sequence[Entry]], int]


@dataclass(frozen=True)
class Pre:
    """How one rule input is obtained from source keys (a plain read, a muP scale, a LoRA fold).

    ``cost``: what ``fn`` holds at its peak beyond the values it reads; a step counts it beside
    its rule's own (``Transform.peak_factor``), so that the plan's memory estimate holds for a
    muP scale or a LoRA fold too."""

    keys: tuple[str, ...]
    fn: Callable[[list[Any]], Any] | None = None
    label: str = ""
    cost: Cost | None = None


def meta_tensor(e: Entry) -> Any:
    import torch  # deferred: planning is torch-free; only the meta tensors of a dry run need it

    if e.kind not in ("tensor", "array") or e.shape is None or e.dtype is None:
        raise ConversionError(f"{e.key} is a {e.kind}, not a tensor; a layout rule cannot transform it")
    return torch.empty(tuple(e.shape), dtype=torch_dtype(e.dtype), device="meta")


def make_step(
    out_key: str,
    pres: list[Pre],
    rule_fn: Callable[[list[Any], dict[str, Any], int], Any],
    params: dict[str, Any],
    index: int,
    name: str,
    peak: float,
    entries: Mapping[str, Entry],
) -> Step:
    flat: list[str] = []
    slots: list[list[int]] = []
    for p in pres:
        idx = []
        for k in p.keys:
            if k not in flat:
                flat.append(k)
            idx.append(flat.index(k))
        slots.append(idx)
    fns = [p.fn for p in pres]
    pre_bytes = sum(p.cost([entries[k] for k in p.keys]) for p in pres if p.cost is not None)

    def fn(values: list[Any]) -> Any:
        args = []
        for slot, pre in zip(slots, fns, strict=True):
            vs = [values[i] for i in slot]
            args.append(pre(vs) if pre is not None else vs[0])
        return rule_fn(args, params, index)

    tdef = TRANSFORMS.get(name)
    # A plain read through a transform that keeps its input's dtype and shape (a copy, the rotary
    # permutation): the output entry follows from the input's, with no meta tensor (no torch), and
    # the transform takes the input as bytes at run time.
    same_shape = tdef.same_shape if tdef is not None and len(flat) == 1 and fns == [None] else None
    if same_shape is not None:
        source = entries[flat[0]]
        if source.kind not in ("tensor", "array") or source.shape is None or source.dtype is None:
            raise ConversionError(f"{flat[0]} is a {source.kind}, not a tensor; a layout rule cannot transform it")
        same_shape(tuple(source.shape), params)
        dtype, shape = source.dtype, tuple(source.shape)
    else:
        try:
            probe = fn([meta_tensor(entries[k]) for k in flat])
        except CkptconvError:  # already typed (a CheckpointError is a ValueError too)
            raise
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            raise ConversionError(
                f"cannot build {out_key} from {', '.join(flat)} with {name}: {e}",
                hint="check that --model and the config match the checkpoint (head counts, sizes)",
            ) from e
        dtype, shape = str(probe.dtype).removeprefix("torch."), tuple(probe.shape)
    shown = {k: v for k, v in params.items() if not isinstance(v, dict | list) or k in ("parts",)}
    if isinstance(params.get("outputs"), list):  # a fused tensor: say which part this output is
        shown["part"] = params["outputs"][index]
        if params.get("rope"):
            shown["rope"] = ",".join(params["rope"])
    elif index:
        shown["index"] = index
    labels = [p.label for p in pres if p.label]
    if labels:
        shown["pre"] = "; ".join(labels)
    if name == "copy" and len(flat) == 1 and not shown and all(f is None for f in fns):
        # The value exactly as read: the default verification compares its hashes as read and as written.
        t = IDENTITY
    else:
        out_bytes = Entry(out_key, "tensor", dtype, shape).nbytes
        factor = peak + pre_bytes / out_bytes if out_bytes else peak
        t = Transform(name, fn, shown, peak_factor=factor, raw=same_shape is not None)
    return Step(Entry(out_key, "tensor", dtype, shape), tuple(flat), t)


def _sized(e: Entry) -> tuple[int, int]:
    """(elements, bytes) of a tensor entry."""
    return e.numel, e.nbytes


def _float_op_bytes(e: Entry) -> int:
    """What the float arithmetic of a scale holds for a value like ``e`` (transforms._float_op)."""
    return int(e.nbytes * (FLOAT_OP_PEAK if DTYPE_SIZES.get(e.dtype or "", 4) < 4 else 1.0))


def scaled(base: Pre, factor: float, label: str) -> Pre:
    """``base`` multiplied by ``factor`` (muP -> sP), rounded once."""

    def scale(v: Any) -> Any:
        return TRANSFORMS["scale"].to_hf([v], {"factor": factor}, 0)

    def cost(es: Sequence[Entry]) -> int:
        # The base's work is done (its result alive, counted in its cost) before the scale's starts.
        return (base.cost(es) if base.cost is not None else 0) + _float_op_bytes(es[0])

    inner = base.fn
    if inner is None:
        return Pre(base.keys, lambda vs: scale(vs[0]), label, cost)
    return Pre(base.keys, lambda vs: scale(inner(vs)), f"{base.label}; {label}", cost)


def lora_pre(keys: tuple[str, str, str], site: folding.LoraSite) -> Pre:
    """The weight ``keys[0]`` with the LoRA update ``keys[2] @ keys[1]`` folded in."""

    def fn(vs: list[Any]) -> Any:
        return lora_fold(vs[0], vs[1], vs[2], site.scale, fan_in_fan_out=site.fan_in_fan_out, embedding=site.embedding)

    def cost(es: Sequence[Entry]) -> int:
        (n, size), (na, _), (nb, _) = (_sized(e) for e in es[:3])
        # The update and W's float32 copy; the adapters' float32 copies while they multiply.
        return max(LORA_FOLD_BYTES_PER_ELEMENT * n + 4 * (na + nb), 4 * n + size)

    return Pre(keys, fn, f"LoRA fold x{site.scale:g}", cost)


# --- the plan --------------------------------------------------------------------------------


def masked(pre: Pre, mask_key: str) -> Pre:
    """``pre`` with a sparsity mask applied to its value (0 where the mask is false)."""
    keys = (*pre.keys, mask_key)
    inner = pre.fn

    def fn(vs: list[Any]) -> Any:
        w = inner(vs[:-1]) if inner is not None else vs[0]
        return w.masked_fill(~vs[-1].bool(), 0)

    def cost(es: Sequence[Entry]) -> int:
        # The mask as bool and inverted (a byte an element each) and the masked copy, beside the
        # inner result.
        n, size = _sized(es[0])
        return (pre.cost(es[:-1]) if pre.cost is not None else 0) + 2 * n + size

    return Pre(keys, fn, f"{pre.label}; sparsity mask" if pre.label else "sparsity mask", cost)


def sideband_sparsity(config: Mapping[str, Any]) -> bool:
    """Whether a CS run config trained with sideband sparsity, which marks pruned weights as NaN."""
    sections = [config.get("sparsity"), get_path(config, "trainer.init.sparsity", None)]
    return any(isinstance(sp, Mapping) and "sideband" in (sp.get("type"), sp.get("algorithm")) for sp in sections)


def zero_nans(step: Step) -> Step:
    """``step`` writing 0 where its floating-point output is NaN."""
    if step.out.kind not in ("tensor", "array") or not step.inputs or not is_float_dtype(step.out.dtype):
        return step
    t = step.transform or IDENTITY

    def fn(values: list[Any]) -> Any:
        out = t(values)
        if out.element_size() == 1:  # float8: torch has no masked_fill for it; float32 holds it exactly
            wide = out.float()
            return wide.masked_fill(wide.isnan(), 0).to(out.dtype)
        return out.masked_fill(out.isnan(), 0)  # a new tensor: the input may be read again

    # The NaN mask (a byte an element) and the zeroed copy; a float8 value goes through float32:
    # its widened copy and the zeroed one, four bytes an element each.
    size = DTYPE_SIZES.get(step.out.dtype or "", 4)
    extra = 1.0 + 1.0 / size + (8.0 if size == 1 else 0.0)
    return replace(step, transform=Transform(f"{t.name}; NaN->0", fn, dict(t.params), t.peak_factor + extra))
