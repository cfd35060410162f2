"""A pickle loader that builds plain data and never runs code named by the payload.

Cerebras checkpoints carry pickles (dill, protocol 4) in several places: the tree spec of legacy
H5 files, ``ObjectSerializer`` payloads, the ``__METADATA__`` object of the S3 layout. Any of them
may come from an untrusted source, and unpickling normally means calling whatever the payload
names. This module resolves every global a pickle references through an allowlist:

- plain data: None, bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set,
  frozenset, slice, range, ``collections.OrderedDict``/``deque``;
- numeric numpy scalars, dtypes and arrays (never of ``object`` dtype);
- torch dtypes (``torch.float32`` ...);
- torch's pytree ``TreeSpec``/``LeafSpec`` and Cerebras' ``TensorScalarDict``: mapped to the inert
  stand-ins below (:class:`PickledTreeSpec`, ``dict``), whose only behaviour is to hold state;
- dill's helpers for builtin types and namedtuple classes, mapped to equivalents that only look
  names up in fixed tables.

Anything else raises :class:`~ckptconv.core.errors.UnsafeCheckpoint` before a single call is made.
Callables on the allowlist are wrapped where an argument could make them expensive (e.g.
``bytearray(10**12)``). Malformed streams raise :class:`~ckptconv.core.errors.CorruptCheckpoint`.
"""

from __future__ import annotations

import _compat_pickle
import collections
import io
import keyword
import pickle
from collections.abc import Callable
from typing import Any

from ckptconv.core.errors import CheckpointError, CorruptCheckpoint, UnsafeCheckpoint


class PickledTreeSpec:
    """Inert stand-in for ``torch.utils._pytree.TreeSpec``: holds ``type``, ``context``, ``children_specs``."""

    def __init__(self, type: Any = None, context: Any = None, children_specs: list | None = None) -> None:
        self.type = type
        self.context = context
        self.children_specs = list(children_specs or [])

    def __setstate__(self, state: Any) -> None:
        # dataclass / plain-class pickles carry ``__dict__``; a (dict, slots) pair is also legal.
        if isinstance(state, tuple) and len(state) == 2:
            merged: dict[str, Any] = {}
            for part in state:
                if isinstance(part, dict):
                    merged.update(part)
            state = merged
        if not isinstance(state, dict):
            raise CorruptCheckpoint("pickled tree spec has an unexpected state")
        self.type = state.get("type")
        self.context = state.get("context")
        self.children_specs = list(state.get("children_specs") or [])

    @property
    def is_leaf(self) -> bool:
        return isinstance(self, PickledLeafSpec) or (self.type is None and not self.children_specs)

    def to_tree_spec(self) -> Any:
        """The equivalent :class:`ckptconv.formats.tree.TreeSpec` (num_leaves is recomputed, never trusted)."""
        return _to_tree_spec(self, 0)


class PickledLeafSpec(PickledTreeSpec):
    """Inert stand-in for ``torch.utils._pytree.LeafSpec``."""


