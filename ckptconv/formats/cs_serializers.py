"""Cerebras checkpoint metadata (format 0.5), shared by the H5 file and the S3 object-per-key layout.

Both containers store the same things; only where the bytes live differs:

- the root ``__spec__``: JSON ``[skeleton, treespec-string]`` (:func:`root_spec_text`);
- one ``<K>.__metadata__`` record per flat key K: the serialized value of K as a small tree of its
  own (``__spec__``, ``__objects__`` and one ``<subkey>.__metadata__`` dict per sub-key), whose
  ``__TYPE__`` names the cstorch serializer (:func:`key_record_text`, :func:`parse_key_record`);
- numeric payloads (tensors, numpy arrays) and opaque dill payloads, stored by the container.

JSON is written as Python's ``json`` writes it for cstorch (indent 4, non-ASCII escaped, NaN and
Infinity tokens, integers of any size), so files match the real writer text for text.
"""

from __future__ import annotations

import io
import json
import math
import pickle
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.bounded import load_json
from ckptconv.core.dtypes import DTYPE_SIZES
from ckptconv.core.errors import (
    CorruptCheckpoint,
    UnsupportedDtype,
    UnsupportedFormat,
    UnsupportedValue,
)
from ckptconv.formats.base import Entry, EntryKind, OpaqueObject
from ckptconv.formats.tree import DICT, LEAF, NAMEDTUPLE, TreeSpec, skeleton

FORMAT_VERSION = 0.5
DEFAULT_CSTORCH_VERSION = "2.10.0"

# torch dtype -> RtFx proto code, for every dtype cstorch can save (§1.7). int8, complex and fp8
# have no code: cstorch.save refuses them, and so do we.
RTFX_CODES: dict[str, int] = {
    "bool": 1,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "uint8": 6,
    "uint16": 7,
    "uint32": 8,
    "uint64": 9,
    "float16": 10,
    "float32": 11,
    "float64": 12,
    "bfloat16": 15,
}
RTFX_DTYPES: dict[int, str] = {v: k for k, v in RTFX_CODES.items()}
TENSOR_DTYPES = frozenset(RTFX_CODES)

# numpy arrays do not need an RtFx code; anything numpy holds natively is storable.
ARRAY_DTYPES = frozenset(DTYPE_SIZES) - {"float8_e4m3fn", "float8_e5m2"}

# Serializer names (``__TYPE__``).
TORCH_TENSOR = "TorchTensorSerializer"
NUMPY_ARRAY = "NumpyArraySerializer"
OBJECT = "ObjectSerializer"
SCALAR = "ScalarSerializer"
STRING = "StringSerializer"
NONE = "NoneSerializer"
LINKED = "LinkedObject"
DEFERRED_FULL = "DeferredFullTensor"
NESTED = "NestedObject"
_REFERENCE_KINDS = {
    "DeferredGraphTensor": "a traced graph that only the Cerebras appliance can evaluate",
    "DeferredSafeTensor": "a tensor in a separate .safetensors file",
    "DeferredFileTensor": "a tensor in a separate raw file",
    "DeferredTorchTensor": "a tensor in another checkpoint",
    "DeferredObject": "an object in another checkpoint",
    "DeferredNumpyArray": "an array in another checkpoint",
}


def dumps_json(obj: Any) -> str:
    """JSON text exactly as cstorch writes it (indent 4, ASCII, NaN/Infinity tokens)."""
    return json.dumps(obj, indent=4)


def loads_json(text: str | bytes, what: str) -> Any:
    if not isinstance(text, str | bytes):
        raise CorruptCheckpoint(f"{what} is not JSON text but {type(text).__name__}")
    return load_json(text, what=what)


# --- root spec ---------------------------------------------------------------------------------


def root_spec_text(spec: TreeSpec) -> str:
    return dumps_json([skeleton(spec), spec.to_json()])


def parse_root_spec(raw: str | bytes) -> TreeSpec:
    data = loads_json(raw, "root __spec__")
    if not isinstance(data, list) or len(data) != 2 or not isinstance(data[1], str | bytes):
        raise CorruptCheckpoint("root __spec__ is not [skeleton, treespec-string]")
    return TreeSpec.from_json(data[1])


def check_unique_keys(keys: list[str]) -> None:
    seen: set[str] = set()
    for k in keys:
        if k in seen:
            raise CorruptCheckpoint(
                f"two leaves of the tree spec flatten to the same key {k!r}; the real loader fails on it too"
            )
        seen.add(k)


# --- per-key metadata: writing -------------------------------------------------------------------


