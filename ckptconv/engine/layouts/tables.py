"""The tables under ``families/``, loaded and validated: one YAML per model family (kind
``family``: key rules and a config mapping) and per model made of other families' models (kind
``composite``: parts, each converted by its family's table; kind ``wrapper``: one family's model
held under prefixes). The fields of each kind are described in :mod:`ckptconv.engine.layouts.registry`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from ckptconv.core.releases import release_range
from ckptconv.engine.layouts.config import parse_config_table
from ckptconv.engine.layouts.expr import ExprError, compile_expr
from ckptconv.engine.layouts.family import COMPOSITE, FAMILY, WRAPPER, Family
from ckptconv.engine.layouts.rules import TableError, parse_rules
from ckptconv.engine.layouts.table_merge import merge_checkpoint, merge_config, resolve_extends
from ckptconv.engine.layouts.transforms import TRANSFORMS

FAMILIES_DIR = os.path.join(os.path.dirname(__file__), "families")


@dataclass(frozen=True)
class Part:
    """One part of a composite model: converted by the table of ``family``."""

    name: str  # its Hugging Face sub-directory, and its section in the Cerebras config
    family: str
    hf_route: str  # Hugging Face keys starting with this belong to the part ("": the rest)
    cs_prefix: str  # the part's keys in the Cerebras checkpoint start with this
    hf_class: str


@dataclass(frozen=True)
class ModelTable:
    """A table of kind composite or wrapper: what the registry lists, and the data its planner
    module (``families/<name>.py``) reads."""

    name: str
    kind: str
    description: str  # its formats, in a line
    cs_class: str  # the Model Zoo class of the whole (the parts keep theirs)
    names: tuple[str, ...]
    formats: tuple[str, ...]
    hf_classes: tuple[str, ...]
    notes: tuple[str, ...]
    key_rules: tuple[str, ...]
    parts: tuple[Part, ...]
    raw: Mapping[str, Any]

    @property
    def first_release(self) -> str:
        """The oldest Cerebras release the model converts to and from."""
        return str(self.raw["releases"]["cs"][0])

    @property
    def components(self) -> list[str]:
        """The Hugging Face sub-directories of a composite model, one per part."""
        return [p.name for p in self.parts]

    def routes(self) -> list[tuple[str, str]]:
        """``(sub-directory, key prefix)`` of each part on the Hugging Face side."""
        return [(p.name, p.hf_route) for p in self.parts]


def _load_yaml(path: str) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, encoding="utf-8") as f:
        data = yaml.load(f, Loader=loader)
    if not isinstance(data, dict):
        raise TableError(f"{path}: a family table is a mapping")
    return data


# The fields of a table of kind family.
_TOP_FIELDS = {
    "family",
    "description",
    "cs_name",
    "cs_class",
    "names",
    "headless",
    "releases",
    "hf",
    "dims",
    "checkpoint",
    "config",
    "extends",
    "checkpoint_add",
    "config_add",
    "variants",
    "notes",
    "aliases",
    "hf_style_releases",
    "kind",
}


def _validate_exprs(fam: Family) -> None:
    def check(expr: Any, where: str) -> None:
        if isinstance(expr, str):
            try:
                compile_expr(expr)
            except ExprError as e:
                raise TableError(f"{fam.name}: {where}: {e}") from None
        elif isinstance(expr, list):
            for x in expr:
                check(x, where)
        elif isinstance(expr, Mapping):
            for x in expr.values():
                check(x, where)

    for k, v in fam.dims.items():
        check(v, f"dims.{k}")
    for r in fam.rules.keys:
        lit = TRANSFORMS[r.transform].literal if r.transform in TRANSFORMS else ()
        check({k: v for k, v in r.params.items() if k not in lit}, f"params of {r.describe()}")
        check(dict(r.stack), f"stack of {r.describe()}")
        if r.when:
            check(r.when, f"when of {r.describe()}")
        if r.transform not in TRANSFORMS:
            raise TableError(f"{fam.name}: rule {r.describe()} names unknown transform {r.transform!r}")
    for side in ("hf", "cs"):
        for g in fam.rules.derive.get(side, ()):
            if g.transform not in TRANSFORMS:
                raise TableError(f"{fam.name}: derive rule {g.key} names unknown transform {g.transform!r}")
            check(dict(g.params), f"params of derived {g.key}")


def build_family(raw: dict[str, Any], path: str) -> Family:
    unknown = set(raw) - _TOP_FIELDS
    if unknown:
        raise TableError(f"{path}: unknown top-level fields {sorted(unknown)}")
    for req in ("family", "cs_class", "names", "releases", "checkpoint", "config"):
        if req not in raw:
            raise TableError(f"{path}: missing `{req}`")
    rel = raw["releases"]
    hf_rel = release_range(*[str(x) for x in rel["hf"]]) if rel.get("hf") else []
    cs_rel = release_range(*[str(x) for x in rel["cs"]])
    if not set(hf_rel) <= set(cs_rel):
        raise TableError(f"{path}: releases.hf must lie within releases.cs")
    fam = Family(
        name=raw["family"],
        description=raw.get("description", ""),
        cs_name=raw.get("cs_name", raw["family"]),
        cs_class=raw["cs_class"],
        names=list(raw["names"]),
        headless_prefix=(raw.get("headless") or {}).get("prefix") if raw.get("headless") else None,
        hf_releases=hf_rel,
        cs_releases=cs_rel,
        hf=dict(raw.get("hf") or {}),
        dims=dict(raw.get("dims") or {}),
        rules=parse_rules(raw["checkpoint"], f"{path}: checkpoint"),
        config=parse_config_table(raw["config"], f"{path}: config"),
        raw=raw,
        variants=list(raw.get("variants") or []),
        notes=list(raw.get("notes") or []),
        hf_style_releases=[str(r) for r in raw.get("hf_style_releases") or []],
    )
    _validate_exprs(fam)
    for v in fam.variants:
        extra = set(v) - {
            "names",
            "head",
            "cs_rename",
            "omit_hf",
            "checkpoint",
            "config_add",
            "hf",
            "note",
            "notes",
            "cs_class",
            "releases",
            "headless",
        }
        if extra:
            raise TableError(f"{path}: variant {v.get('names')}: unknown fields {sorted(extra)}")
        if "checkpoint" in v:
            parse_rules(merge_checkpoint({}, v["checkpoint"]), f"{path}: variant {v['names']}")
        if "config_add" in v:
            parse_config_table(merge_config(raw["config"], v["config_add"]), f"{path}: variant {v['names']}")
    return fam


# The fields of a table of kind composite or wrapper (the planner module reads those past `key_rules`).
_MODEL_FIELDS = {
    "family",
    "kind",
    "description",
    "cs_class",
    "names",
    "releases",
    "hf",
    "parts",
    "notes",
    "key_rules",
    "format_suffix",
    "plain_release",
    "prefixes",
    "wraps",
    "hf_model_types",
    "config_add",
}
_PART_FIELDS = {"name", "family", "hf_route", "cs_prefix", "hf_class"}


def build_model_table(raw: dict[str, Any], path: str) -> ModelTable:
    """A composite or wrapper table; its parts' and wrapped families are checked by the registry."""
    kind = raw["kind"]
    unknown = set(raw) - _MODEL_FIELDS
    if unknown:
        raise TableError(f"{path}: unknown top-level fields {sorted(unknown)} for a {kind} table")
    for req in ("family", "cs_class", "names", "releases", "description"):
        if req not in raw:
            raise TableError(f"{path}: missing `{req}`")
    parts = []
    for i, p in enumerate(raw.get("parts") or []):
        if not isinstance(p, Mapping) or set(p) != _PART_FIELDS:
            raise TableError(f"{path}: parts[{i}] has exactly the fields {sorted(_PART_FIELDS)}")
        parts.append(Part(*(str(p[f]) for f in ("name", "family", "hf_route", "cs_prefix", "hf_class"))))
    if kind == COMPOSITE and not parts:
        raise TableError(f"{path}: a composite table lists its `parts`")
    if kind == WRAPPER and not (raw.get("wraps") and raw.get("format_suffix")):
        raise TableError(f"{path}: a wrapper table names what it `wraps` and its `format_suffix`")
    rel = raw["releases"]
    cs = release_range(*[str(x) for x in rel["cs"]])
    suffix = f"-{raw['format_suffix']}" if kind == WRAPPER else ""
    formats = (["hf"] if rel.get("hf") else []) + [f"cs-{r}{suffix}" for r in cs]
    if raw.get("plain_release"):  # a wrapper's checkpoint without the wrapper, at that release
        formats.append(f"cs-{raw['plain_release']}-no{suffix}")
    return ModelTable(
        name=raw["family"],
        kind=kind,
        description=raw["description"],
        cs_class=raw["cs_class"],
        names=tuple(raw["names"]),
        formats=tuple(formats),
        hf_classes=tuple((raw.get("hf") or {}).get("architectures") or ()),
        notes=tuple(raw.get("notes") or ()),
        key_rules=tuple(raw.get("key_rules") or ()),
        parts=tuple(parts),
        raw=raw,
    )


