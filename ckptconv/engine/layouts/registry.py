"""Model names -> their tables, formats and releases.

Every model is one YAML table under ``families/`` (loaded and validated by
:mod:`~ckptconv.engine.layouts.tables`); Model Zoo names, their aliases and ``-headless`` variants
all resolve here. This module is torch-free: the API process lists models from it.

A table's ``kind`` is ``family`` (the default), ``composite`` or ``wrapper``. Fields of a family
table (see ``families/llama.yaml`` for a complete example):

- ``family``, ``description``, ``cs_name`` (the registry name written as ``name:`` in CS configs),
  ``cs_class`` (the Model Zoo class that builds the model);
- ``names``: Model Zoo names sharing the table; ``headless: {prefix: ...}`` adds ``<name>-headless``
  for each (HF base model without the prefix; the CS LM head is synthesized on import);
- ``releases``: ``hf: [lo, hi]`` releases the HF converter reaches directly, ``cs: [lo, hi]``
  releases the family exists in (older ones are reached through upgrade steps);
- ``hf``: ``model_type``, ``architectures`` (and ``headless_architectures``);
- ``dims``: named expressions over the CS model config used by transforms and conditions;
- ``checkpoint``: key rules (``ckptconv.engine.layouts.rules``); ``config``: field mapping
  (``ckptconv.engine.layouts.config``);
- ``extends: <family>`` reuses another table, with ``checkpoint_add`` (rules tried first) and
  ``config_add`` (fields appended, sets and consts merged) for the differences;
- ``variants``: further names with a ``head`` (fine-tuning heads), a CS prefix rewrite, rules to
  omit and extra rules, their own ``cs_class``, and ``notes`` replacing the family's.

A **composite** table (``families/dpr.yaml``, ``families/llava.yaml``) describes a model made of
other families' models: ``parts`` (each ``name``: its Hugging Face sub-directory and Cerebras config
section, ``family``: the table that converts it, ``hf_route``: the Hugging Face key prefix of its
keys, ``cs_prefix``: their prefix in the Cerebras checkpoint, ``hf_class``), ``releases``,
``cs_class``, ``description`` (its formats in a line), ``notes`` and ``key_rules`` (what
``ckptconv models`` shows). A **wrapper** table (``families/dpo.yaml``)
describes one family's model held under prefixes: ``wraps`` (the model names it holds),
``format_suffix`` (formats ``cs-X.Y-<suffix>``), ``plain_release`` (``cs-X.Y-no-<suffix>``: the
same checkpoint without the wrapper), and what its planner reads (``prefixes``,
``hf_model_types``, ``config_add``). The code that plans a composite or wrapper model sits beside
its table (``families/<name>.py``) and is found through :mod:`~ckptconv.engine.layouts.models`.
"""

from __future__ import annotations

import functools
from typing import Any

from ckptconv.core.errors import NoConversionPath, UnknownModel
from ckptconv.core.releases import release_range
from ckptconv.engine.layouts.family import FAMILY, Family, Variant
from ckptconv.engine.layouts.rules import TableError
from ckptconv.engine.layouts.tables import ModelTable, load_tables
from ckptconv.engine.layouts.tables import build_family as _build_family  # noqa: F401  (re-exported)

__all__ = ["Family", "ModelTable", "Variant", "describe_model", "families", "list_models", "resolve"]


@functools.lru_cache(maxsize=1)
def _tables() -> tuple[dict[str, Family], dict[str, ModelTable]]:
    return load_tables()


def families() -> dict[str, Family]:
    """The family tables by family name."""
    return _tables()[0]


def model_tables() -> dict[str, ModelTable]:
    """The composite and wrapper tables by name."""
    return _tables()[1]


@functools.lru_cache(maxsize=1)
def model_index() -> dict[str, Variant]:
    index: dict[str, Variant] = {}

    def add(v: Variant) -> None:
        if v.name in index:
            raise TableError(f"model name {v.name!r} is claimed by {index[v.name].family} and {v.family}")
        index[v.name] = v

    for fam in families().values():
        for i, name in enumerate(fam.names):
            add(Variant(name, fam.name, alias_of=fam.names[0] if i else None))
            if fam.headless_prefix is not None:
                add(Variant(f"{name}-headless", fam.name, headless=True, alias_of=fam.names[0] if i else None))
        for v in fam.variants:
            for j, name in enumerate(v["names"]):
                add(
                    Variant(
                        name,
                        fam.name,
                        headless=bool(v.get("headless")),
                        head=v.get("head"),
                        alias_of=v["names"][0] if j else None,
                        note=v.get("note"),
                    )
                )
    for name, reason in UNSUPPORTED.items():
        if name not in index:
            index[name] = Variant(name, "", unsupported=reason)
    for table in model_tables().values():
        for name in table.names:
            add(Variant(name, table.name, note=" ".join(table.notes), kind=table.kind))
    for table in model_tables().values():
        for name in table.raw.get("wraps") or ():
            if name not in index or index[name].kind != FAMILY:
                raise TableError(f"{table.name}: wraps {name!r}, which is not a family's model name")
    return index