def tensor_metadata(dtype: str, shape: tuple[int, ...]) -> dict[str, Any]:
    return {
        "__TORCH__": True,
        "shapes": [list(shape)],
        "dtypes": [f"torch.{dtype}"],
        "rtfx_dtypes": [RTFX_CODES[dtype]],
        "__TYPE__": TORCH_TENSOR,
        "__NUMPY__": True,
        "compressed": False,
    }


def array_metadata(is_bfloat16: bool) -> dict[str, Any]:
    return {"is_bfloat16": is_bfloat16, "__TYPE__": NUMPY_ARRAY, "__NUMPY__": True, "compressed": False}


def object_metadata() -> dict[str, Any]:
    return {"__TYPE__": OBJECT, "__BYTES__": True, "compressed": False}


def link_metadata(target: str) -> dict[str, Any]:
    return {"key": target, "__LINKED__": True, "__TYPE__": LINKED, "__NONE__": True}


def value_metadata(value: Any) -> dict[str, Any] | None:
    """Metadata of a value that lives in metadata only, or None when it needs an object payload."""
    if value is None:
        return {"__TYPE__": NONE, "__NONE__": True}
    if isinstance(value, bool | int) and type(value).__module__ == "builtins":
        return {"scalar_value": value, "__TYPE__": SCALAR, "__NONE__": True}
    if isinstance(value, float):  # float subclasses too (numpy.float64), as cstorch does
        return {"scalar_value": float(value), "__TYPE__": SCALAR, "__NONE__": True}
    if isinstance(value, str) and type(value) is str:
        return {"string_value": value, "__TYPE__": STRING, "__NONE__": True}
    return None


def object_payload(key: str, value: Any) -> bytes:
    """The dill-compatible bytes of an object entry.

    Payloads that came from a pickle travel unchanged. Decoded plain data is pickled with protocol
    4, which is byte for byte what dill writes for plain data.
    """
    if isinstance(value, OpaqueObject):
        if value.encoding in ("dill", "pickle"):
            return bytes(value.payload)
        if value.decoded:
            value = value.value
        else:
            raise UnsupportedValue(
                f"{key!r} is an opaque {value.encoding} payload; a Cerebras checkpoint can only hold pickles",
                key=key,
            )
    try:
        return dumps_dill_compatible(value)
    except Exception as e:
        raise UnsupportedValue(f"{key!r}: cannot store a {type(value).__name__} ({e})", key=key) from None


class _Numpy1Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """Pickles as dill does (it builds on this pure-Python pickler), naming numpy 1's module paths.

    numpy 2 moved its internals to ``numpy._core`` and names them so in pickles; cstorch 2.10
    runs numpy 1.25, whose unpickler has no such module. ``numpy.core`` works in both.
    """

    def save_global(self, obj: Any, name: str | None = None) -> None:
        module = getattr(obj, "__module__", None) or ""
        if self.proto >= 4 and (module == "numpy._core" or module.startswith("numpy._core.")):
            self.save("numpy.core" + module[len("numpy._core") :])
            self.save(name or obj.__qualname__)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def dumps_dill_compatible(value: Any) -> bytes:
    """Protocol-4 pickle bytes that ``dill.loads`` in cstorch's environment (numpy 1) can read."""
    buf = io.BytesIO()
    _Numpy1Pickler(buf, protocol=4).dump(value)
    return buf.getvalue()


def key_record(key: str, md: dict[str, Any]) -> dict[str, Any]:
    spec = TreeSpec(DICT, [key], [LEAF])
    return {"__spec__": [skeleton(spec), spec.to_json()], "__objects__": [key], f"{key}.__metadata__": md}


def key_record_text(key: str, md: dict[str, Any]) -> str:
    return dumps_json(key_record(key, md))


# --- per-key metadata: reading -------------------------------------------------------------------


@dataclass
class Leaf:
    """What one key's record says about its value, before the container adds storage facts."""

    key: str
    kind: EntryKind
    serializer: str
    subkey: str | None = None  # where the payload is stored (H5 dataset / S3 object name)
    md: dict[str, Any] = field(default_factory=dict)  # the serializer's metadata as recorded
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    value: Any = None
    target: str | None = None
    fill: Any = None  # for full tensors: the fill value (None: uninitialized)
    full: bool = False

    def entry(self, **meta: Any) -> Entry:
        m = {"serializer": self.serializer, "subkey": self.subkey, "md": self.md, **meta}
        if self.full:
            m["fill_value"] = self.fill
        return Entry(self.key, self.kind, self.dtype, self.shape, self.value, self.target, m)


@dataclass
class _Serialized:
    subkey: str
    md: dict[str, Any]


@dataclass
class _Nested:
    inner: Any
    outer: Any


