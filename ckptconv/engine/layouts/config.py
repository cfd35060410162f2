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
  of small functions in :mod:`~ckptconv.engine.layouts.hooks` (several families) or in
  ``families/<family>.py`` beside the one table that uses it.

The exact key sets written by each direction follow the Model Zoo converters (reference §4) so a
converted config is what Model Zoo users expect, except where noted in the family tables.
Config conversion never imports torch.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ckptconv.core.errors import ConfigConversionError
from ckptconv.core.releases import release_key
from ckptconv.engine.layouts import families  # noqa: F401  (registers the hooks beside the family tables)
from ckptconv.engine.layouts.config_table import ConfigTable, Field
from ckptconv.engine.layouts.dictpath import MISSING, fill_defaults, get_path, set_path
from ckptconv.engine.layouts.hooks import HOOKS, Ctx, Hook, fail
from ckptconv.engine.layouts.rules import TableError

# --- the table -------------------------------------------------------------------------------


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
) -> tuple[dict[str, Any], list[str], list[str]]:
    """CS ``model`` section -> HF config dict (keys in rule order).

    Returns (hf, warnings, ignored CS keys). ``top`` is the rest of the CS run YAML, for the few
    hooks that read outside ``model``."""
    ctx = Ctx(table, release, registry_name, variant, top=dict(top or {}))
    src = _ReadRecorder(fill_defaults(dict(cs_model), table.cs_defaults))
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
    ignored = [k for k in cs_model if k not in src.read and k not in _CS_ALWAYS_IGNORED]
    return hf, ctx.warnings, ignored


# The registry name a 2.3+ model section carries; the target family already says it.
_CS_ALWAYS_IGNORED = {"name"}


class _ReadRecorder(dict):
    """A config section that remembers which top-level keys the rules and hooks looked at.

    The export side has no list of the keys each hook reads (the import side declares them), so
    the keys nobody looked at are what no rule maps: the Model Zoo logs them as "Key not matched"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self.read.add(key)
        return super().pop(key, *default)


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
