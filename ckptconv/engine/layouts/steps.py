"""One plan step of a layout rule: how its inputs are read (plain, muP-scaled, LoRA-folded, masked),
its output's shape and dtype from a ``meta`` run of the transform, and NaN zeroing for sideband sparsity."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptconv.core.dtypes import is_float_dtype
from ckptconv.core.errors import (
    CkptconvError,
    ConversionError,
)
from ckptconv.engine.layouts import folding
from ckptconv.engine.layouts.dictpath import get_path
from ckptconv.engine.layouts.transforms import TRANSFORMS, lora_fold
from ckptconv.engine.plan import IDENTITY, Step, Transform
from ckptconv.formats.base import Entry, torch_dtype


@dataclass(frozen=True)
class Pre:
    """How one rule input is obtained from source keys (a plain read, a muP scale, a LoRA fold)."""

    keys: tuple[str, ...]
    fn: Callable[[list[Any]], Any] | None = None
    label: str = ""


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
        t = Transform(name, fn, shown, peak_factor=peak, raw=same_shape is not None)
    return Step(Entry(out_key, "tensor", dtype, shape), tuple(flat), t)


def scale_fn(factor: float) -> Callable[[list[Any]], Any]:
    def fn(vs: list[Any]) -> Any:
        return TRANSFORMS["scale"].to_hf(vs, {"factor": factor}, 0)

    return fn


def lora_fn(site: folding.LoraSite) -> Callable[[list[Any]], Any]:
    def fn(vs: list[Any]) -> Any:
        return lora_fold(vs[0], vs[1], vs[2], site.scale, fan_in_fan_out=site.fan_in_fan_out, embedding=site.embedding)

    return fn


# --- the plan --------------------------------------------------------------------------------


def masked(pre: Pre, mask_key: str) -> Pre:
    """``pre`` with a sparsity mask applied to its value (0 where the mask is false)."""
    keys = (*pre.keys, mask_key)
    inner = pre.fn

    def fn(vs: list[Any]) -> Any:
        w = inner(vs[:-1]) if inner is not None else vs[0]
        return w.masked_fill(~vs[-1].bool(), 0)

    return Pre(keys, fn, f"{pre.label}; sparsity mask" if pre.label else "sparsity mask")


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

    return replace(step, transform=Transform(f"{t.name}; NaN->0", fn, dict(t.params), t.peak_factor + 1.0))
