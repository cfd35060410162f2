"""Nested dict access by dotted path (``moe.num_experts``), as family tables address config keys."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

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