def load_tables(directory: str = FAMILIES_DIR) -> tuple[dict[str, Family], dict[str, ModelTable]]:
    """Every table in ``directory``: (families by name, composite and wrapper tables by name)."""
    raws: dict[str, tuple[dict[str, Any], str]] = {}
    for fn in sorted(os.listdir(directory)):
        if not fn.endswith(".yaml"):
            continue
        path = os.path.join(directory, fn)
        raw = _load_yaml(path)
        name = raw.get("family")
        if not name or name in raws:
            raise TableError(f"{path}: missing or duplicate family name {name!r}")
        if raw.get("kind", FAMILY) not in (FAMILY, COMPOSITE, WRAPPER):
            raise TableError(f"{path}: kind is one of {FAMILY}, {COMPOSITE}, {WRAPPER}, not {raw['kind']!r}")
        raws[name] = (raw, path)
    plain = {k: raw for k, (raw, _) in raws.items() if raw.get("kind", FAMILY) == FAMILY}
    families = {name: build_family(resolve_extends(raw, plain), raws[name][1]) for name, raw in plain.items()}
    models = {
        name: build_model_table(raw, path) for name, (raw, path) in raws.items() if raw.get("kind", FAMILY) != FAMILY
    }
    for table in models.values():
        for family in [p.family for p in table.parts]:
            if family not in families:
                raise TableError(f"{table.name}: part family {family!r} has no table")
    return families, models
