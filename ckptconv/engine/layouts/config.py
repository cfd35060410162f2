"""Model config conversion between Hugging Face ``config.json`` and the Cerebras ``model:`` section.

A family table's ``config:`` section is data:

- ``hf_defaults`` / ``cs_defaults``: filled into absent keys of the source before anything else
  (the source framework's defaults; a dict value fills absent sub-keys);
- ``fields``: renamed or same-name keys, with an optional value ``map`` (inverted on export) and a
  ``direction``; dotted CS names (``moe.num_experts``) address nested dicts;
- ``hf_asserts``: values the Hugging Face config must have (a list = allowed values);
- ``cs_consts``: values the Cerebras config must have when it states them (checked on export);
  ``import_consts`` names those also written on import (``all`` for every one);
- ``import_sets`` / ``export_sets``: fixed keys written on import / export;
- ``hooks``: names of the few conversions a table cannot say (GQA, rope scaling, ...), each a pair
  of small functions in :data:`HOOKS`.

The exact key sets written by each direction follow the Model Zoo converters (reference §4) so a
converted config is what Model Zoo users expect, except where noted in the family tables.
Config conversion never imports torch.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.errors import ConfigConversionError
from ckptconv.core.releases import release_key
from ckptconv.engine.layouts.rules import TableError

MISSING = object()


# --- nested access -----------------------------------------------------------------------------


def get_path(d: Mapping[str, Any], path: str, default: Any = MISSING) -> Any:
    cur: Any = d
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return default
        cur = cur[part]
    return cur


def set_path(d: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    cur = d
    for part in parts[:-1]:
        nxt = cur.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[part] = nxt
        cur = nxt
    cur[parts[-1]] = value


def has_path(d: Mapping[str, Any], path: str) -> bool:
    return get_path(d, path) is not MISSING


def fill_defaults(cfg: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Absent keys take the default; a dict default fills absent sub-keys of a present dict."""
    out = dict(cfg)
    for k, v in defaults.items():
        if k not in out:
            out[k] = copy.deepcopy(v)
        elif isinstance(v, Mapping) and isinstance(out[k], Mapping):
            out[k] = fill_defaults(dict(out[k]), v)
    return out


