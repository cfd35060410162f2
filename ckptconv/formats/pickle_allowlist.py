"""What a pickle may name: the one allowlist of every reader in ckptconv, and its inert stand-ins.

Every pickle ckptconv reads (``data.pkl`` of torch archives, the tree specs and object payloads of
Cerebras checkpoints, the ``__METADATA__`` of the S3 layout, plain pickles handed in as
checkpoints) resolves its globals through :func:`resolve_global` and nothing else:

- plain data: the builtin containers and scalars, ``collections.OrderedDict``/``deque``/``Counter``;
- numeric numpy scalars, dtypes and arrays (never of ``object`` dtype);
- torch dtypes, ``torch.Size``, ``torch.device``, storage classes, and the rebuild functions of plain
  dense tensors, mapped to descriptions (:class:`TensorRef`) that hold no data;
- torch's pytree ``TreeSpec``/``LeafSpec`` and Cerebras' ``TensorScalarDict``: mapped to the inert
  stand-ins below, whose only behaviour is to hold state;
- dill's helpers for builtin types and namedtuple classes, mapped to equivalents that only look
  names up in fixed tables;
- for a PyTorch distributed checkpoint's ``.metadata`` only, the DCP metadata classes, mapped to
  inert records (:data:`DCP_METADATA`).

Anything else raises :class:`~ckptconv.core.errors.UnsafeCheckpoint` before a single call is made
(rebuilds of quantized, sparse or device-only tensors raise UnsupportedValue: they are torch's own,
not hostile). Entries marked ``weights_only`` are the ones ``torch.load(weights_only=True)`` also
accepts: a torch archive's ``data.pkl`` is read with that subset only, so ckptconv reads (and
writes) exactly the archives torch's safe loader reads. Callables are wrapped where an argument
could make them expensive (``bytearray(10**12)``).

One concept at about 600 lines: the allowlist and the stand-ins its entries map to, kept together
so that what a pickle may name is read in one place.
"""

from __future__ import annotations

import _compat_pickle
import collections
import functools
import keyword
import math
from typing import Any

from ckptconv.core.dtypes import DTYPE_SIZES
from ckptconv.core.errors import CorruptCheckpoint, UnsafeCheckpoint, UnsupportedDtype, UnsupportedValue
from ckptconv.formats import tree

MAX_NESTING = 200  # containers (or tree-spec nodes) nested deeper than this are refused as corrupt

# --- plain-data stand-ins -----------------------------------------------------------------------


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
    if depth > MAX_NESTING:
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


# --- plain-data callables -----------------------------------------------------------------------


def _safe_bytearray(*args: Any) -> bytearray:
    if args and not isinstance(args[0], bytes | bytearray | str | list):
        raise UnsafeCheckpoint("the pickle calls bytearray() with a size; refused")
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


# --- torch stand-ins: tensors described, never loaded -------------------------------------------

# torch's legacy typed storages, by class name -> element dtype. Dtypes without one (uint16/32/64,
# float8) are saved as an UntypedStorage (bytes) plus a dtype argument (``_rebuild_tensor_v3``).
LEGACY_STORAGES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
STORAGE_OF_DTYPE = {v: k for k, v in LEGACY_STORAGES.items()}


class StorageType:
    """Stands for a torch storage class in ``data.pkl`` (``UntypedStorage`` holds uint8 bytes)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class TorchDtype:
    """Stands for a ``torch.<dtype>`` global."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class StorageRef:
    """One persistent storage record: ``<archive>/data/<key>`` holding ``nbytes`` bytes."""

    __slots__ = ("dtype", "key", "nbytes")

    def __init__(self, key: str, dtype: str, nbytes: int) -> None:
        self.key = key
        self.dtype = dtype
        self.nbytes = nbytes


class TensorRef:
    """A tensor described, not loaded: a strided view (in elements of ``dtype``) of a storage."""

    __slots__ = ("dtype", "offset", "shape", "storage", "stride")

    def __init__(self, storage: Any, offset: Any, shape: Any, stride: Any, dtype: str | None = None) -> None:
        if not isinstance(storage, StorageRef):
            raise CorruptCheckpoint("a tensor in data.pkl is not backed by a storage record")
        ints = (offset, *_int_tuple(shape, "shape"), *_int_tuple(stride, "stride"))
        if any(type(v) is not int or v < 0 for v in ints):
            raise CorruptCheckpoint("a tensor in data.pkl has a negative or non-integer offset, size or stride")
        self.storage = storage
        self.dtype = dtype or storage.dtype
        self.offset = offset
        self.shape = tuple(shape)
        self.stride = tuple(stride)
        if len(self.shape) != len(self.stride):
            raise CorruptCheckpoint("a tensor in data.pkl has sizes and strides of different lengths")
        if self.dtype not in DTYPE_SIZES:
            raise UnsupportedDtype(f"tensor dtype {self.dtype} is not supported")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def span(self) -> tuple[int, int]:
        """The byte range ``[begin, end)`` of the storage this view touches."""
        size = DTYPE_SIZES[self.dtype]
        if self.numel == 0:
            return self.offset * size, self.offset * size
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return self.offset * size, (last + 1) * size

    def is_contiguous(self) -> bool:
        expected = 1
        for n, s in reversed(list(zip(self.shape, self.stride, strict=True))):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True

    def tie_key(self) -> tuple[Any, ...]:
        return (self.storage.key, self.dtype, self.offset, self.shape, self.stride)