def parse_key_record(key: str, text: str | bytes | None) -> Leaf:
    """Parse ``<key>.__metadata__`` into a :class:`Leaf`. Raises CorruptCheckpoint / UnsupportedFormat."""
    if text is None:
        raise CorruptCheckpoint(
            f"{key!r} is in the tree spec but has no {key}.__metadata__ record; the checkpoint is damaged"
        )
    rec = loads_json(text, f"{key}.__metadata__")
    if not isinstance(rec, dict):
        raise CorruptCheckpoint(f"{key}.__metadata__ is not a JSON object")
    spec_pair = rec.get("__spec__")
    if not isinstance(spec_pair, list) or len(spec_pair) != 2 or not isinstance(spec_pair[1], str):
        raise CorruptCheckpoint(f"{key}.__metadata__ has no [skeleton, treespec-string] __spec__")
    spec = TreeSpec.from_json(spec_pair[1])
    objects = rec.get("__objects__", [])
    if not isinstance(objects, list):
        raise CorruptCheckpoint(f"{key}.__metadata__: __objects__ is not a list")
    objects_set = {o for o in objects if isinstance(o, str)}
    if spec.is_leaf or spec.type not in (DICT, "collections.OrderedDict") or len(spec.children) != 1:
        raise CorruptCheckpoint(f"{key}.__metadata__: its spec is not a one-key dict")

    def build(node: TreeSpec, path: str) -> Any:
        if node.is_leaf:
            md = rec.get(f"{path}.__metadata__", _MISSING)
            if md is _MISSING:
                raise CorruptCheckpoint(f"{key}.__metadata__ lacks the record of sub-key {path!r}")
            if path in objects_set:
                if not isinstance(md, dict):
                    raise CorruptCheckpoint(f"{key}.__metadata__: metadata of {path!r} is not an object")
                return _Serialized(path, md)
            return md
        kids = [build(c, f"{path}.{label}") for label, c in zip(node.child_labels(), node.children, strict=True)]
        if node.type == NAMEDTUPLE and node.context == NESTED and len(kids) == 2:
            return _Nested(kids[0], kids[1])
        if node.type in (DICT, "collections.OrderedDict"):
            return dict(zip(node.context, kids, strict=True))
        return kids

    label = spec.child_labels()[0]
    return _describe(key, build(spec.children[0], str(label)))


_MISSING = object()


def _describe(key: str, obj: Any) -> Leaf:
    if isinstance(obj, _Serialized):
        return _describe_serialized(key, obj)
    if isinstance(obj, _Nested):
        inner = _describe(key, obj.inner)
        outer = obj.outer
        if not isinstance(outer, dict) or not isinstance(outer.get("__TYPE__"), str):
            raise CorruptCheckpoint(f"{key!r}: nested entry without a serializer name")
        kind = outer["__TYPE__"]
        if inner.full and kind in (TORCH_TENSOR, NUMPY_ARRAY):
            # §1.10: a CSX initial checkpoint wraps a full-tensor description in tensor metadata.
            if kind == TORCH_TENSOR:
                inner.dtype = (
                    _tensor_dtype(key, outer) if ("dtypes" in outer or "rtfx_dtypes" in outer) else inner.dtype
                )
                if "shapes" in outer:
                    inner.shape = _tensor_shape(key, outer)
                inner.kind = "tensor"
            else:
                inner.kind = "array"
            inner.serializer = kind
            inner.md = outer
            return inner
        raise UnsupportedFormat(
            f"{key!r} is a nested {kind} over {inner.serializer}, which ckptconv cannot materialize",
            key=key,
        )
    raise CorruptCheckpoint(f"{key!r}: metadata record holds raw data where a serialized value belongs")