def flat_env(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Config keys as expression names: nested dicts joined with ``__`` (``moe__num_experts``)."""
    env: dict[str, Any] = {}
    for k, v in cfg.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            env.update(flat_env(v, f"{name}__"))
        if name.isidentifier():
            env[name] = v
    return env


# --- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    hf: str
    cs: str
    map: Mapping[Any, Any] | None = None
    direction: str = "both"
    passthrough: bool = False  # values outside ``map`` are copied verbatim instead of refused
    also: Mapping[Any, Any] | None = None  # extra HF values accepted on import (not produced on export)

    def to_cs(self, value: Any) -> Any:
        if self.map is None or value is None:
            return value
        if value in self.map:
            return self.map[value]
        if self.also and value in self.also:
            return self.also[value]
        if self.passthrough:
            return value
        raise ConfigConversionError(
            f"Can't convert config with {self.hf}={value!r}. Only {', '.join(map(repr, self.map))} is supported.",
            key=self.hf,
        )

    def to_hf(self, value: Any) -> Any:
        if self.map is None or value is None:
            return value
        inverse = {v: k for k, v in self.map.items()}
        if value in inverse:
            return inverse[value]
        if self.passthrough:
            return value
        raise ConfigConversionError(
            f"Can't convert config with {self.cs}={value!r}. Only {', '.join(map(repr, inverse))} is supported.",
            key=self.cs,
        )


@dataclass(frozen=True)
class ConfigTable:
    fields: tuple[Field, ...]
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    cs_defaults: Mapping[str, Any] = field(default_factory=dict)
    hf_asserts: Mapping[str, Any] = field(default_factory=dict)
    cs_consts: Mapping[str, Any] = field(default_factory=dict)
    import_consts: tuple[str, ...] = ()
    import_sets: Mapping[str, Any] = field(default_factory=dict)
    export_sets: Mapping[str, Any] = field(default_factory=dict)
    hooks: tuple[str, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)  # hook parameters


def parse_config_table(raw: Mapping[str, Any], where: str) -> ConfigTable:
    allowed = {
        "fields",
        "hf_defaults",
        "cs_defaults",
        "hf_asserts",
        "cs_consts",
        "import_consts",
        "import_sets",
        "export_sets",
        "hooks",
        "params",
    }
    extra = set(raw) - allowed
    if extra:
        raise TableError(f"{where}: unknown config sections {sorted(extra)}")
    fields = []
    for i, f in enumerate(raw.get("fields") or []):
        if isinstance(f, str):
            fields.append(Field(f, f))
            continue
        if not isinstance(f, Mapping) or "hf" not in f:
            raise TableError(f"{where}.fields[{i}]: a field is a name or a mapping with `hf`")
        unknown = set(f) - {"hf", "cs", "map", "direction", "passthrough", "also"}
        if unknown:
            raise TableError(f"{where}.fields[{i}]: unknown keys {sorted(unknown)}")
        if f.get("direction", "both") not in ("both", "import", "export"):
            raise TableError(f"{where}.fields[{i}]: direction must be both, import or export")
        fields.append(
            Field(
                f["hf"],
                f.get("cs", f["hf"]),
                f.get("map"),
                f.get("direction", "both"),
                bool(f.get("passthrough")),
                f.get("also"),
            )
        )
    consts = dict(raw.get("cs_consts") or {})
    ic = raw.get("import_consts") or ()
    if ic == "all":
        ic = tuple(consts)
    ic = tuple(ic)
    if set(ic) - set(consts):
        raise TableError(f"{where}: import_consts names keys that are not cs_consts: {sorted(set(ic) - set(consts))}")
    hooks = tuple(raw.get("hooks") or ())
    unknown_hooks = [h for h in hooks if h not in HOOKS]
    if unknown_hooks:
        raise TableError(f"{where}: unknown config hooks {unknown_hooks} (known: {sorted(HOOKS)})")
    return ConfigTable(
        fields=tuple(fields),
        hf_defaults=dict(raw.get("hf_defaults") or {}),
        cs_defaults=dict(raw.get("cs_defaults") or {}),
        hf_asserts=dict(raw.get("hf_asserts") or {}),
        cs_consts=consts,
        import_consts=ic,
        import_sets=dict(raw.get("import_sets") or {}),
        export_sets=dict(raw.get("export_sets") or {}),
        hooks=hooks,
        params=dict(raw.get("params") or {}),
    )


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


def _require(d: Mapping[str, Any], key: str, side: str) -> Any:
    v = get_path(d, key)
    if v is MISSING:
        raise fail(f"the {side} config needs `{key}`", key=key)
    return v


# --- generic conversion ------------------------------------------------------------------------


def normalize_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Accept configs written by transformers 4.x and 5.x alike.

    transformers 5 moved ``rope_theta`` / ``rope_scaling`` (and GPT-NeoX ``rotary_pct`` /
    ``rotary_emb_base``) into ``rope_parameters``; the Model Zoo vocabulary is the 4.x one.
    """
    out = dict(hf)
    rp = out.pop("rope_parameters", None)
    if isinstance(rp, Mapping):
        rp = dict(rp)
        if "rope_theta" in rp and "rope_theta" not in out:
            out["rope_theta"] = rp.pop("rope_theta")
        else:
            rp.pop("rope_theta", None)
        if "partial_rotary_factor" in rp:
            out.setdefault("partial_rotary_factor", rp.pop("partial_rotary_factor"))
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind not in (None, "default") and "rope_scaling" not in out:
            out["rope_scaling"] = rp
        elif "rope_scaling" not in out:
            out["rope_scaling"] = None
    return out


def _check_asserts(cfg: Mapping[str, Any], asserts: Mapping[str, Any], side: str) -> None:
    for key, want in asserts.items():
        have = get_path(cfg, key)
        if have is MISSING:
            continue
        ok = have in want if isinstance(want, list) else have == want
        if not ok:
            allowed = ", ".join(map(repr, want)) if isinstance(want, list) else repr(want)
            raise fail(
                f"Can't convert config with {key}={have!r}. Only {allowed} is supported.",
                key=key,
                side=side,
            )


def import_config(
    table: ConfigTable, hf: Mapping[str, Any], *, release: str, registry_name: str, variant: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str], list[str], dict[str, Any]]:
    """HF config -> CS ``model`` section.

    Returns (cs model, warnings, ignored HF keys, other CS top-level sections to write)."""
    ctx = Ctx(table, release, registry_name, variant)
    src = fill_defaults(normalize_hf(hf), table.hf_defaults)
    _check_asserts(src, table.hf_asserts, "Hugging Face")
    cs: dict[str, Any] = {}
    used = set(table.hf_asserts)
    for f in table.fields:
        v = get_path(src, f.hf)
        if f.direction == "export" or v is MISSING:
            continue
        set_path(cs, f.cs, f.to_cs(v))
        used.add(f.hf.split(".")[0])
    for name in table.hooks:
        _run_hook(HOOKS[name].to_cs, src, cs, ctx, "Hugging Face")
        used.update(HOOKS[name].reads)
    for k in table.import_consts:
        set_path(cs, k, copy.deepcopy(table.cs_consts[k]))
    for k, v in table.import_sets.items():
        set_path(cs, k, copy.deepcopy(v))
    if release_key(release) > (2, 3) and "name" not in cs:
        cs["name"] = registry_name
    if "use_bfloat16" in src and (2, 1) <= release_key(release) <= (2, 3):
        cs["fp16_type"] = "bfloat16" if src["use_bfloat16"] else "float16"
    if "rope_parameters" in hf:
        used.update(("rope_parameters", *[k for k in ("rope_theta", "rope_scaling") if k in used]))
        if "rope_theta" in used or "rope_scaling" in used or "partial_rotary_factor" in used:
            used.add("rope_parameters")
    ignored = [k for k in hf if k not in used and k not in _HF_ALWAYS_IGNORED]
    return cs, ctx.warnings, ignored, ctx.top


