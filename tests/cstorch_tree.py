"""Test helpers for Cerebras checkpoints: describe trees and H5 files the way the fixtures do.

``tests/fixtures/cstorch/NAME.json`` describes what the real ``cstorch.load`` returned (``loaded``)
and the raw HDF5 view of the file (``h5``). These helpers produce the same descriptions from our
values and files, so a test compares node by node:

- :func:`describe` turns a value tree into fixture nodes (tensors by dtype, shape and sha256 of
  their raw little-endian bytes; floats by exact hex; dict keys with their Python type);
- :func:`assert_same_tree` compares two node trees and names the path of the first difference;
- :func:`load_tree` reads every entry of a source and rebuilds the nested tree (links resolved to
  the very same object, as cstorch does);
- :func:`h5_view` reproduces the fixture ``h5`` view; :func:`h5_layout` goes deeper (HDF5 type
  classes, string encodings, dataspaces, layouts, filters, creation-order flags).
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
from typing import Any

import h5py
import hdf5plugin  # noqa: F401 - LZ4 filter for h5py reads
import numpy as np
import torch

from ckptconv.formats.base import Entry, OpaqueObject, TensorSink, TensorSource, dtype_name
from ckptconv.formats.tree import TreeSpec, flatten, unflatten
from ckptconv.testing.format_tests import write_all as write_all  # the one copy, re-exported for these tests

# --- value trees ------------------------------------------------------------------------------


def tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().contiguous().reshape(-1)
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(raw).hexdigest()


def describe(v: Any) -> dict[str, Any]:
    """The fixture node of one value (see tests/fixtures/cstorch/README.md)."""
    if isinstance(v, dict):
        kind = "OrderedDict" if isinstance(v, collections.OrderedDict) else "dict"
        return {
            "kind": "dict",
            "type": kind,
            "items": [[k, type(k).__name__, describe(x)] for k, x in v.items()],
        }
    if isinstance(v, list):
        return {"kind": "list", "items": [describe(x) for x in v]}
    if isinstance(v, tuple):
        return {"kind": "tuple", "items": [describe(x) for x in v]}
    if isinstance(v, set | frozenset):
        return {"kind": "set", "items": sorted((describe(x) for x in v), key=json.dumps)}
    if isinstance(v, torch.Tensor):
        return {
            "kind": "tensor",
            "dtype": dtype_name(v.dtype),
            "shape": list(v.shape),
            "nbytes": v.numel() * v.element_size(),
            "sha256": tensor_sha256(v),
        }
    if isinstance(v, OpaqueObject):
        node: dict[str, Any] = {
            "kind": "object",
            "decoded": v.decoded,
            "sha256": hashlib.sha256(v.payload).hexdigest(),
        }
        if v.decoded:
            node["value"] = describe(v.value)
        return node
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
    if isinstance(v, np.ndarray | np.generic):
        return {"kind": "numpy", "dtype": str(v.dtype), "value": np.asarray(v).tolist()}
    if isinstance(v, torch.dtype):
        return {"kind": "torch_dtype", "value": str(v)}
    return {"kind": "other", "type": type(v).__qualname__, "repr": repr(v)}


def _normal(node: Any) -> Any:
    """Drop what a node says twice: float ``value`` (``hex`` is exact, also for NaN) and tensor ``values``."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if node.get("kind") == "float" and k == "value":
                continue
            if node.get("kind") == "tensor" and k == "values":
                continue
            out[k] = _normal(v)
        return out
    if isinstance(node, list):
        return [_normal(x) for x in node]
    return node


def assert_same_tree(ours: dict[str, Any], expected: dict[str, Any], path: str = "$") -> None:
    """Node-by-node equality; the message names the first differing path."""
    a, b = _normal(ours), _normal(expected)
    _compare(a, b, path)