def _describe_serialized(key: str, obj: _Serialized) -> Leaf:
    md = obj.md
    kind = md.get("__TYPE__")
    if not isinstance(kind, str):
        raise CorruptCheckpoint(f"{key!r}: metadata has no serializer name (__TYPE__)")
    leaf = Leaf(key, "value", kind, obj.subkey, md)
    if kind == TORCH_TENSOR:
        leaf.kind = "tensor"
        leaf.dtype = _tensor_dtype(key, md)
        leaf.shape = _tensor_shape(key, md)
        if not (md.get("__NUMPY__") or md.get("__RTFX__") or md.get("__BYTES__")):
            raise CorruptCheckpoint(f"{key!r}: tensor metadata says no data is stored")
    elif kind == NUMPY_ARRAY:
        leaf.kind = "array"
    elif kind == OBJECT:
        leaf.kind = "object"
    elif kind == SCALAR:
        if "scalar_value" not in md:
            raise CorruptCheckpoint(f"{key!r}: scalar without scalar_value")
        v = md["scalar_value"]
        if not isinstance(v, bool | int | float):
            raise CorruptCheckpoint(f"{key!r}: scalar_value is a {type(v).__name__}")
        leaf.value = v
    elif kind == STRING:
        v = md.get("string_value")
        if not isinstance(v, str):
            raise CorruptCheckpoint(f"{key!r}: string without string_value")
        leaf.value = v
    elif kind == NONE:
        leaf.value = None
    elif kind == LINKED:
        target = md.get("key")
        if not isinstance(target, str):
            raise CorruptCheckpoint(f"{key!r}: link without a target key")
        leaf.kind = "link"
        leaf.target = target
    elif kind == DEFERRED_FULL:
        leaf.kind = "tensor"
        leaf.full = True
        shape = md.get("shape")
        if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CorruptCheckpoint(f"{key!r}: full tensor without a valid shape")
        leaf.shape = tuple(shape)
        leaf.dtype = parse_dtype(key, md.get("dtype"))
        fill = md.get("fill_value")
        if fill is not None and not isinstance(fill, bool | int | float):
            raise CorruptCheckpoint(f"{key!r}: full tensor fill_value is a {type(fill).__name__}")
        leaf.fill = fill
    elif kind in _REFERENCE_KINDS:
        raise UnsupportedFormat(
            f"{key!r} is a {kind}: a reference to {_REFERENCE_KINDS[kind]}, not data in this checkpoint",
            hint="materialize the checkpoint with cstorch (load it and save it again) before converting",
            key=key,
        )
    else:
        raise UnsupportedFormat(
            f"{key!r} uses the unknown serializer {kind!r}",
            hint="the checkpoint was written by a cstorch release newer than ckptconv knows, or is damaged",
            key=key,
        )
    return leaf


def _tensor_dtype(key: str, md: dict[str, Any]) -> str:
    dtypes = md.get("dtypes")
    if isinstance(dtypes, list | tuple) and dtypes:
        return parse_dtype(key, dtypes[0])
    codes = md.get("rtfx_dtypes")
    if isinstance(codes, list | tuple) and codes and isinstance(codes[0], int) and codes[0] in RTFX_DTYPES:
        return RTFX_DTYPES[codes[0]]
    raise CorruptCheckpoint(f"{key!r}: tensor metadata names no dtype")


def _tensor_shape(key: str, md: dict[str, Any]) -> tuple[int, ...]:
    shapes = md.get("shapes")
    if not isinstance(shapes, list | tuple) or not shapes or not isinstance(shapes[0], list | tuple):
        raise CorruptCheckpoint(f"{key!r}: tensor metadata has no shape")
    dims = shapes[0]
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise CorruptCheckpoint(f"{key!r}: tensor shape {dims!r} is not a list of sizes")
    return tuple(dims)


_NUMPY_NAMES = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint64": "uint64",
    "uint32": "uint32",
    "uint16": "uint16",
    "uint8": "uint8",
    "bool": "bool",
    "complex64": "complex64",
    "complex128": "complex128",
}


def parse_dtype(key: str, name: Any) -> str:
    """A dtype as cstorch records it (``torch.bfloat16``, ``float32``, ``<f4``) -> our dtype name."""
    if isinstance(name, bytes):
        name = name.decode("utf-8", "replace")
    if not isinstance(name, str):
        raise CorruptCheckpoint(f"{key!r}: dtype {name!r} is not a string")
    short = name.removeprefix("torch.")
    if short in DTYPE_SIZES:
        return short
    import numpy as np

    try:
        np_name = np.dtype(name).name
    except TypeError:
        np_name = None
    if np_name in _NUMPY_NAMES:
        return _NUMPY_NAMES[np_name]
    raise UnsupportedDtype(f"{key!r} has dtype {name!r}, which ckptconv does not know", key=key, dtype=name)


def numpy_dtype_name(dt: Any) -> str | None:
    """Our dtype name for a numpy dtype, or None when torch has no equivalent."""
    if dt.kind not in "biufc" or dt.hasobject:
        return None
    return _NUMPY_NAMES.get(dt.newbyteorder("=").name if dt.byteorder not in "=|" else dt.name)


def stored_numpy_dtype(dtype: str) -> str:
    """The numpy dtype a value of ``dtype`` is stored as (bf16 travels as its int16 bit pattern)."""
    return "int16" if dtype == "bfloat16" else dtype


def check_fill(key: str, dtype: str, fill: Any) -> None:
    if fill is None:
        return
    if isinstance(fill, float) and not math.isfinite(fill) and not dtype.startswith(("float", "bfloat", "complex")):
        raise CorruptCheckpoint(f"{key!r}: non-finite fill value for an integer tensor")
