"""Config hooks: the few config conversions a family table cannot say as data.

A table names its hooks (``hooks: [gqa, rope_scaling]``); each is a pair of small functions,
``to_cs(hf, cs, ctx)`` and ``to_hf(cs, hf, ctx)``, registered with :func:`hook`. The hooks here serve
several families; a hook of one family only sits beside that family's table, in
``families/<family>.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.errors import ConfigConversionError
from ckptconv.engine.layouts.config_table import ConfigTable
from ckptconv.engine.layouts.dictpath import MISSING, get_path

# --- conversion context and hooks --------------------------------------------------------------


@dataclass
class Ctx:
    """What a hook may read besides the two configs."""

    table: ConfigTable
    release: str  # the Cerebras release of the CS side, e.g. "2.9"
    registry_name: str  # the Model Zoo name written as ``name:``
    variant: Mapping[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # Sections of the CS run YAML outside ``model`` (BTLM keeps its muP width in
    # ``optimizer.adjust_learning_rate.decoder_kernel``): read on export, written on import.
    top: dict[str, Any] = field(default_factory=dict)

    def param(self, name: str, default: Any = None) -> Any:
        return self.table.params.get(name, default)


Hook = Callable[[dict[str, Any], dict[str, Any], Ctx], None]


@dataclass(frozen=True)
class HookDef:
    to_cs: Hook  # (hf, cs, ctx): read hf, write cs
    to_hf: Hook  # (cs, hf, ctx): read cs, write hf
    reads: tuple[str, ...] = ()  # HF keys the import side reads (not reported as ignored)


HOOKS: dict[str, HookDef] = {}


def hook(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        HOOKS[name] = HookDef(cls.to_cs, cls.to_hf, tuple(getattr(cls, "reads", ())))  # type: ignore[attr-defined]
        return cls

    return deco


def fail(msg: str, **details: Any) -> ConfigConversionError:
    return ConfigConversionError(msg, **details)


def require(d: Mapping[str, Any], key: str, side: str) -> Any:
    v = get_path(d, key)
    if v is MISSING:
        raise fail(f"the {side} config needs `{key}`", key=key)
    return v


# --- hooks several families use ---------------------------------------------------------------


@hook("gqa")
class _Gqa:
    """num_key_value_heads <-> attention_module + extra_attention_params.num_kv_groups."""

    reads = ("num_key_value_heads", "num_attention_heads")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        heads = require(hf, "num_attention_heads", "Hugging Face")
        kv = hf.get("num_key_value_heads") or heads
        if kv == heads:
            cs["attention_module"] = "aiayn_attention"
            return
        if heads % kv:
            raise fail(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        cs["attention_module"] = "multiquery_attention"
        cs["extra_attention_params"] = {"num_kv_groups": kv}

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        heads = require(cs, "num_heads", "Cerebras")
        if cs.get("attention_module", "aiayn_attention") == "multiquery_attention":
            hf["num_key_value_heads"] = get_path(cs, "extra_attention_params.num_kv_groups", 1)
        else:
            hf["num_key_value_heads"] = heads


_ROPE_TYPES = ("linear", "yarn", "llama3", "longrope")


@hook("rope_scaling")
class _RopeScaling:
    """rope_scaling <-> pos_scaling_factor (+ pos_scaling_type, pos_scaling_extra_args)."""

    reads = ("rope_scaling",)

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        rs = hf.get("rope_scaling")
        if not rs:
            cs["pos_scaling_factor"] = 1.0
            return
        kind = rs.get("rope_type", rs.get("type"))
        allowed = ctx.param("rope_types", list(_ROPE_TYPES))
        if kind not in allowed:
            raise fail(f"Can't convert config with rope_scaling type {kind!r}. Only {', '.join(allowed)} is supported.")
        cs["pos_scaling_factor"] = float(rs.get("factor", 1.0))
        cs["pos_scaling_type"] = kind
        if kind == "yarn":
            extra = {k: rs[k] for k in ("original_max_position_embeddings",) if k in rs}
        elif kind == "llama3":
            extra = {k: v for k, v in rs.items() if k not in ("rope_type", "type", "factor")}
        elif kind == "longrope":
            extra = {k: v for k, v in rs.items() if k not in ("type", "rope_type", "factor")}
        else:
            extra = {}
        if extra:
            cs["pos_scaling_extra_args"] = extra

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        factor = cs.get("pos_scaling_factor", 1.0)
        if factor in (None, 1.0, 1):
            hf["rope_scaling"] = None
            return
        kind = cs.get("pos_scaling_type") or "linear"
        key = "rope_type" if kind == "llama3" else "type"
        hf["rope_scaling"] = {key: kind, "factor": factor, **(cs.get("pos_scaling_extra_args") or {})}


@hook("rotary_dim_full")
class _RotaryFull:
    """Full rotary: import sets rotary_dim = head dim; export requires exactly that."""

    reads = ("head_dim",)

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        derived = int(hf["hidden_size"] // hf[ctx.param("heads_key", "num_attention_heads")])
        head_dim = hf.get("head_dim")
        if head_dim is not None and int(head_dim) != derived:
            # The Model Zoo drops head_dim silently; the CS model would then have the wrong shapes.
            raise fail(
                f"Can't convert config with head_dim={head_dim}. Only hidden_size / num_attention_heads "
                f"({derived}) is supported for this model.",
                key="head_dim",
            )
        cs["rotary_dim"] = derived

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        want = _head_dim(cs)
        have = cs.get("rotary_dim")
        if have is None:
            raise fail("the Cerebras config needs `rotary_dim` (= hidden_size / num_heads)", key="rotary_dim")
        if int(have) != want:
            raise fail(f"Can't convert config with rotary_dim={have}. Only {want} (the head size) is supported.")


def _head_dim(cs: Mapping[str, Any]) -> int:
    inner = cs.get("attention_inner_dim")
    heads = int(require(cs, "num_heads", "Cerebras"))
    return int((inner or cs["hidden_size"]) // heads)


@hook("attention_scale")
class _AttnScale:
    """scale_attn_weights true/false <-> attention_type scaled_dot_product/dot_product."""

    reads = ("scale_attn_weights",)

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        cs["attention_type"] = "scaled_dot_product" if hf.get("scale_attn_weights", True) else "dot_product"

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        kind = cs.get("attention_type", "scaled_dot_product")
        if kind not in ("scaled_dot_product", "dot_product"):
            raise fail(f"Can't convert config with attention_type={kind!r}. Only scaled_dot_product, dot_product.")
        hf["scale_attn_weights"] = kind == "scaled_dot_product"


@hook("multi_query")
class _MultiQuery:
    """StarCoder multi_query (HF default true) <-> attention_module (+ num_kv_groups 1)."""

    reads = ("multi_query",)

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        if hf.get("multi_query", True):
            cs["attention_module"] = "multiquery_attention"
            cs["extra_attention_params"] = {"num_kv_groups": 1}
        else:
            cs["attention_module"] = "aiayn_attention"

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        module = cs.get("attention_module", "aiayn_attention")
        if module == "multiquery_attention":
            groups = get_path(cs, "extra_attention_params.num_kv_groups", 1)
            if groups != 1:
                raise fail(f"Can't convert config with num_kv_groups={groups}. Only 1 (multi-query) is supported.")
            hf["multi_query"] = True
        else:
            hf["multi_query"] = False


@hook("alibi_scaling")
class _AlibiScaling:
    """BTLM/JAIS alibi_scaling <-> pos_scaling_factor (linear only)."""

    reads = ("alibi_scaling",)

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        s = hf.get("alibi_scaling")
        if not s:
            return
        if "train_seq_len" in s:
            raise fail("Can't convert config with alibi_scaling.train_seq_len. Only a linear factor is supported.")
        if s.get("type", "linear") != "linear":
            raise fail(f"Can't convert config with alibi_scaling type {s.get('type')!r}. Only linear.")
        cs["pos_scaling_factor"] = float(s["factor"])

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        f = cs.get("pos_scaling_factor")
        if f not in (None, 1, 1.0):
            hf["alibi_scaling"] = {"type": "linear", "factor": f}


@hook("classifier")
class _Classifier:
    """Fine-tuning heads: num_labels and problem types of sequence / token / QA classifiers."""

    reads = ("num_labels", "id2label", "label2id", "problem_type")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        head = ctx.variant.get("head")
        labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
        if head == "sequence":
            cs["num_labels"] = labels
            if hf.get("problem_type") is not None:
                cs["problem_type"] = hf["problem_type"]
            elif labels != 1:
                cs["problem_type"] = "single_label_classification"
        elif head == "token":
            cs["num_classes"] = labels
            cs["loss_weight"] = 1.0
            cs["include_padding_in_loss"] = False
        elif head == "qa" and labels != 2:
            raise fail(f"Can't convert a question-answering config with num_labels={labels}. Only 2.")

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        head = ctx.variant.get("head")
        if head == "sequence":
            hf["num_labels"] = cs.get("num_labels", 2)
            if cs.get("problem_type") is not None:
                hf["problem_type"] = cs["problem_type"]
        elif head == "token":
            hf["num_labels"] = cs.get("num_classes", 2)
        elif head == "qa":
            hf["num_labels"] = 2


@hook("square_image")
class _SquareImage:
    """ViT sizes: one HF integer (square images and patches) <-> a CS ``[height, width]`` pair."""

    reads = ("image_size", "patch_size")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        for key in ("image_size", "patch_size"):
            v = require(hf, key, "Hugging Face")
            cs[key] = list(v) if isinstance(v, list | tuple) else [int(v), int(v)]

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        for key in ("image_size", "patch_size"):
            v = require(cs, key, "Cerebras")
            if isinstance(v, int):
                hf[key] = v
                continue
            if len(v) != 2 or v[0] != v[1]:
                raise fail(f"Can't convert config with {key}={v!r}. Image width and height need to match.", key=key)
            hf[key] = int(v[0])


@hook("gpt2_filter_size")
class _Gpt2Filter:
    """n_inner (null means 4 x n_embd) <-> filter_size; export always writes n_inner explicitly."""

    reads = ("n_inner", "n_embd")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        n_inner = hf.get("n_inner")
        cs["filter_size"] = int(n_inner) if n_inner is not None else 4 * int(hf["n_embd"])

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        if "filter_size" in cs:
            hf["n_inner"] = cs["filter_size"]


@hook("gpt2_dropouts")
class _Gpt2Dropouts:
    """Absent embedding / attention dropouts default to dropout_rate on export."""

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        return None

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        if "dropout_rate" in cs:
            hf.setdefault("embd_pdrop", cs["dropout_rate"])
            hf.setdefault("attn_pdrop", cs["dropout_rate"])


@hook("gptj_rotary_flag")
class _GptjRotary:
    """CS position_embedding_type (if stated) must be rotary; GPT-J exports it as HF `rotary: true`."""

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        return None

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        pe = cs.get("position_embedding_type")
        if pe is None:
            return
        if pe != "rotary":
            raise fail(f"Can't convert config with position_embedding_type={pe!r}. Only 'rotary' is supported.")
        if ctx.param("export_rotary_flag", True):
            hf["rotary"] = True