def _compare(a: Any, b: Any, path: str) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        if a.get("kind") != b.get("kind"):
            raise AssertionError(f"{path}: kind {a.get('kind')!r} != expected {b.get('kind')!r}")
        if set(a) != set(b):
            raise AssertionError(f"{path}: fields {sorted(a)} != expected {sorted(b)}")
        for k in a:
            _compare(a[k], b[k], f"{path}.{k}")
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            raise AssertionError(f"{path}: {len(a)} items != expected {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _compare(x, y, f"{path}[{i}]")
        return
    if type(a) is not type(b) or a != b:
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return
        raise AssertionError(f"{path}: {a!r} != expected {b!r}")


def load_tree(source: TensorSource) -> Any:
    """Every value of ``source`` nested by its spec; links are the very same object as their target."""
    values: dict[str, Any] = {}
    entries = source.entries()
    by_key = {e.key: e for e in entries}
    for e in entries:
        if e.kind != "link":
            values[e.key] = source.read(e.key)
    for e in entries:
        if e.kind == "link":
            target = e.target
            while by_key[target].kind == "link":
                target = by_key[target].target
            values[e.key] = values[target]
    leaves = [values[e.key] for e in entries]
    spec = source.spec
    if spec is None:
        return dict(zip([e.key for e in entries], leaves, strict=True))
    return unflatten(leaves, spec)


def entries_from_tree(tree: Any) -> tuple[list[Entry], TreeSpec, dict[str, Any]]:
    """Entries for a state dict the way ``cstorch.save`` sees it: a leaf object seen before is a link.

    Like cstorch, identity decides (so every ``None`` after the first is a link too). Non-tensor,
    non-scalar leaves travel as :class:`OpaqueObject` (already-pickled payloads) or values.
    """
    leaves, spec = flatten(tree)
    entries: list[Entry] = []
    values: dict[str, Any] = {}
    first: dict[int, str] = {}
    for key, v in leaves:
        if id(v) in first:
            entries.append(Entry(key, "link", target=first[id(v)]))
            continue
        first[id(v)] = key
        values[key] = v
        if isinstance(v, torch.Tensor):
            entries.append(Entry(key, "tensor", dtype_name(v.dtype), tuple(v.shape)))
        elif isinstance(v, NumpyArray):
            values[key] = v.tensor
            entries.append(Entry(key, "array", dtype_name(v.tensor.dtype), tuple(v.tensor.shape)))
        elif isinstance(v, OpaqueObject):
            entries.append(Entry(key, "object", meta={"nbytes": len(v.payload)}))
        else:
            entries.append(Entry(key, "value", value=v))
    return entries, spec, values


class NumpyArray:
    """Marks a tensor that should be written as a Cerebras numpy-array entry (kind ``array``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def copy_checkpoint(source: TensorSource, sink: TensorSink) -> Any:
    """source -> sink, one value at a time, as the engine does."""
    entries = source.entries()
    try:
        sink.begin(entries, source.spec)
        for e in entries:
            if e.kind != "link":
                sink.write(e.key, source.read(e.key))
        return sink.commit()
    except BaseException:
        sink.abort()
        raise


# --- H5 files ---------------------------------------------------------------------------------


def _attr_value(v: Any) -> Any:
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, str):
        try:
            parsed = json.loads(v)
        except ValueError:
            return v
        return {"__json__": parsed} if isinstance(parsed, list | dict) else v
    if isinstance(v, np.ndarray):
        if v.dtype.kind == "V":
            return {"__bytes_sha256__": hashlib.sha256(v.tobytes()).hexdigest()}
        return [x.decode() if isinstance(x, bytes) else x for x in v.tolist()] if v.ndim == 1 else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def h5_view(path: str) -> dict[str, Any]:
    """The ``h5`` view of the fixture JSON files, computed from a file."""
    out: dict[str, Any] = {"file_attrs": {}, "datasets": {}, "groups": []}
    with h5py.File(path, "r") as f:
        for name in f.attrs:
            out["file_attrs"][name] = _attr_value(f.attrs[name])

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Group):
                out["groups"].append(name)
                return
            if obj.shape is None:
                stored = None
            else:
                data = obj[()]
                stored = hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()
            out["datasets"][name] = {
                "h5_dtype": str(obj.dtype),
                "shape": None if obj.shape is None else list(obj.shape),
                "chunks": None if obj.chunks is None else list(obj.chunks),
                # as h5py 3.13 reported it: only the built-in compressions have a name
                "compression": obj.compression if obj.compression in ("gzip", "lzf", "szip") else None,
                "external": obj.external,
                "attrs": {k: _attr_value(obj.attrs[k]) for k in obj.attrs},
                "stored_sha256": stored,
            }

        f.visititems(visit)
    return out


def _type_desc(t: Any) -> str:
    c = t.get_class()
    names = {
        h5py.h5t.INTEGER: "int",
        h5py.h5t.FLOAT: "float",
        h5py.h5t.STRING: "string",
        h5py.h5t.ENUM: "enum",
        h5py.h5t.OPAQUE: "opaque",
    }
    s = f"{names.get(c, c)}{t.get_size()}"
    if c == h5py.h5t.STRING:
        s += f" vlen={t.is_variable_str()} cset={t.get_cset()}"
    elif c == h5py.h5t.ENUM:
        members = [(t.get_member_name(i), t.get_member_value(i)) for i in range(t.get_nmembers())]
        s += f" base={_type_desc(t.get_super())} {members}"
    elif c == h5py.h5t.OPAQUE:
        s += f" tag={t.get_tag()!r}"
    elif c in (h5py.h5t.INTEGER, h5py.h5t.FLOAT):
        s += f" order={t.get_order()}"
        if c == h5py.h5t.INTEGER:
            s += f" signed={t.get_sign()}"
    return s


def _space_desc(sp: Any) -> str:
    cls = sp.get_simple_extent_type()
    if cls == h5py.h5s.SCALAR:
        return "scalar"
    if cls == h5py.h5s.NULL:
        return "null"
    return f"simple{sp.shape}"


def _attrs_desc(obj: Any) -> dict[str, tuple[str, str]]:
    out = {}
    for name in obj.attrs:
        a = h5py.h5a.open(obj.id, name.encode())
        out[name] = (_type_desc(a.get_type()), _space_desc(a.get_space()))
    return out


def h5_layout(path: str, *, with_chunks: bool = True) -> dict[str, Any]:
    """HDF5-level facts: attribute types and dataspaces, dataset types, layouts, filters, flags.

    Filter names are left out: they come from the hdf5plugin release that wrote the file.
    """
    out: dict[str, Any] = {}
    with h5py.File(path, "r") as f:
        out["/"] = {"attrs": _attrs_desc(f), "crt_order": f.id.get_create_plist().get_attr_creation_order()}

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Group):
                out[name] = {"group": True, "attrs": _attrs_desc(obj)}
                return
            dcpl = obj.id.get_create_plist()
            out[name] = {
                "type": _type_desc(obj.id.get_type()),
                "space": _space_desc(obj.id.get_space()),
                "layout": dcpl.get_layout(),
                "chunks": obj.chunks if with_chunks else None,
                "filters": [dcpl.get_filter(i)[:3] for i in range(dcpl.get_nfilters())],
                "crt_order": dcpl.get_attr_creation_order(),
                "fill_time": dcpl.get_fill_time(),
                "alloc_time": dcpl.get_alloc_time(),
                "fill_defined": dcpl.fill_value_defined(),
                "attrs": _attrs_desc(obj),
            }

        f.visititems(visit)
    return out