class _NamedTupleNode:
    """Stands for ``collections.namedtuple``, which torch's pytree uses as the node type of namedtuples.

    Only a marker: a pickle that calls it (to build classes) is refused.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> _NamedTupleNode:
        raise UnsafeCheckpoint("pickle calls collections.namedtuple; refused")


def _to_tree_spec(node: Any, depth: int) -> Any:
    from ckptconv.formats import tree

    if depth > 1000:
        raise CorruptCheckpoint("pickled tree spec is nested too deeply")
    if not isinstance(node, PickledTreeSpec):
        raise CorruptCheckpoint(f"pickled tree spec holds a {type(node).__name__} where a spec node belongs")
    if node.is_leaf:
        return tree.TreeSpec()
    kids = [_to_tree_spec(c, depth + 1) for c in node.children_specs]
    t = node.type
    ctx = node.context
    if t is dict or t is collections.OrderedDict or t is collections.defaultdict:
        if t is collections.defaultdict:
            # torch stores [default_factory, keys]; the factory cannot travel, the keys can.
            ctx = ctx[1] if isinstance(ctx, list | tuple) and len(ctx) == 2 else ctx
        if not isinstance(ctx, list | tuple) or len(ctx) != len(kids):
            raise CorruptCheckpoint("pickled tree spec: dict keys do not match its children")
        name = tree.ODICT if t is collections.OrderedDict else tree.DICT
        return tree.TreeSpec(name, list(ctx), kids)
    if t is list:
        return tree.TreeSpec(tree.LIST, None, kids)
    if t is tuple:
        return tree.TreeSpec(tree.TUPLE, None, kids)
    if t is set:
        return tree.TreeSpec(tree.SET, None, kids)
    if t is collections.deque:
        return tree.TreeSpec(tree.DEQUE, ctx if isinstance(ctx, int) else None, kids)
    if isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields"):
        return tree.TreeSpec(tree.NAMEDTUPLE, t.__name__, kids)
    if t is _NamedTupleNode or (isinstance(ctx, type) and issubclass(ctx, tuple) and hasattr(ctx, "_fields")):
        name = ctx.__name__ if isinstance(ctx, type) else str(ctx)
        return tree.TreeSpec(tree.NAMEDTUPLE, name, kids)
    raise CorruptCheckpoint(f"pickled tree spec has an unsupported node type {t!r}")


# --- allowlisted callables ------------------------------------------------------------------


def _safe_bytearray(*args: Any) -> bytearray:
    if args and not isinstance(args[0], bytes | bytearray | str | list):
        raise UnsafeCheckpoint("pickle calls bytearray() with a size; refused")
    return bytearray(*args)


def _safe_codecs_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    # protocol 2/3 pickles spell bytes as _codecs.encode(text, "latin1")
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise UnsafeCheckpoint("pickle calls _codecs.encode with unexpected arguments; refused")
    return obj.encode(encoding, errors)


_DILL_TYPES: dict[str, type] = {
    t.__name__: t
    for t in (
        dict,
        list,
        tuple,
        set,
        frozenset,
        bytes,
        bytearray,
        str,
        int,
        float,
        complex,
        bool,
        slice,
        range,
        type(None),
    )
}


def _dill_load_type(name: str) -> type:
    try:
        return _DILL_TYPES[name]
    except (KeyError, TypeError):
        raise UnsafeCheckpoint(f"pickle asks dill for the type {name!r}; refused") from None


def _dill_create_namedtuple(name: Any, fieldnames: Any, modulename: Any = None, defaults: Any = None) -> type:
    names = [name, *list(fieldnames or ())]
    if not all(isinstance(n, str) and n.isidentifier() and not keyword.iskeyword(n) for n in names):
        raise UnsafeCheckpoint("pickle defines a namedtuple with invalid names; refused")
    return collections.namedtuple(name, list(fieldnames))


def _safe_deque(iterable: Any = (), maxlen: Any = None) -> collections.deque:
    return collections.deque(iterable, maxlen)


def _numpy_check_dtype(dt: Any) -> Any:
    import numpy as np

    if not isinstance(dt, np.dtype) or dt.hasobject:
        raise UnsafeCheckpoint("pickle holds a numpy value of object dtype; refused")
    return dt


def _numpy_scalar(dt: Any, data: Any = None) -> Any:
    import numpy as np

    _numpy_check_dtype(dt)
    if not isinstance(data, bytes):
        raise CorruptCheckpoint("pickled numpy scalar has no raw bytes")
    if len(data) != dt.itemsize:
        raise CorruptCheckpoint("pickled numpy scalar has the wrong size")
    return np.frombuffer(data, dtype=dt)[0].copy()


class _SafeNdarray:
    """Builds a numpy array from ``_reconstruct`` + BUILD state, refusing object dtypes."""

    def __init__(self) -> None:
        self.array: Any = None

    def __setstate__(self, state: Any) -> None:
        import numpy as np

        if not isinstance(state, tuple) or len(state) != 5:
            raise CorruptCheckpoint("pickled numpy array has an unexpected state")
        _version, shape, dt, fortran, raw = state
        _numpy_check_dtype(dt)
        if not isinstance(raw, bytes | bytearray):
            raise CorruptCheckpoint("pickled numpy array has no raw bytes")
        shape = tuple(int(s) for s in shape)
        count = 1
        for s in shape:
            count *= s
        if count * dt.itemsize != len(raw):
            raise CorruptCheckpoint("pickled numpy array: shape and data size disagree")
        arr = np.frombuffer(bytes(raw), dtype=dt).copy()
        self.array = arr.reshape(shape, order="F" if fortran else "C")


def _numpy_reconstruct(cls: Any, shape: Any, dtype_code: Any) -> _SafeNdarray:
    return _SafeNdarray()


def _numpy_dtype(obj: Any, align: Any = False, copy: Any = False) -> Any:
    import numpy as np

    if not isinstance(obj, str):
        raise UnsafeCheckpoint("pickle builds a numpy dtype from a non-string; refused")
    dt = np.dtype(obj)
    return _numpy_check_dtype(dt)


def _torch_dtype(name: str) -> Callable[[], Any]:
    def get() -> Any:
        import torch

        return getattr(torch, name)

    return get


_TORCH_DTYPES = frozenset(
    (
        *("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"),
        *("int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool"),
        *("double", "float", "half", "long", "int", "short"),
    )
)

_TENSOR_SCALAR_DICT = (
    "cerebras_pytorch.utils.tensor_scalar_dict",
    "cerebras.pytorch.utils.tensor_scalar_dict",
    "modelzoo.common.pytorch.utils",
)


def _allowed() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {}
    for t in (int, float, complex, str, bytes, list, tuple, dict, set, frozenset, slice, range, bool):
        table[("builtins", t.__name__)] = t
        table[("__builtin__", t.__name__)] = t
    table[("builtins", "bytearray")] = _safe_bytearray
    table[("__builtin__", "bytearray")] = _safe_bytearray
    table[("collections", "OrderedDict")] = collections.OrderedDict
    table[("collections", "deque")] = _safe_deque
    table[("collections", "namedtuple")] = _NamedTupleNode
    table[("_codecs", "encode")] = _safe_codecs_encode
    for mod in ("torch.utils._pytree", "torch.utils.pytree"):
        table[(mod, "TreeSpec")] = PickledTreeSpec
        table[(mod, "LeafSpec")] = PickledLeafSpec
    for mod in _TENSOR_SCALAR_DICT:
        table[(mod, "TensorScalarDict")] = dict
    for mod in ("dill._dill", "dill.dill"):
        table[(mod, "_load_type")] = _dill_load_type
        table[(mod, "_create_namedtuple")] = _dill_create_namedtuple
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[(mod, "scalar")] = _numpy_scalar
        table[(mod, "_reconstruct")] = _numpy_reconstruct
    table[("numpy", "dtype")] = _numpy_dtype
    table[("numpy", "ndarray")] = _SafeNdarray
    return table


_ALLOWED = _allowed()


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Protocols 0-2 may spell names as Python 2 did (__builtin__.xrange); the translated name
        # still has to pass the allowlist.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in _TORCH_DTYPES:
            return _torch_dtype(name)()
        raise UnsafeCheckpoint(
            f"pickle references {module}.{name}, which is not plain data; it was not loaded",
            global_name=f"{module}.{name}",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint("pickle uses persistent ids (external objects); refused")


def _finish(obj: Any) -> Any:
    """Replace numpy-array builders by their arrays (they sit wherever the array was)."""
    if isinstance(obj, _SafeNdarray):
        return obj.array
    if type(obj) is list:
        return [_finish(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_finish(v) for v in obj)
    if type(obj) is dict:
        return {k: _finish(v) for k, v in obj.items()}
    if type(obj) is collections.OrderedDict:
        return collections.OrderedDict((k, _finish(v)) for k, v in obj.items())
    return obj


def loads(data: bytes | bytearray | memoryview, *, what: str = "pickle") -> Any:
    """Unpickle ``data`` allowing only plain data (see the module docstring).

    Raises UnsafeCheckpoint when the pickle names anything else, CorruptCheckpoint when it is
    malformed. ``what`` names the payload in error messages (e.g. "tree spec of legacy.mdl").
    """
    try:
        obj = _Unpickler(io.BytesIO(bytes(data))).load()
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"{what}: {e.message}", **e.details) from None
    except CheckpointError:
        raise
    except RecursionError:
        raise CorruptCheckpoint(f"{what}: pickle is nested too deeply") from None
    except Exception as e:  # malformed streams raise a zoo of exception types
        raise CorruptCheckpoint(f"{what}: not a readable pickle ({type(e).__name__}: {e})") from None
    return _finish(obj)


def try_loads(data: bytes | bytearray | memoryview) -> tuple[bool, Any]:
    """``(True, value)`` when ``data`` is a pickle of plain data, else ``(False, None)``; never raises."""
    try:
        return True, loads(data)
    except CheckpointError:
        return False, None