# Keys every HF config carries that no conversion reads; not worth reporting as ignored.
_HF_ALWAYS_IGNORED = {"architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path"}


def export_config(
    table: ConfigTable,
    cs_model: Mapping[str, Any],
    *,
    release: str,
    registry_name: str,
    variant: Mapping[str, Any],
    top: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """CS ``model`` section -> HF config dict (keys in rule order). Returns (hf, warnings).

    ``top`` is the rest of the CS run YAML, for the few hooks that read outside ``model``."""
    ctx = Ctx(table, release, registry_name, variant, top=dict(top or {}))
    src = fill_defaults(dict(cs_model), table.cs_defaults)
    for key, want in table.cs_consts.items():
        have = get_path(src, key)
        if have is MISSING:
            continue
        if want is None and have is None:
            continue
        ok = have in want if isinstance(want, list) else have == want
        if not ok:
            allowed = ", ".join(map(repr, want)) if isinstance(want, list) else repr(want)
            raise fail(f"Can't convert config with {key}={have!r}. Only {allowed} is supported.", key=key)
    hf: dict[str, Any] = {}
    for f in table.fields:
        if f.direction == "import":
            continue
        v = get_path(src, f.cs)
        if v is MISSING:
            continue
        set_path(hf, f.hf, f.to_hf(v))
    for name in table.hooks:
        _run_hook(HOOKS[name].to_hf, src, hf, ctx, "Cerebras")
    for k, v in table.export_sets.items():
        hf[k] = copy.deepcopy(v)
    fp16 = src.get("fp16_type")
    if fp16 is not None and "use_bfloat16" not in hf:
        if fp16 in ("bfloat16", "cbfloat16"):
            hf["use_bfloat16"] = True
        elif fp16 == "float16":
            hf["use_bfloat16"] = False
        else:
            raise fail(
                f"Can't convert config with fp16_type={fp16!r}. Only bfloat16, cbfloat16, float16 are supported."
            )
    return hf, ctx.warnings


def _run_hook(fn: Hook, src: dict[str, Any], out: dict[str, Any], ctx: Ctx, side: str) -> None:
    try:
        fn(src, out, ctx)
    except KeyError as e:
        key = e.args[0] if e.args else "?"
        raise ConfigConversionError(
            f"the {side} config has no `{key}`, which this model needs",
            key=key,
            hint="check --model and that the config belongs to this checkpoint",
        ) from None


# --- hooks: the odd ones out ------------------------------------------------------------------


@hook("gqa")
class _Gqa:
    """num_key_value_heads <-> attention_module + extra_attention_params.num_kv_groups."""

    reads = ("num_key_value_heads", "num_attention_heads")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        heads = _require(hf, "num_attention_heads", "Hugging Face")
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
        heads = _require(cs, "num_heads", "Cerebras")
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
    heads = int(_require(cs, "num_heads", "Cerebras"))
    return int((inner or cs["hidden_size"]) // heads)


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


@hook("neox_rotary")
class _NeoxRotary:
    """rotary_pct <-> rotary_dim = int(head_dim x pct); rotary_emb_base must be 10000."""

    reads = ("rotary_pct", "partial_rotary_factor", "rotary_emb_base", "rope_theta")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        pct = hf.get("rotary_pct", hf.get("partial_rotary_factor", 0.25))
        base = hf.get("rotary_emb_base", hf.get("rope_theta", 10000))
        if float(base) != 10000.0:
            raise fail(f"Can't convert config with rotary_emb_base={base}. Only 10000 is supported.")
        cs["rotary_dim"] = int((hf["hidden_size"] // hf["num_attention_heads"]) * pct)

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        head = cs["hidden_size"] // cs["num_heads"]
        hf["rotary_pct"] = cs.get("rotary_dim", head) / head
        hf["rotary_emb_base"] = 10000


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


@hook("codegen_heads")
class _CodegenHeads:
    """CodeGen's fused qkv is split in mp_num = 4 shards: fewer than 4 heads cannot be converted."""

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        if int(hf.get("n_head", 16)) < 4:
            raise fail(f"Can't convert CodeGen with n_head={hf.get('n_head')}; at least 4 heads are needed (mp_num=4)")

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        if int(cs.get("num_heads", 16)) < 4:
            raise fail(f"Can't convert CodeGen with num_heads={cs.get('num_heads')}; at least 4 heads are needed")


@hook("falcon")
class _Falcon:
    """Falcon's attention layout flags (reference §4.4), modern and legacy HF configs."""

    reads = (
        "alibi",
        "bias",
        "new_decoder_architecture",
        "parallel_attn",
        "multi_query",
        "num_kv_heads",
        "num_ln_in_parallel_attn",
        "n_head",
        "n_layer",
        "n_head_kv",
        "model_type",
    )

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        legacy = hf.get("model_type") in ("RefinedWebModel", "RefinedWeb") or "n_head" in hf
        heads = hf.get("num_attention_heads", hf.get("n_head"))
        if legacy:
            cs["num_heads"] = heads
            if "n_layer" in hf:
                cs["num_hidden_layers"] = hf["n_layer"]
        if hf.get("alibi"):
            raise fail("Can't convert config with alibi=True. Only rotary Falcon models are supported.")
        if legacy and hf.get("bias"):
            raise fail("Can't convert legacy Falcon config with bias=True.")
        bias = bool(hf.get("bias", False))
        new = bool(hf.get("new_decoder_architecture", False))
        parallel = bool(hf.get("parallel_attn", True))
        if legacy and "n_head_kv" in hf:  # RefinedWeb (40B)
            new, kv = True, hf["n_head_kv"]
            if not parallel:
                raise fail("Can't convert RefinedWeb config with parallel_attn=False.")
            untied = True
        elif legacy:  # RefinedWebModel (7B)
            if not hf.get("multi_query", True):
                raise fail("Can't convert RefinedWebModel config with multi_query=False.")
            kv, untied = 1, False
        else:
            if not new and hf.get("multi_query", True):
                kv = 1
            elif not new:
                kv = heads
            else:
                kv = hf.get("num_kv_heads", heads)
            untied = (new and hf.get("num_ln_in_parallel_attn", 2) == 2) or not parallel
        cs["use_projection_bias_in_attention"] = bias
        cs["use_ffn_bias_in_attention"] = bias
        cs["use_ffn_bias"] = bias
        cs["position_embedding_type"] = "rotary"
        cs["rotary_dim"] = int(hf["hidden_size"] // heads)
        cs["use_untied_layer_norm"] = bool(untied)
        cs["attention_module"] = "multiquery_attention"
        cs["extra_attention_params"] = {"num_kv_groups": kv}
        cs["filter_size"] = 4 * int(hf["hidden_size"])

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        heads, hidden = cs["num_heads"], cs["hidden_size"]
        if cs.get("embedding_dropout_rate", 0.0) not in (0, 0.0, None):
            raise fail("Can't convert config with embedding_dropout_rate != 0. Only 0.0 is supported.")
        if cs.get("rotary_dim", hidden // heads) != hidden // heads:
            raise fail(f"Can't convert config with rotary_dim={cs.get('rotary_dim')}. Only {hidden // heads}.")
        if cs.get("filter_size", 4 * hidden) != 4 * hidden:
            raise fail(f"Can't convert config with filter_size={cs.get('filter_size')}. Only {4 * hidden}.")
        flags = {
            cs.get(k, True) for k in ("use_projection_bias_in_attention", "use_ffn_bias_in_attention", "use_ffn_bias")
        }
        if len(flags) != 1:
            raise fail("Falcon needs the three bias flags (attention projections, attention output, FFN) to be equal")
        kv = get_path(cs, "extra_attention_params.num_kv_groups", 1)
        hf["num_kv_heads"] = kv
        hf["alibi"] = False
        # The Model Zoo writes the CS flag names, which transformers ignores (so a biased Falcon
        # would reload without its biases): `bias` is written as well so HF matches the weights.
        for k in ("use_projection_bias_in_attention", "use_ffn_bias_in_attention", "use_ffn_bias"):
            hf[k] = cs.get(k, True)
        hf["bias"] = bool(flags.pop())
        hf["parallel_attn"] = True
        if cs.get("use_untied_layer_norm", False):
            hf["new_decoder_architecture"] = True
            hf["multi_query"] = kv == 1
            hf["num_ln_in_parallel_attn"] = 2
        else:
            hf["new_decoder_architecture"] = False
            if kv == 1:
                hf["multi_query"] = True
            elif kv == heads:
                hf["multi_query"] = False
            else:
                raise fail(f"Falcon with tied layer norms needs num_kv_groups 1 or {heads}, got {kv}")
            hf["num_ln_in_parallel_attn"] = None


@hook("bloom")
class _Bloom:
    """n_embed (legacy) overrides hidden_size; filter_size is 4 x hidden; CS has no max positions."""

    reads = ("n_embed",)

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        if hf.get("n_embed") is not None:
            cs["hidden_size"] = hf["n_embed"]
        cs["filter_size"] = 4 * int(cs["hidden_size"])

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        hidden = cs["hidden_size"]
        if cs.get("filter_size", 4 * hidden) != 4 * hidden:
            raise fail(f"Can't convert config with filter_size={cs.get('filter_size')}. Only {4 * hidden}.")
        inner = cs.get("attention_inner_dim")
        if inner not in (None, hidden):
            raise fail(f"Can't convert config with attention_inner_dim={inner}. Only null or {hidden}.")
        emb_drop = cs.get("embedding_dropout_rate", cs.get("dropout_rate", 0.0))
        if emb_drop not in (0, 0.0, None):
            raise fail("Can't convert config with embedding_dropout_rate != 0. Only 0.0 is supported.")


@hook("mpt")
class _Mpt:
    """MPT: ALiBi only, no biases, expansion_ratio x d_model feed-forward, unscaled logits."""

    reads = (
        "attn_config",
        "no_bias",
        "expansion_ratio",
        "norm_type",
        "logit_scale",
        "learned_pos_emb",
        "embedding_fraction",
    )

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        attn = hf.get("attn_config") or {}
        checks = {
            "attn_config.alibi": (attn.get("alibi", False), True),
            "attn_config.clip_qkv": (attn.get("clip_qkv"), None),
            "attn_config.qk_ln": (attn.get("qk_ln", False), False),
            "attn_config.softmax_scale": (attn.get("softmax_scale"), None),
            "attn_config.prefix_lm": (attn.get("prefix_lm", False), False),
            "no_bias": (hf.get("no_bias", True), True),
            "logit_scale": (hf.get("logit_scale"), None),
            "embedding_fraction": (hf.get("embedding_fraction", 1.0), 1.0),
        }
        for key, (have, want) in checks.items():
            if have != want:
                raise fail(f"Can't convert config with {key}={have!r}. Only {want!r} is supported.", key=key)
        cs["filter_size"] = int(hf.get("expansion_ratio", 4) * hf["d_model"])
        bias_max = attn.get("alibi_bias_max", 8)
        if bias_max != 8:
            raise fail(f"Can't convert config with attn_config.alibi_bias_max={bias_max}. Only 8 is supported.")

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        hidden = int(cs["hidden_size"])
        filt = int(cs.get("filter_size", 4 * hidden))
        if filt % hidden:
            raise fail(f"filter_size={filt} is not a multiple of hidden_size={hidden}; MPT needs an integer ratio")
        hf["expansion_ratio"] = filt // hidden
        attn = hf.setdefault("attn_config", {})
        attn.update({"alibi": True, "alibi_bias_max": 8})
        hf["no_bias"] = True


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


@hook("btlm_mup")
class _BtlmMup:
    """BTLM/JAIS native muP: output_logits_scale = mup_output_alpha x mup_width_scale; the width
    scale lives in the CS run YAML as optimizer.adjust_learning_rate.decoder_kernel."""

    reads = ("mup_output_alpha", "mup_width_scale")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        alpha, width = hf.get("mup_output_alpha"), hf.get("mup_width_scale")
        if alpha is not None and width is not None:
            cs["output_logits_scale"] = alpha * width
        if width is not None:
            ctx.top.setdefault("optimizer", {}).setdefault("adjust_learning_rate", {})["decoder_kernel"] = width

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        scale = cs.get("output_logits_scale")
        width = get_path(ctx.top, "optimizer.adjust_learning_rate.decoder_kernel", None)
        if width is None:
            width = get_path(ctx.top, "trainer.init.optimizer.adjust_learning_rate.decoder_kernel", None)
        if width is not None:
            hf["mup_width_scale"] = width
            if scale is not None:
                hf["mup_output_alpha"] = scale / width
        elif scale is not None:
            hf["mup_output_alpha"] = scale
            hf["mup_width_scale"] = 1.0


@hook("bert")
class _Bert:
    """BERT/RoBERTa heads: pooler and MLM nonlinearities; position embedding type."""

    reads = ("position_embedding_type",)

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        pe = hf.get("position_embedding_type", "absolute")
        if pe != "absolute":
            raise fail(f"Can't convert config with position_embedding_type={pe!r}. Only 'absolute' is supported.")
        cs["position_embedding_type"] = "learned"
        cs["pooler_nonlinearity"] = "tanh"
        cs.setdefault("mlm_nonlinearity", cs.get("encoder_nonlinearity", "gelu"))

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        pe = cs.get("position_embedding_type", "learned")
        if pe != "learned":
            raise fail(f"Can't convert config with position_embedding_type={pe!r}. Only 'learned' is supported.")
        hf["position_embedding_type"] = "absolute"
        enc = cs.get("encoder_nonlinearity", "gelu")
        pooler = cs.get("pooler_nonlinearity")
        if pooler is None and enc != "tanh":
            raise fail("pooler_nonlinearity is absent and encoder_nonlinearity is not tanh: cannot express in HF")
        if pooler not in (None, "tanh"):
            raise fail(f"Can't convert config with pooler_nonlinearity={pooler!r}. Only 'tanh' is supported.")
        mlm = cs.get("mlm_nonlinearity")
        if mlm not in (None, enc) and not ctx.param("mlm_gelu"):
            raise fail(f"Can't convert config with mlm_nonlinearity={mlm!r}. Only the encoder nonlinearity ({enc}).")


@hook("roberta")
class _Roberta:
    """RoBERTa: CS max positions exclude the padding offset; type_vocab_size <-> num_segments."""

    reads = ("pad_token_id", "type_vocab_size", "max_position_embeddings")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        pad = int(hf.get("pad_token_id", 1))
        cs["max_position_embeddings"] = int(hf["max_position_embeddings"]) - pad - 1
        cs["pad_token_id"] = pad
        cs["num_segments"] = hf.get("type_vocab_size", 1)

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        pad = int(cs.get("pad_token_id", 1))
        hf["max_position_embeddings"] = int(cs["max_position_embeddings"]) + pad + 1
        hf["pad_token_id"] = pad
        seg = cs.get("num_segments")
        hf["type_vocab_size"] = seg if seg else 1


@hook("t5")
class _T5:
    """T5: feed_forward_proj <-> encoder/decoder nonlinearity; export checks they agree."""

    reads = ("feed_forward_proj", "relative_attention_max_distance", "scale_decoder_outputs")

    _GATED = {"gated-silu": "swiglu", "gated-relu": "reglu", "gated-gelu": "geglu"}

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        proj = hf.get("feed_forward_proj", "relu")
        act = _T5._GATED.get(proj, proj)
        cs["encoder_nonlinearity"] = act
        cs["decoder_nonlinearity"] = act
        # transformers 5 always ties the T5 head and says with `scale_decoder_outputs` what 4.x said
        # with `tie_word_embeddings` (scale the decoder output by d_model^-0.5, as a shared head needs).
        if "scale_decoder_outputs" in hf:
            cs["share_embedding_weights"] = bool(hf["scale_decoder_outputs"])
        if hf.get("relative_attention_max_distance", 128) != 128:
            raise fail("Can't convert config with relative_attention_max_distance != 128.")

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        enc = cs.get("encoder_nonlinearity", "relu")
        dec = cs.get("decoder_nonlinearity", enc)
        if enc != dec:
            raise fail(f"encoder_nonlinearity={enc!r} and decoder_nonlinearity={dec!r} differ; HF T5 has one")
        inverse = {v: k for k, v in _T5._GATED.items()}
        hf["feed_forward_proj"] = inverse.get(enc, enc)
        tgt = cs.get("tgt_vocab_size")
        if tgt is not None and tgt != cs.get("src_vocab_size"):
            raise fail("tgt_vocab_size differs from src_vocab_size; HF T5 shares one vocabulary")
        relu_drop = cs.get("relu_dropout_rate")
        if relu_drop is not None and relu_drop != cs.get("dropout_rate"):
            raise fail("relu_dropout_rate differs from dropout_rate; HF T5 has one dropout rate")


@hook("gemma2")
class _Gemma2:
    """Gemma 2: attention inner dim, embeddings scale, query pre-attention scalar."""

    reads = ("head_dim", "query_pre_attn_scalar", "attention_bias")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        cs["attention_inner_dim"] = head_dim * heads
        cs["rotary_dim"] = head_dim
        cs["embeddings_scale"] = math.sqrt(hf["hidden_size"])
        q = hf.get("query_pre_attn_scalar", head_dim)
        if q != head_dim:
            cs["attention_logits_alpha"] = math.sqrt(head_dim / q)
        bias = bool(hf.get("attention_bias", False))
        cs["use_projection_bias_in_attention"] = bias
        cs["use_ffn_bias_in_attention"] = bias

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        heads = cs["num_heads"]
        head_dim = int((cs.get("attention_inner_dim") or cs["hidden_size"]) // heads)
        hf["head_dim"] = head_dim
        want = math.sqrt(cs["hidden_size"])
        if not math.isclose(float(cs.get("embeddings_scale", want)), want, rel_tol=1e-6):
            raise fail(f"Can't convert config with embeddings_scale={cs.get('embeddings_scale')}. Only sqrt(hidden).")
        alpha = cs.get("attention_logits_alpha") or 1.0
        hf["query_pre_attn_scalar"] = head_dim / alpha**2
        if float(hf["query_pre_attn_scalar"]).is_integer():
            hf["query_pre_attn_scalar"] = int(hf["query_pre_attn_scalar"])
        if cs.get("rotary_dim", head_dim) != head_dim:
            raise fail(f"Can't convert config with rotary_dim={cs.get('rotary_dim')}. Only {head_dim}.")
        hf["attention_bias"] = bool(cs.get("use_projection_bias_in_attention", False))


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
            v = _require(hf, key, "Hugging Face")
            cs[key] = list(v) if isinstance(v, list | tuple) else [int(v), int(v)]

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        for key in ("image_size", "patch_size"):
            v = _require(cs, key, "Cerebras")
            if isinstance(v, int):
                hf[key] = v
                continue
            if len(v) != 2 or v[0] != v[1]:
                raise fail(f"Can't convert config with {key}={v!r}. Image width and height need to match.", key=key)
            hf[key] = int(v[0])


# --- CS YAML documents ---------------------------------------------------------------------


def cs_model_section(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The model config of a CS YAML: ``trainer.init.model`` (2.3+ layout) or ``model`` (legacy)."""
    if "trainer" in doc:
        trainer = doc["trainer"]
        if isinstance(trainer, list):
            raise ConfigConversionError(
                "the config has a list of trainers; convert one trainer's config at a time",
                hint="split the YAML so it has a single `trainer:` mapping",
            )
        model = get_path(trainer, "init.model")
        if not isinstance(model, Mapping):
            raise ConfigConversionError("the config's trainer has no init.model section")
        return dict(model)
    model = doc.get("model")
    if not isinstance(model, Mapping):
        raise ConfigConversionError(
            "the Cerebras config has no `model:` (or `trainer.init.model:`) section",
            hint="pass the run YAML of the model (params.yaml / the trainer config)",
        )
    return dict(model)


def replace_model_section(doc: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(doc))
    if "trainer" in out and isinstance(out["trainer"], Mapping):
        out["trainer"].setdefault("init", {})["model"] = dict(model)
    else:
        out["model"] = dict(model)
    return out


def sort_nested(d: Any) -> Any:
    if isinstance(d, Mapping):
        return {k: sort_nested(d[k]) for k in sorted(d, key=str)}
    if isinstance(d, list):
        return [sort_nested(v) for v in d]
    return d


def dump_cs_yaml(doc: Mapping[str, Any]) -> bytes:
    """YAML as the Model Zoo writes it: keys sorted at every level, indent 4."""
    import yaml

    return yaml.safe_dump(sort_nested(dict(doc)), indent=4, sort_keys=True, default_flow_style=False).encode()


def dump_hf_json(cfg: Mapping[str, Any]) -> bytes:
    import json

    return (json.dumps(dict(cfg), indent=4) + "\n").encode()
