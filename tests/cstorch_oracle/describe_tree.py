"""Describe what real ``cstorch.load`` returns, as JSON nodes (runs in the cstorch oracle venv only).

Same node format as ``tests/fixtures/cstorch/*.json`` (see its README) and ``tests/cstorch_tree.py``:

- ``dict`` (``type`` dict/OrderedDict, ``items`` = ``[key, key type name, node]``), ``list``,
  ``tuple``, ``set`` (items sorted by their JSON text);
- ``tensor``: ``dtype`` (torch name without ``torch.``), ``shape``, ``nbytes``, ``sha256`` of the raw
  little-endian bytes in C order;
- ``ndarray`` (a numpy array entry): the same fields, ``dtype`` = numpy name or ``bfloat16`` for an
  array cstorch flags as bf16 (it returns int16 bits then);
- ``object`` (a dill payload): ``sha256`` of the stored payload bytes and ``value`` = the node of the
  object dill rebuilt (an ``error`` node when it could not);
- scalars: ``int``/``bool``/``str`` with ``value``, ``float`` with ``value`` and exact ``hex``,
  ``none``; other leaves inside objects: ``numpy`` (numpy scalars), ``torch_dtype``, ``bytes``,
  ``other`` (type and repr).

Ties: :func:`ties` lists the flat keys whose values are the very same tensor, array or object
(the identity cstorch restores for linked entries).

This module imports only torch, numpy and cstorch's own classes: it must not import ckptconv, whose
dependencies this venv does not have.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Any

import numpy as np
import torch
from cerebras.appliance.storage.serializers import DeferredNumpyArray, DeferredObject


def raw_sha256(t: torch.Tensor) -> str:
    t = t.detach().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def materialize(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor a lazy cstorch tensor stands for (read from the file now)."""
    # DeferredTensor materializes on any torch op; _materialize is the loader's own entry point.
    return t._materialize() if hasattr(t, "_materialize") else t


def _array_node(arr: np.ndarray) -> dict[str, Any]:
    meta = arr.dtype.metadata or {}
    bf16 = bool(meta.get("is_bfloat16"))
    data = np.ascontiguousarray(arr)
    return {
        "kind": "ndarray",
        "dtype": "bfloat16" if bf16 else arr.dtype.name,
        "shape": list(arr.shape),
        "nbytes": int(data.nbytes),
        "sha256": hashlib.sha256(data.tobytes()).hexdigest(),
    }


def _payload_sha256(obj: DeferredObject) -> str:
    # The bytes exactly as stored (before dill), read through the loader's own storage reader.
    data, _ = obj._reader.read(obj._key)
    raw = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
    return hashlib.sha256(raw).hexdigest()


def describe(v: Any) -> dict[str, Any]:
    if isinstance(v, dict):
        kind = "OrderedDict" if isinstance(v, collections.OrderedDict) else "dict"
        return {"kind": "dict", "type": kind, "items": [[k, type(k).__name__, describe(x)] for k, x in v.items()]}
    if isinstance(v, list):
        return {"kind": "list", "items": [describe(x) for x in v]}
    if isinstance(v, tuple):
        return {"kind": "tuple", "items": [describe(x) for x in v]}
    if isinstance(v, set | frozenset):
        return {"kind": "set", "items": sorted((describe(x) for x in v), key=json.dumps)}
    if isinstance(v, torch.Tensor):
        t = materialize(v)
        return {
            "kind": "tensor",
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "nbytes": t.numel() * t.element_size(),
            "sha256": raw_sha256(t),
        }
    if isinstance(v, DeferredNumpyArray):
        return _array_node(v.value)
    if isinstance(v, DeferredObject):
        node: dict[str, Any] = {"kind": "object", "sha256": _payload_sha256(v)}
        try:
            node["value"] = describe(v.value)
        except Exception as e:
            node["value"] = {"kind": "error", "error": f"{type(e).__name__}: {e}"}
        return node
    return describe_leaf(v)


def describe_leaf(v: Any) -> dict[str, Any]:
    """Plain values, as tests/cstorch_tree.py describes them."""
    if isinstance(v, bool):
        return {"kind": "bool", "value": v}
    if isinstance(v, int):
        return {"kind": "int", "value": v}
    if isinstance(v, float):
        return {"kind": "float", "value": v, "hex": v.hex()}
    if v is None:
        return {"kind": "none"}
    if isinstance(v, str):
        return {"kind": "str", "value": v}
    if isinstance(v, bytes | bytearray):
        return {"kind": type(v).__name__, "sha256": hashlib.sha256(v).hexdigest()}
    if isinstance(v, np.ndarray):
        return _array_node(v)
    if isinstance(v, np.generic):
        return {"kind": "numpy", "dtype": str(v.dtype), "value": np.asarray(v).tolist()}
    if isinstance(v, torch.dtype):
        return {"kind": "torch_dtype", "value": str(v)}
    return {"kind": "other", "type": type(v).__qualname__, "repr": repr(v)}


def _leaves(v: Any, path: tuple[str, ...]) -> Any:
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _leaves(x, (*path, str(k)))
    elif isinstance(v, list | tuple | set | frozenset):
        for i, x in enumerate(v):
            yield from _leaves(x, (*path, str(i)))
    else:
        yield ".".join(path), v


def ties(tree: Any) -> list[list[str]]:
    """Groups of flat keys holding the very same tensor, array or object (first key first)."""
    groups: dict[int, list[str]] = {}
    for key, v in _leaves(tree, ()):
        if isinstance(v, torch.Tensor | np.ndarray | DeferredObject):
            groups.setdefault(id(v), []).append(key)
    return [g for g in groups.values() if len(g) > 1]