def _int_tuple(v: Any, what: str) -> tuple[Any, ...]:
    if not isinstance(v, tuple | list):
        raise CorruptCheckpoint(f"a tensor in data.pkl has a {what} that is not a tuple")
    return tuple(v)


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> TensorRef:
    return TensorRef(storage, offset, size, stride)


def _rebuild_v3(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, *_: Any
) -> TensorRef:
    if not isinstance(dtype, TorchDtype):
        raise CorruptCheckpoint("a tensor in data.pkl names no dtype")
    return TensorRef(storage, offset, size, stride, dtype.name)


def _rebuild_parameter(data: Any, *_: Any) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise CorruptCheckpoint("a parameter in data.pkl holds no tensor")
    return data


class _TensorClass:
    """Stands for ``torch.Tensor`` / ``torch.nn.Parameter`` as a rebuild target."""


_REBUILDERS = (_rebuild_v2, _rebuild_v3, _rebuild_parameter)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func not in _REBUILDERS or not isinstance(new_type, _TensorClass) or not isinstance(args, tuple):
        raise UnsafeCheckpoint("data.pkl rebuilds a tensor subclass; only plain tensors are accepted")
    return func(*args)


def _torch_size(items: Any = ()) -> tuple[Any, ...]:
    return tuple(items)


def _torch_device(*args: Any) -> Any:
    import torch

    if not all(isinstance(a, str | int) for a in args):
        raise CorruptCheckpoint("data.pkl holds an invalid torch.device")
    return torch.device(*args)


# torch rebuild functions the weights_only loader knows, but that describe tensors without plain
# CPU storage (quantized, sparse, nested, meta, subclasses): refused as unsupported, not unsafe.
_UNSUPPORTED_TORCH = {
    "_rebuild_qtensor",
    "_rebuild_sparse_tensor",
    "_rebuild_nested_tensor",
    "_rebuild_meta_tensor_no_storage",
    "_rebuild_wrapper_subclass",
    "_rebuild_device_tensor_from_numpy",
    "_rebuild_device_tensor_from_cpu_tensor",
    "_rebuild_xla_tensor",
    "_rebuild_mtia_tensor",
}


# --- PyTorch Distributed Checkpoint metadata (``.metadata``; read with ``dcp_metadata=True``) ----------


class DcpRecord:
    """Holds the pickled state of one DCP metadata dataclass as attributes; does nothing else."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            merged: dict[str, Any] = {}
            for part in state:
                if isinstance(part, dict):
                    merged.update(part)
            state = merged
        # A field named like a method of the record (``get``) would shadow it: refused too.
        if not isinstance(state, dict) or not all(isinstance(k, str) and not hasattr(type(self), k) for k in state):
            raise CorruptCheckpoint(f"DCP metadata: a {type(self).__name__} has an unexpected state")
        self.__dict__.update(state)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)


class DcpMetadata(DcpRecord):
    pass


class DcpTensorStorage(DcpRecord):
    pass


class DcpBytesStorage(DcpRecord):
    pass


class DcpChunk(DcpRecord):
    pass


class DcpIndex(DcpRecord):
    pass


class DcpStorageInfo(DcpRecord):
    pass


class DcpTensorProperties(DcpRecord):
    """DCP pickles tensor properties as a tuple: (dtype, layout, requires_grad, memory format, pin_memory)."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != 5:
            raise CorruptCheckpoint("DCP metadata: tensor properties have an unexpected state")
        self.__dict__.update(dtype=state[0], layout=state[1])


def _dcp_enum(value: Any) -> int:
    if type(value) is not int:
        raise UnsafeCheckpoint("DCP metadata: an enum built from a non-integer; refused")
    return value


def _dcp_layout(name: Any) -> str:
    if not isinstance(name, str):
        raise UnsafeCheckpoint("DCP metadata: a tensor layout named by a non-string; refused")
    return name


def _dcp_size(items: Any = ()) -> tuple[int, ...]:
    if not isinstance(items, list | tuple) or not all(type(i) is int for i in items):
        raise CorruptCheckpoint("DCP metadata: a torch.Size holds something other than integers")
    return tuple(items)


def _dcp_path(*parts: Any) -> str:
    # StorageMeta.checkpoint_id is the path the trainer saved to: kept as text, never used.
    if not all(isinstance(p, str) for p in parts):
        raise UnsafeCheckpoint("DCP metadata: a path built from non-strings; refused")
    return "/".join(parts)


