"""Tensor transforms that layout tables name, in both directions.

Every transform has an ``import`` side (Hugging Face -> Cerebras) and an ``export`` side (Cerebras ->
Hugging Face) with the same signature ``fn(values, params, index) -> tensor``: ``values`` are the
step's input tensors in the rule's order, ``params`` the rule's evaluated parameters and ``index``
which of the rule's outputs is being produced (a fused QKV weight splits into three outputs).

Functions are pure and device-agnostic: the planner runs them on ``meta`` tensors to learn output
shapes and dtypes without touching data, and the engine runs them on real ones. Generators (ALiBi
slopes, causal masks, ...) build their tensor on the device of their anchor input for the same
reason. torch is imported inside the functions so that tables can be validated without it.

Layout notes (rows are the output dimension of a ``[out, in]`` weight, or the entries of a bias):

- ``rope``: Hugging Face rotate-half rotary layout <-> Cerebras interleaved pairs. Per group of
  ``head_dim`` rows, the first ``rotary_dim`` rows are reordered (reshape ``[2, r/2]`` -> transpose);
  the rest of each group is untouched (partial rotary).
- ``fused``: one fused projection (``c_attn``, ``query_key_value``, ``qkv_proj``, ``kv_attn``) viewed
  as ``[groups, sum(parts) * unit, ...]``; each part is a contiguous slice of every group. This one
  description covers GPT-2 (1 group of 3 x H heads), GPT-NeoX and BLOOM (H groups of q,k,v),
  Falcon (G groups of g query heads, 1 key, 1 value), CodeGen (mp_num = 4 groups ordered q,v,k),
  StarCoder MQA (q: H heads, k: 1, v: 1) and MHA (H groups), SantaCoder (k, v).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptconv.core.errors import ConversionError
from ckptconv.formats.base import RawTensor

Fn = Callable[[list[Any], dict[str, Any], int], Any]


@dataclass(frozen=True)
class TransformDef:
    name: str
    to_cs: Fn
    to_hf: Fn
    peak_factor: float = 1.0
    generator: bool = False  # ignores its input's value (it only anchors the step)
    doc: str = ""
    literal: tuple[str, ...] = ()  # params that are names, not expressions over the config
    # For a transform whose output has its one input's dtype and shape: refuses (ConversionError) an
    # input shape it cannot take, given the params. Planning then needs no torch (no meta tensor),
    # and the transform takes and gives RawTensor values (formats.base) as well as torch tensors.
    same_shape: Callable[[tuple[int, ...], dict[str, Any]], None] | None = None


TRANSFORMS: dict[str, TransformDef] = {}


def _register(t: TransformDef) -> TransformDef:
    TRANSFORMS[t.name] = t
    return t


def _same(
    fn: Fn,
    name: str,
    doc: str,
    peak: float = 1.0,
    generator: bool = False,
    same_shape: Callable[[tuple[int, ...], dict[str, Any]], None] | None = None,
) -> TransformDef:
    return _register(TransformDef(name, fn, fn, peak, generator, doc, same_shape=same_shape))


# --- elementary ------------------------------------------------------------------------------


def _copy(values: list[Any], p: dict[str, Any], index: int) -> Any:
    return values[0]


def _transpose(values: list[Any], p: dict[str, Any], index: int) -> Any:
    x = values[0]
    return x.t().contiguous() if x.dim() == 2 else x


_same(_copy, "copy", "the tensor unchanged", peak=0.0, same_shape=lambda shape, p: None)
_same(_transpose, "transpose", "2-D weights transposed (HF Conv1D [in, out] <-> [out, in]); 1-D tensors unchanged")


def _torch() -> Any:
    import torch  # deferred: planning a layout needs no torch until a value is computed

    return torch


# What _float_op holds besides its input, in units of a 16-bit input's bytes: its float32 copy,
# worked on in place, and the result cast back. (For wider floats: the result alone, 1.0.)
FLOAT_OP_PEAK = 3.0


def _float_op(x: Any, op: Callable[[Any, Any], Any]) -> Any:
    """``op(t, out)`` (computing into ``out``) in float32 (or wider) and back, so bf16/fp16 values
    are rounded once. In place on one float32 copy: a float32 input and a float32 result beside it
    would hold five times a 16-bit value's bytes, not three (``FLOAT_OP_PEAK``)."""
    import torch

    if x.dtype in (torch.float16, torch.bfloat16):
        wide = x.float()
        return op(wide, wide).to(x.dtype)
    if x.is_floating_point():
        return op(x, torch.empty_like(x))
    return op(x, None)  # integers: torch's promotion decides the result, as before


