"""Raw family tables combined: ``extends:`` with ``checkpoint_add`` / ``config_add``, and a
variant's additions to its family's sections (see :mod:`ckptconv.engine.layouts.registry`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ckptconv.engine.layouts.rules import TableError


def merge_config(base: dict[str, Any], add: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (a raw ``config:`` section) with ``add`` (a ``config_add:``): lists appended, fields
    and hooks removed by name, mappings merged, other values replaced."""
    out = copy.deepcopy(base)
    for k, v in add.items():
        if k in ("fields", "hooks", "import_consts"):
            out[k] = list(out.get(k) or []) + list(v)
        elif k in ("remove_fields",):
            drop = set(v)
            out["fields"] = [f for f in out.get("fields") or [] if (f if isinstance(f, str) else f["hf"]) not in drop]
        elif k == "remove_hooks":
            out["hooks"] = [h for h in out.get("hooks") or [] if h not in set(v)]
        elif isinstance(v, Mapping):
            merged = dict(out.get(k) or {})
            merged.update(v)
            out[k] = merged
        else:
            out[k] = v
    return out


def merge_checkpoint(base: dict[str, Any], add: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (a raw ``checkpoint:`` section) with ``add`` (a ``checkpoint_add:``): added key
    rules and drop / fill / derive items come first, so they are tried before the base's."""
    out = copy.deepcopy(base)
    for k, v in add.items():
        if k == "keys":
            out["keys"] = list(v) + list(out.get("keys") or [])  # added rules are tried first
        elif k in ("drop", "fill", "derive"):
            sect = dict(out.get(k) or {})
            for side, items in v.items():
                sect[side] = list(items) + list(sect.get(side) or [])
            out[k] = sect
        else:
            raise TableError(f"checkpoint_add: unknown section {k!r}")
    return out


def resolve_extends(raw: dict[str, Any], raws: Mapping[str, dict[str, Any]], seen: tuple[str, ...] = ()) -> dict:
    """A raw table with its ``extends:`` chain applied (``raws``: every raw table by family name)."""
    parent_name = raw.get("extends")
    if not parent_name:
        return raw
    if parent_name in seen or parent_name not in raws:
        raise TableError(f"{raw.get('family')}: extends unknown or cyclic family {parent_name!r}")
    parent = resolve_extends(raws[parent_name], raws, (*seen, parent_name))
    out = copy.deepcopy(parent)
    for k, v in raw.items():
        if k in ("checkpoint_add", "config_add", "extends", "variants"):
            continue
        out[k] = copy.deepcopy(v)
    out.pop("variants", None)
    if "variants" in raw:
        out["variants"] = raw["variants"]
    if "checkpoint_add" in raw:
        out["checkpoint"] = merge_checkpoint(out.get("checkpoint") or {}, raw["checkpoint_add"])
    if "config_add" in raw:
        out["config"] = merge_config(out.get("config") or {}, raw["config_add"])
    out["extends"] = parent_name
    return out