# Names in the Model Zoo that cannot be converted here, with the reason shown to users.
UNSUPPORTED: dict[str, str] = {}


def resolve(name: str) -> tuple[Family, Variant]:
    """The family and variant of a model name (case-sensitive as in the Model Zoo, e.g. llamaV2)."""
    index = model_index()
    v = index.get(name)
    if v is None:
        lowered = {k.lower(): k for k in index}
        if name.lower() in lowered:
            v = index[lowered[name.lower()]]
    if v is None:
        raise UnknownModel(f"unknown model {name!r}", model=name)
    if v.unsupported:
        raise NoConversionPath(f"model {name!r} cannot be converted: {v.unsupported}", model=name)
    if v.kind != FAMILY:
        raise NoConversionPath(
            f"model {name!r} is a {v.kind} of other models and has no key rules of its own",
            model=name,
            hint=f"its conversions are planned by the code beside families/{v.family}.yaml",
        )
    return families()[v.family], v


def model_table(name: str) -> ModelTable | None:
    """The composite or wrapper table of model name ``name``; None for a family's model."""
    v = model_index().get(name)
    return model_tables()[v.family] if v is not None and v.kind != FAMILY else None


def is_known_model(name: str) -> bool:
    """Whether ``name`` converts here (a family's name or alias, or a composite or wrapper model)."""
    if model_table(name) is not None:
        return True
    resolve(name)
    return True


# --- the `ckptconv models` view ----------------------------------------------------------------


def formats_of(fam: Family, variant: Variant) -> list[str]:
    vt = fam.variant_table(variant.name)
    if vt and vt.get("releases"):
        rel = vt["releases"]
        hf = release_range(*map(str, rel["hf"])) if rel.get("hf") else []
        cs = release_range(*map(str, rel["cs"]))
    else:
        hf, cs = fam.hf_releases, fam.cs_releases
    return (["hf"] if hf else []) + [f"cs-{r}" for r in cs]


def list_models() -> list[dict[str, Any]]:
    """Every model name with its family and formats (torch-free; served by GET /v1/models)."""
    out = []
    fams = families()
    for name, v in sorted(model_index().items(), key=lambda kv: kv[0].lower()):
        if v.unsupported:
            out.append({"name": name, "family": None, "supported": False, "reason": v.unsupported, "formats": []})
            continue
        if v.kind != FAMILY:
            table = model_tables()[v.family]
            out.append(
                {
                    "name": name,
                    "family": None,
                    "supported": True,
                    "description": table.description,
                    "formats": list(table.formats),
                    "hf_architectures": list(table.hf_classes),
                    "cs_class": table.cs_class,
                    "notes": list(table.notes),
                }
            )
            continue
        fam = fams[v.family]
        vt = fam.variant_table(v.name)
        entry: dict[str, Any] = {
            "name": name,
            "family": fam.name,
            "description": fam.description,
            "supported": True,
            "headless": v.headless,
            "formats": formats_of(fam, v),
            "hf_architectures": _architectures(fam, v),
            "cs_class": (vt or {}).get("cs_class", fam.cs_class),
        }
        if v.alias_of:
            entry["alias_of"] = v.alias_of
        if v.head:
            entry["head"] = v.head
        notes = list((vt or {}).get("notes", fam.notes))
        if v.note:
            notes.append(v.note)
        if notes:
            entry["notes"] = notes
        out.append(entry)
    return out


def _architectures(fam: Family, v: Variant) -> list[str]:
    if "hf" not in formats_of(fam, v):
        return []  # a Cerebras-only model
    vt = fam.variant_table(v.name)
    if vt and (vt.get("hf") or {}).get("architectures"):
        return list(vt["hf"]["architectures"])
    if v.headless:
        return list(fam.hf.get("headless_architectures") or [])
    return list(fam.hf.get("architectures") or [])


def describe_model(name: str) -> dict[str, Any]:
    table = model_table(name)
    if table is not None:
        entry = next(m for m in list_models() if m["name"] == name)
        entry["key_rules"] = list(table.key_rules)
        entry["dims"] = {}
        return entry
    fam, v = resolve(name)
    entry = next(m for m in list_models() if m["name"] == v.name)
    rules = fam.rules_for(v)
    entry["key_rules"] = [r.describe() for r in rules.keys]
    entry["dims"] = dict(fam.dims)
    return entry