_register(
    TransformDef(
        "add_one",
        lambda v, p, i: _float_op(v[0], lambda t, out: _torch().add(t, 1, out=out)),
        lambda v, p, i: _float_op(v[0], lambda t, out: _torch().sub(t, 1, out=out)),
        doc="norm weights stored as w + 1 on the Cerebras side (Gemma multiplies by 1 + w)",
    )
)


def _scale(values: list[Any], p: dict[str, Any], index: int) -> Any:
    factor = float(p["factor"])
    return _float_op(values[0], lambda t, out: _torch().mul(t, factor, out=out))


_same(_scale, "scale", "multiply by a constant factor (muP -> sP folding)", peak=FLOAT_OP_PEAK)


def _cls_to_end(values: list[Any], p: dict[str, Any], index: int) -> Any:
    import torch

    x = values[0]
    return torch.cat([x[1:], x[:1]], dim=0)


def _cls_to_front(values: list[Any], p: dict[str, Any], index: int) -> Any:
    import torch

    x = values[0]
    return torch.cat([x[-1:], x[:-1]], dim=0)


_register(
    TransformDef(
        "cls_last",
        _cls_to_end,
        _cls_to_front,
        doc="ViT position embeddings: the class token's row is first on the HF side, last on the Cerebras side",
    )
)


# --- rotary ----------------------------------------------------------------------------------


def _rope_check(shape: tuple[int, ...], head_dim: int, rotary_dim: int) -> None:
    d, r = int(head_dim), int(rotary_dim)
    if not shape or d <= 0 or r <= 0 or r > d or r % 2 or shape[0] % d:
        raise ConversionError(
            f"cannot apply the rotary permutation to a tensor of shape {list(shape)} with head_dim={d}, rotary_dim={r}",
            hint="check num_heads, num_kv_groups and rotary_dim in the model config",
        )