_DCP = "torch.distributed.checkpoint.metadata"
# The classes torch.distributed.checkpoint's FileSystemWriter pickles into .metadata, as inert
# records; consulted only for that file (a DCP class anywhere else is as unexpected as any class).
DCP_METADATA: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): DcpMetadata,
    (_DCP, "TensorStorageMetadata"): DcpTensorStorage,
    (_DCP, "BytesStorageMetadata"): DcpBytesStorage,
    (_DCP, "ChunkStorageMetadata"): DcpChunk,
    (_DCP, "MetadataIndex"): DcpIndex,
    (_DCP, "StorageMeta"): DcpRecord,
    (_DCP, "TensorProperties"): DcpTensorProperties,
    (_DCP, "_MEM_FORMAT_ENCODING"): _dcp_enum,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): DcpStorageInfo,
    ("torch.serialization", "_get_layout"): _dcp_layout,
    ("torch", "Size"): _dcp_size,
    **{("pathlib", cls): _dcp_path for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")},
}


_TENSOR_SCALAR_DICT = (
    "cerebras_pytorch.utils.tensor_scalar_dict",
    "cerebras.pytorch.utils.tensor_scalar_dict",
    "modelzoo.common.pytorch.utils",
)


def _table() -> dict[tuple[str, str], tuple[Any, bool]]:
    """``(module, name)`` -> (what the pickle gets, whether torch's weights_only loader allows it too)."""
    plain: dict[tuple[str, str], Any] = {}
    for t in (int, float, str, bytes, list, tuple, dict, frozenset, slice, range, bool):
        plain[("builtins", t.__name__)] = t
    plain[("collections", "deque")] = _safe_deque
    plain[("collections", "namedtuple")] = _NamedTupleNode
    for mod in ("torch.utils._pytree", "torch.utils.pytree"):
        plain[(mod, "TreeSpec")] = PickledTreeSpec
        plain[(mod, "LeafSpec")] = PickledLeafSpec
    for mod in _TENSOR_SCALAR_DICT:
        plain[(mod, "TensorScalarDict")] = dict
    for mod in ("dill._dill", "dill.dill"):
        plain[(mod, "_load_type")] = _dill_load_type
        plain[(mod, "_create_namedtuple")] = _dill_create_namedtuple
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        plain[(mod, "scalar")] = _numpy_scalar
        plain[(mod, "_reconstruct")] = _numpy_reconstruct
    plain[("numpy", "dtype")] = _numpy_dtype
    plain[("numpy", "ndarray")] = _SafeNdarray

    weights_only: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor"): _rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch", "Tensor"): _TensorClass(),
        ("torch.nn.parameter", "Parameter"): _TensorClass(),
        ("torch", "Size"): _torch_size,
        ("torch", "device"): _torch_device,
        ("torch.storage", "UntypedStorage"): StorageType("uint8"),
        ("torch", "UntypedStorage"): StorageType("uint8"),
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("collections", "Counter"): collections.Counter,
        ("_codecs", "encode"): _safe_codecs_encode,
        ("builtins", "set"): set,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): _safe_bytearray,
    }
    for name, dtype in LEGACY_STORAGES.items():
        weights_only[("torch", name)] = StorageType(dtype)
    for name in DTYPE_SIZES:
        weights_only[("torch", name)] = TorchDtype(name)
    return {**{k: (v, False) for k, v in plain.items()}, **{k: (v, True) for k, v in weights_only.items()}}


ALLOWED = _table()


@functools.cache
def _torch_dtype_names() -> frozenset[str]:
    import torch  # only when a pickle names a torch attribute outside the table

    # vars(), not getattr(): a name from the pickle must not trigger torch's lazy submodule imports.
    return frozenset(n for n, v in vars(torch).items() if isinstance(v, torch.dtype))


def resolve_global(module: str, name: str, *, weights_only: bool = False, dcp_metadata: bool = False) -> Any:
    """What a pickle's GLOBAL ``module.name`` stands for, or UnsafeCheckpoint.

    ``weights_only`` narrows the allowlist to what ``torch.load(weights_only=True)`` accepts;
    ``dcp_metadata`` adds the classes of a distributed checkpoint's ``.metadata`` (:data:`DCP_METADATA`).
    """
    if dcp_metadata and (module, name) in DCP_METADATA:
        return DCP_METADATA[(module, name)]
    # Protocols 0-2 may spell names as Python 2 did (__builtin__.complex); the translated name
    # still has to pass the allowlist.
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    found = ALLOWED.get((module, name))
    if found is not None and (found[1] or not weights_only):
        return found[0]
    if found is None and module == "torch" and name in _torch_dtype_names():
        return TorchDtype(name)  # a dtype ckptconv has no tensors of (float8_e4m3fnuz, double, ...)
    if module == "torch._utils" and name in _UNSUPPORTED_TORCH:
        raise UnsupportedValue(
            f"the checkpoint holds a tensor rebuilt by torch._utils.{name} (quantized, sparse, nested, "
            "meta or device-only); ckptconv converts plain dense tensors",
            hint="convert such tensors to dense CPU tensors and save the state dict again",
        )
    beyond = "torch's weights_only loader" if found is not None else "the allowlist of plain data and tensors"
    raise UnsafeCheckpoint(
        f"the pickle references {module}.{name}, which is outside {beyond}; nothing was executed",
        global_name=f"{module}.{name}",
    )