def _rope_rows(rows: int, d: int, r: int, *, to_cs: bool) -> Any:
    """Which input row each output row of :func:`rope_permute` is: the same reshapes and
    transposes applied to the row numbers."""
    import numpy as np

    g = rows // d
    y = np.arange(rows).reshape(g, d)
    rot = y[:, :r]
    if to_cs:
        rot = rot.reshape(g, 2, r // 2).transpose(0, 2, 1).reshape(g, r)
    else:
        rot = rot.reshape(g, r // 2, 2).transpose(0, 2, 1).reshape(g, r)
    return np.concatenate([rot, y[:, r:]], axis=1).reshape(rows)


def rope_permute(x: Any, head_dim: int, rotary_dim: int, *, to_cs: bool) -> Any:
    """Reorder the rotary rows of every ``head_dim``-row group (see the module docstring)."""
    _rope_check(tuple(x.shape), head_dim, rotary_dim)
    d, r = int(head_dim), int(rotary_dim)
    rows = x.shape[0]
    rest = tuple(x.shape[1:])
    if isinstance(x, RawTensor):
        # Whole rows move: the bytes of each, gathered in their new order (no torch).
        import numpy as np

        from ckptconv.formats.memory import empty_raw

        out = empty_raw(x.shape, x.dtype)
        if out.nbytes:
            order = _rope_rows(rows, d, r, to_cs=to_cs)
            # mode="clip": the row numbers are a permutation, so nothing is clipped; the default
            # mode ("raise") takes into a temporary array of the output's size and copies that into
            # ``out``: fresh pages and a second copy (0.2 GB/s inside a 3 GB conversion here, 1-3 GB/s
            # alone and warm, against 6.5 GB/s with "clip").
            np.take(x.data.reshape(rows, -1), order, axis=0, out=out.data.reshape(rows, -1), mode="clip")
        return out
    import torch

    g = rows // d
    y = x.reshape(g, d, *rest)
    rot = y[:, :r]
    if to_cs:
        rot = rot.reshape(g, 2, r // 2, *rest).transpose(1, 2).reshape(g, r, *rest)
    else:
        rot = rot.reshape(g, r // 2, 2, *rest).transpose(1, 2).reshape(g, r, *rest)
    if r < d:
        rot = torch.cat([rot, y[:, r:]], dim=1)
    return rot.reshape(rows, *rest).contiguous()


_register(
    TransformDef(
        "rope",
        lambda v, p, i: rope_permute(v[0], p["head_dim"], p["rotary_dim"], to_cs=True),
        lambda v, p, i: rope_permute(v[0], p["head_dim"], p["rotary_dim"], to_cs=False),
        doc="rotary rows: HF rotate-half <-> CS interleaved, per head_dim group",
        same_shape=lambda shape, p: _rope_check(shape, p["head_dim"], p["rotary_dim"]),
    )
)


# --- fused projections -----------------------------------------------------------------------


def _parts(p: dict[str, Any]) -> tuple[list[str], list[int], dict[str, int]]:
    names = list(p["parts"])
    units = [int(p["parts"][n]) for n in names]
    offsets: dict[str, int] = {}
    at = 0
    for n, u in zip(names, units, strict=True):
        offsets[n] = at
        at += u
    return names, units, offsets


def _fused_split(values: list[Any], p: dict[str, Any], index: int) -> Any:
    x = values[0]
    if p.get("transpose") and x.dim() == 2:
        x = x.t()
    names, units, offsets = _parts(p)
    groups, unit = int(p["groups"]), int(p["unit"])
    total = sum(units) * unit * groups
    if x.shape[0] != total:
        raise ConversionError(
            f"fused projection has {x.shape[0]} rows, the config implies {total} "
            f"({groups} groups x {sum(units)} x {unit})",
            hint="check num_heads / num_kv_groups / hidden_size in the model config",
        )
    rest = tuple(x.shape[1:])
    name = p["outputs"][index]
    y = x.reshape(groups, sum(units) * unit, *rest)
    start = offsets[name] * unit
    part = y[:, start : start + units[names.index(name)] * unit].reshape(-1, *rest)
    if name in p.get("rope", ()):
        return rope_permute(part, p["head_dim"], p["rotary_dim"], to_cs=True)
    return part.contiguous()


def _fused_merge(values: list[Any], p: dict[str, Any], index: int) -> Any:
    import torch

    names, units, _ = _parts(p)
    groups, unit = int(p["groups"]), int(p["unit"])
    outputs = list(p["outputs"])
    pieces = []
    rest: tuple[int, ...] = ()
    for name, u in zip(names, units, strict=True):
        v = values[outputs.index(name)]
        if name in p.get("rope", ()):
            v = rope_permute(v, p["head_dim"], p["rotary_dim"], to_cs=False)
        rest = tuple(v.shape[1:])
        if v.shape[0] != groups * u * unit:
            raise ConversionError(
                f"part {name!r} has {v.shape[0]} rows, the config implies {groups * u * unit}",
                hint="check num_heads / num_kv_groups / hidden_size in the model config",
            )
        pieces.append(v.reshape(groups, u * unit, *rest))
    fused = torch.cat(pieces, dim=1).reshape(-1, *rest)
    if p.get("transpose") and fused.dim() == 2:
        fused = fused.t()
    return fused.contiguous()


_register(
    TransformDef(
        "fused",
        _fused_split,
        _fused_merge,
        peak_factor=2.0,
        doc="fused projection split into parts on import, merged on export (params: groups, unit, parts, "
        "outputs, transpose, rope, head_dim, rotary_dim)",
        literal=("outputs", "rope"),
    )
)


# --- mixture of experts ----------------------------------------------------------------------


def _stack_experts(values: list[Any], p: dict[str, Any], index: int) -> Any:
    import torch

    return torch.stack(list(values), dim=1).contiguous()


def _unstack_expert(values: list[Any], p: dict[str, Any], index: int) -> Any:
    return values[0][:, index].contiguous()


_register(
    TransformDef(
        "stack_experts",
        _stack_experts,
        _unstack_expert,
        doc="per-expert [out, in] weights stacked on dim 1 into [out, E, in] (Cerebras fused experts)",
    )
)


# --- generators: buffers one side keeps and the other regenerates ------------------------------


def _device(values: list[Any]) -> Any:
    return values[0].device if values else "cpu"


def _causal_mask(values: list[Any], p: dict[str, Any], index: int) -> Any:
    import torch

    n = int(p["size"])
    return torch.tril(torch.ones(n, n, dtype=torch.uint8, device=_device(values))).view(1, 1, n, n)


def _scalar(values: list[Any], p: dict[str, Any], index: int) -> Any:
    import torch

    return torch.tensor(float(p["value"]), dtype=getattr(torch, p.get("dtype", "float32")), device=_device(values))


def _inv_freq(values: list[Any], p: dict[str, Any], index: int) -> Any:
    import torch

    r = int(p["rotary_dim"])
    base = float(p.get("base", 10000))
    exps = torch.arange(0, r, 2, dtype=torch.int64, device=_device(values)).float() / r
    return 1.0 / (base**exps)


def alibi_slopes(n: int, *, bias_max: float = 8.0, style: str = "bloom") -> list[float]:
    """ALiBi slopes for ``n`` heads, in double precision.

    For a power of two, slope_i = 2^(-bias_max (i+1) / n) (with bias_max 8: start^(i+1), start =
    2^(-8/n)). Otherwise:

    - ``bloom``: the slopes of the nearest lower power of two p, then every other slope of 2p for the
      remaining n - p heads (BLOOM's rule; the Model Zoo importer crashes on such n);
    - ``mpt``: the slopes of the next power of two q, odd positions first, then even ones, cut to n.
    """

    def power_of_two(m: int) -> list[float]:
        return [2.0 ** (-bias_max * (i + 1) / m) for i in range(m)]

    if n <= 0:
        raise ConversionError(f"ALiBi needs a positive head count, got {n}")
    if n & (n - 1) == 0:
        return power_of_two(n)
    if style == "mpt":
        q = 2 ** math.ceil(math.log2(n))
        slopes = power_of_two(q)
        return (slopes[1::2] + slopes[0::2])[:n]
    p = 2 ** math.floor(math.log2(n))
    return power_of_two(p) + power_of_two(2 * p)[0::2][: n - p]


def _alibi(values: list[Any], p: dict[str, Any], index: int) -> Any:
    import torch

    slopes = alibi_slopes(int(p["heads"]), bias_max=float(p.get("bias_max", 8)), style=str(p.get("style", "bloom")))
    return torch.tensor(slopes, dtype=torch.float64, device=_device(values)).to(torch.float32).view(-1, 1)


def _position_ids(values: list[Any], p: dict[str, Any], index: int) -> Any:
    import torch

    return torch.arange(int(p["size"]), dtype=torch.int64, device=_device(values)).unsqueeze(0)


def _zeros(values: list[Any], p: dict[str, Any], index: int) -> Any:
    import torch

    dtype = getattr(torch, p["dtype"]) if "dtype" in p else values[0].dtype
    return torch.zeros([int(s) for s in p["shape"]], dtype=dtype, device=_device(values))


def _lm_head(values: list[Any], p: dict[str, Any], index: int) -> Any:
    """A headless model's LM head: the word embeddings when tied, else N(0, 0.02) from a fixed seed."""
    import torch

    emb = values[0]
    if p.get("tie"):
        return emb.clone()
    if emb.device.type == "meta":
        return torch.empty(emb.shape, dtype=emb.dtype, device="meta")
    g = torch.Generator().manual_seed(int(p.get("seed", 0)))
    return (torch.randn(tuple(emb.shape), generator=g, dtype=torch.float32) * 0.02).to(emb.dtype)


def _random_init(values: list[Any], p: dict[str, Any], index: int) -> Any:
    """A fresh layer's weights, as the Model Zoo initializes a layer the other side does not have.

    ``dist: normal`` draws N(0, ``scale``); ``dist: uniform`` draws U(-``scale``, ``scale``). The
    generator is seeded (``seed``, default 0) so a conversion is reproducible. float32 unless
    ``dtype`` is given.
    """
    import torch

    shape = tuple(int(s) for s in p["shape"])
    dtype = getattr(torch, p.get("dtype", "float32"))
    if values and values[0].device.type == "meta":  # planning: shape and dtype only
        return torch.empty(shape, dtype=dtype, device="meta")
    g = torch.Generator().manual_seed(int(p.get("seed", 0)))
    scale = float(p["scale"])
    if p.get("dist", "normal") == "uniform":
        out = torch.rand(shape, generator=g, dtype=torch.float64) * (2 * scale) - scale
    else:
        out = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    return out.to(dtype)


_same(_causal_mask, "causal_mask", "lower-triangular uint8 ones [1, 1, size, size]", generator=True)
_same(_scalar, "scalar", "a 0-d tensor holding `value` (dtype `dtype`, default float32)", generator=True)
_same(_inv_freq, "inv_freq", "rotary inverse frequencies, float32 [rotary_dim / 2]", generator=True)
_register(
    TransformDef(
        "alibi_slopes",
        _alibi,
        _alibi,
        generator=True,
        doc="ALiBi slopes float32 [heads, 1] (params heads, bias_max 8, style bloom|mpt)",
        literal=("style",),
    )
)
_same(_position_ids, "position_ids", "int64 [1, size] holding 0 .. size-1", generator=True)
_same(_zeros, "zeros", "zeros of `shape` (dtype of the anchor unless `dtype` is given)", generator=True)
_register(
    TransformDef(
        "random_init",
        _random_init,
        _random_init,
        generator=True,
        doc="a new layer's weights: N(0, scale) or U(-scale, scale) (`dist`) of `shape`, seeded, float32",
        literal=("dist", "dtype"),
    )
)
_same(_lm_head, "lm_head", "a headless model's LM head: copy of the anchor if `tie`, else N(0, 0.02)", peak=1.0)


# --- folding ---------------------------------------------------------------------------------


def lora_fold(w: Any, a: Any, b: Any, scale: float, *, fan_in_fan_out: bool = False, embedding: bool = False) -> Any:
    """``W + (B @ A) * scale``; Embedding adapters add the transpose (W is [num, dim], B @ A is [dim, num]).

    In float32, in place on the update and on one copy of W: at most two float32 arrays of W's
    shape at once (``LORA_FOLD_BYTES_PER_ELEMENT``), not four."""
    import torch

    delta = b.float() @ a.float()
    if embedding or fan_in_fan_out:
        delta = delta.t()
    if tuple(delta.shape) != tuple(w.shape):
        raise ConversionError(
            f"LoRA update of shape {list(delta.shape)} does not fit the weight {list(w.shape)}",
            hint="check lora_params (fan_in_fan_out, r) against the checkpoint",
        )
    out = w.to(torch.float32, copy=True)
    out.add_(delta.mul_(float(scale)))
    del delta
    return out.to(w.dtype)


# What lora_fold holds besides its inputs, per element of W: the update and W's copy, in float32.
LORA_FOLD_BYTES_PER_ELEMENT = 8
