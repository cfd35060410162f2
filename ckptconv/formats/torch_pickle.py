"""PyTorch pickles (``torch.save``): single files and shards with ``pytorch_model.bin.index.json``.

Reading (zip format, PyTorch >= 1.6) never calls ``torch.load``: the archive's central directory
is read through ranged reads, ``data.pkl`` (small) is unpickled by :class:`DescribingUnpickler`,
which allows exactly the globals of torch's ``weights_only`` loader, refuses everything else
with :class:`~ckptconv.core.errors.UnsafeCheckpoint` before anything is called, and turns every
tensor into a description (storage record, dtype, offset, shape, stride) instead of data. So
``entries()`` is metadata only, and ``read(key)`` reads that tensor's bytes from its
``<archive>/data/<n>`` member with one ranged read, locally or on S3. Legacy (pre-1.6)
pickles are read locally with ``torch.load(weights_only=True)``, which loads them whole.

Nested pickles are flattened with :func:`ckptconv.formats.tree.flatten`; non-tensor leaves become
``value`` entries (None, bool, int, float, str) or ``object`` entries (bytes, complex, torch
dtypes and devices, as a protocol-2 pickle payload); a tensor that is the same view of the same
storage as an earlier one becomes a ``link`` to it.

Writing streams the zip archive itself with the member layout ``torch.save`` uses (``data.pkl``
first, storages 64-byte aligned, data descriptors, zip64 records), one tensor at a time:
``data.pkl`` depends only on the announced entries, so it is written before any tensor (after
them only when the checkpoint holds objects, whose values arrive with the data). Links share
their target's storage, so ``torch.load`` restores the tie. Each finished file is committed
under the sink's URI (a staging prefix the engine publishes); ``abort`` removes them all.
"""

from __future__ import annotations

import _compat_pickle
import collections
import functools
import io
import math
import pickle
import secrets
import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptconv.core.dtypes import DTYPE_SIZES
from ckptconv.core.errors import (
    CheckpointError,
    CorruptCheckpoint,
    UnsafeCheckpoint,
    UnsupportedDtype,
    UnsupportedFormat,
    UnsupportedValue,
)
from ckptconv.formats.base import (
    Entry,
    OpaqueObject,
    OutputFile,
    TensorSource,
    dtype_name,
    torch_dtype,
)
from ckptconv.formats.sharding import (
    RECORD_KEY,
    TORCH,
    HashingWriter,
    LocalFiles,
    ShardedSink,
    Slot,
    build_record,
    entries_from_record,
    find_checkpoint,
    index_bytes,
    parse_record,
    plain_value,
    read_index,
    read_slot,
    resolve_link,
    tensor_view,
)
from ckptconv.formats.tree import TreeSpec, flatten, unflatten

if TYPE_CHECKING:
    import torch

    from ckptconv.storage.base import Storage

_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
MAX_PICKLE_BYTES = 256 << 20  # data.pkl holds structure only; real ones are a few MB
MAX_LEAVES = 10_000_000
MAX_DEPTH = 200

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
_STORAGE_OF_DTYPE = {v: k for k, v in LEGACY_STORAGES.items()}


# --- describing unpickler --------------------------------------------------------------------


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


def _codecs_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    # Protocol-2 pickles spell bytes as _codecs.encode(text, "latin1").
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise UnsafeCheckpoint("data.pkl calls _codecs.encode with unexpected arguments")
    return obj.encode(encoding, errors)


def _bytearray(*args: Any) -> bytearray:
    if args and not isinstance(args[0], bytes | bytearray | list):
        raise UnsafeCheckpoint("data.pkl calls bytearray() with a size")
    return bytearray(*args)


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


def _allowed_globals() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
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
        ("_codecs", "encode"): _codecs_encode,
        ("builtins", "set"): set,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): _bytearray,
    }
    for name, dtype in LEGACY_STORAGES.items():
        table[("torch", name)] = StorageType(dtype)
    for name in DTYPE_SIZES:
        table[("torch", name)] = TorchDtype(name)
    return table


_ALLOWED = _allowed_globals()


def _is_torch_dtype(name: str) -> bool:
    return name in _torch_dtype_names()


@functools.cache
def _torch_dtype_names() -> frozenset[str]:
    import torch

    # vars(), not getattr(): a name from the pickle must not trigger torch's lazy submodule imports.
    return frozenset(n for n, v in vars(torch).items() if isinstance(v, torch.dtype))


class DescribingUnpickler(pickle.Unpickler):
    """Unpickles ``data.pkl`` into containers, plain values and :class:`TensorRef` descriptions.

    Every global goes through :meth:`find_class`, which knows only the allowlist above (torch's
    ``weights_only`` set, mapped to inert stand-ins); a pickle naming anything else is refused
    before a single call is made.
    """

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.storages: dict[str, StorageRef] = {}

    def find_class(self, module: str, name: str) -> Any:
        # Protocol-2 pickles (torch.save's) spell some names the Python 2 way (__builtin__.complex).
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and _is_torch_dtype(name):
            return TorchDtype(name)  # a dtype ckptconv has no tensors of (float8_e4m3fnuz, ...): a plain value
        if module == "torch._utils" and name in _UNSUPPORTED_TORCH:
            raise UnsupportedValue(
                f"the checkpoint holds a tensor rebuilt by torch._utils.{name} (quantized, sparse, nested, "
                "meta or device-only); ckptconv converts plain dense tensors",
                hint="convert such tensors to dense CPU tensors and save the state dict again",
            )
        raise UnsafeCheckpoint(
            f"the pickle references {module}.{name}, which torch's weights_only loader does not allow; "
            "nothing was executed",
            global_name=f"{module}.{name}",
        )

    def persistent_load(self, pid: Any) -> StorageRef:
        if not isinstance(pid, tuple) or len(pid) != 5:
            raise CorruptCheckpoint("data.pkl has a malformed storage record")
        typename, storage_type, key, _location, numel = pid
        if isinstance(typename, bytes):
            typename = typename.decode("ascii", "replace")
        if typename != "storage" or not isinstance(storage_type, StorageType):
            raise CorruptCheckpoint("data.pkl has a persistent record that is not a storage")
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise CorruptCheckpoint("data.pkl has a storage record with an invalid key or size")
        nbytes = numel * DTYPE_SIZES[storage_type.dtype]
        ref = self.storages.get(key)
        if ref is None:
            ref = self.storages[key] = StorageRef(key, storage_type.dtype, nbytes)
        elif ref.nbytes != nbytes:
            raise CorruptCheckpoint(f"data.pkl gives storage {key!r} two different sizes")
        return ref


def describe_pickle(data: bytes, where: str) -> Any:
    """The object tree of a ``data.pkl``, tensors as :class:`TensorRef`. Never runs code."""
    try:
        return DescribingUnpickler(data).load()
    except CheckpointError as e:
        raise type(e)(f"{where}: {e.message}", hint=e.hint, **e.details) from None
    except RecursionError:
        raise CorruptCheckpoint(f"{where}: the pickle is nested too deeply") from None
    except Exception as e:  # malformed streams raise a zoo of exception types
        raise CorruptCheckpoint(f"{where}: not a readable pickle ({type(e).__name__}: {e})") from None


def _check_tree(root: Any, where: str) -> None:
    """Refuse cycles, absurd depth, and trees whose flattening would explode (shared subtrees)."""
    counted: dict[int, int] = {}
    active: set[int] = set()

    def count(obj: Any, depth: int) -> int:
        if not isinstance(obj, dict | list | tuple | set | frozenset):
            return 1
        if depth > MAX_DEPTH:
            raise CorruptCheckpoint(f"{where}: the pickle nests containers more than {MAX_DEPTH} deep")
        oid = id(obj)
        if oid in counted:
            return counted[oid]
        if oid in active:
            raise CorruptCheckpoint(f"{where}: the pickle contains a container that holds itself")
        active.add(oid)
        items = obj.values() if isinstance(obj, dict) else obj
        n = sum(count(v, depth + 1) for v in items)
        active.discard(oid)
        if n > MAX_LEAVES:
            raise CorruptCheckpoint(f"{where}: the pickle would flatten to more than {MAX_LEAVES} entries")
        counted[oid] = n
        return n

    count(root, 0)


# --- reading ---------------------------------------------------------------------------------


def _leaf_entry(key: str, leaf: Any) -> tuple[Entry, Any]:
    """The entry for a non-tensor leaf, and the value ``read`` returns for it."""
    if plain_value(leaf):
        return Entry(key, "value", value=leaf), leaf
    import torch

    if isinstance(leaf, TorchDtype):
        leaf = getattr(torch, leaf.name)
    if not isinstance(leaf, bytes | bytearray | complex | torch.dtype | torch.device):
        raise UnsupportedValue(f"{key!r} holds a bare {type(leaf).__name__}, which is neither a tensor nor a value")
    payload = pickle.dumps(leaf, protocol=2)
    obj = OpaqueObject(payload, encoding="pickle", value=leaf, decoded=True)
    return Entry(key, "object", meta={"nbytes": len(payload), "encoding": "pickle"}), obj


def _flat_spec(tree: Any, spec: TreeSpec) -> TreeSpec | None:
    """None for a flat dict of tensors with string keys (a plain state dict), else ``spec``."""
    if isinstance(tree, dict) and all(isinstance(k, str) for k in tree) and all(c.is_leaf for c in spec.children):
        return None
    return spec


class _Archive:
    """One zip-format torch file: its storage members and the tensors ``data.pkl`` describes.

    Only the central directory goes through ``zipfile`` (a few small reads at the end of the
    file); members are read with ranged reads at their data offsets, so opening an archive on
    S3 never downloads tensor data.
    """

    def __init__(self, storage: Storage, uri: str) -> None:
        self.storage = storage
        self.uri = uri
        self.size = storage.stat(uri).size
        self._offsets: dict[str, int] = {}
        try:
            with storage.open_reader(uri) as reader, zipfile.ZipFile(reader) as zf:
                self.members = {info.filename: info for info in zf.infolist()}
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise CorruptCheckpoint(f"{self.uri} is not a readable zip archive ({e})") from e
        names = list(self.members)
        if not names or "/" not in names[0]:
            raise CorruptCheckpoint(f"{self.uri}: the archive has no torch record directory")
        # torch.load takes the record directory from the first member, whatever its name.
        self.prefix = names[0].split("/", 1)[0] + "/"
        if self.prefix + "constants.pkl" in self.members:
            raise UnsupportedFormat(
                f"{self.uri} is a TorchScript archive, not a state dict",
                hint="save model.state_dict() with torch.save and convert that file",
            )
        if self._member("data.pkl").file_size > MAX_PICKLE_BYTES:
            raise CorruptCheckpoint(f"{self.uri}: data.pkl is larger than {MAX_PICKLE_BYTES} bytes")
        pkl = self._read_member("data.pkl")
        order = self._read_member("byteorder") if self.prefix + "byteorder" in self.members else b"little"
        if order not in (b"little", b"big"):
            raise CorruptCheckpoint(f"{self.uri}: unknown byte order {order[:16]!r}")
        self.big_endian = order == b"big"
        self.tree = describe_pickle(pkl, self.uri)

    def _member(self, name: str) -> zipfile.ZipInfo:
        info = self.members.get(self.prefix + name)
        if info is None:
            raise CorruptCheckpoint(f"{self.uri}: the archive has no {self.prefix}{name} record")
        return info

    def _read_member(self, name: str) -> bytes:
        """A small member, whole, checked against its CRC."""
        info = self._member(name)
        data = self.storage.read_range(self.uri, self.data_offset(name), info.file_size)
        if zlib.crc32(data) != info.CRC:
            raise CorruptCheckpoint(f"{self.uri}: {self.prefix}{name} fails its CRC check")
        return data

    def check(self, ref: TensorRef) -> None:
        """The storage member exists and is large enough for the storage, which holds the view."""
        info = self._member("data/" + ref.storage.key)
        begin, end = ref.span()
        if info.file_size < ref.storage.nbytes or end > ref.storage.nbytes:
            raise CorruptCheckpoint(
                f"{self.uri}: storage {ref.storage.key} holds {info.file_size} bytes, "
                f"too few for a {ref.dtype}{list(ref.shape)} tensor at byte {begin}"
            )

    def data_offset(self, name: str) -> int:
        """Where the bytes of a stored (uncompressed) member start in the file."""
        if name not in self._offsets:
            info = self._member(name)
            if info.compress_type != zipfile.ZIP_STORED:
                raise UnsupportedFormat(
                    f"{self.uri}: {info.filename} is compressed; torch.save stores records uncompressed",
                    hint="re-save the checkpoint with torch.save",
                )
            if info.header_offset + 30 > self.size:
                raise CorruptCheckpoint(f"{self.uri}: {info.filename} starts past the end of the file")
            head = self.storage.read_range(self.uri, info.header_offset, 30)
            sig, name_len, extra_len = struct.unpack("<I22xHH", head)
            if sig != 0x04034B50:
                raise CorruptCheckpoint(f"{self.uri}: {info.filename} has a bad local header")
            start = info.header_offset + 30 + name_len + extra_len
            if start + info.file_size > self.size:
                raise CorruptCheckpoint(f"{self.uri}: {info.filename} runs past the end of the file")
            self._offsets[name] = start
        return self._offsets[name]


def _read_ref(archive: _Archive, ref: TensorRef, fd: int | None) -> torch.Tensor:
    """One tensor from its storage member: the bytes of its view, then the view itself."""
    import torch

    begin, end = ref.span()
    start = archive.data_offset("data/" + ref.storage.key)
    size = DTYPE_SIZES[ref.dtype]
    if ref.is_contiguous():
        t = read_slot(archive.storage, Slot(archive.uri, start + begin, end - begin, ref.dtype, ref.shape), fd)
    else:
        # Strided (e.g. transposed) views read the storage span they touch and copy out the view.
        span = read_slot(
            archive.storage, Slot(archive.uri, start + begin, end - begin, ref.dtype, ((end - begin) // size,)), fd
        )
        t = torch.as_strided(span, ref.shape, ref.stride).contiguous()
        del span
    if archive.big_endian and size > 1:
        t = _swap_bytes(t)
    return t


def _swap_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    width = t.element_size() // 2 if t.is_complex() else t.element_size()
    raw = t.reshape(-1).view(torch.uint8).view(-1, width).flip(1).contiguous()
    return raw.reshape(-1).view(t.dtype).reshape(t.shape)


class TorchSource(TensorSource):
    """A ``torch.save`` file, a ``pytorch_model.bin.index.json``, or a directory/prefix holding one."""

    format = "torch"

    def __init__(self, storage: Storage, uri: str, **options: Any) -> None:
        super().__init__(storage, uri)
        self.path = find_checkpoint(storage, uri, TORCH, (*_SUFFIXES, ".bin.index.json"))
        self._local = LocalFiles(storage)
        self._archives: dict[str, _Archive] = {}
        self._refs: dict[str, tuple[str, Any]] = {}  # key -> (file uri, TensorRef | tensor | value)
        self._files = [self.path]
        self._spec: TreeSpec | None = None
        self.legacy = False
        try:
            if self.path.endswith(".index.json"):
                self._open_index()
            else:
                entries, self._spec = self._open_file(self.path)
                self._entries = entries
        except BaseException:
            self.close()
            raise
        self._by_key = {e.key: e for e in self._entries}

    def _open_index(self) -> None:
        index = read_index(self.storage, self.path)
        self._files += index.shards
        stored: dict[str, Entry] = {}
        for shard in index.shards:
            entries, spec = self._open_file(shard)
            if spec is not None:
                raise CorruptCheckpoint(f"shard {shard} is not a flat state dict")
            for e in entries:
                if e.key in stored:
                    raise CorruptCheckpoint(f"{e.key!r} is stored in two shards of {self.path}")
                stored[e.key] = e
        for key, shard in index.weight_map.items():
            if key not in stored or self._refs[key][0] != shard:
                raise CorruptCheckpoint(f"{self.path} places {key!r} in {shard}, which does not hold it")
        raw = index.metadata.get(RECORD_KEY)
        record = parse_record(raw, self.path) if raw is not None else None
        self._entries, self._spec = entries_from_record(record, stored, self.path)

    def _open_file(self, uri: str) -> tuple[list[Entry], TreeSpec | None]:
        head = self.storage.read_range(uri, 0, min(4, self.storage.stat(uri).size))
        archive: _Archive | None = None
        if head == b"PK\x03\x04":
            archive = self._archives[uri] = _Archive(self.storage, uri)
            tree = archive.tree
        else:
            tree = self._load_legacy(uri)
        _check_tree(tree, uri)
        leaves, spec = flatten(tree)
        entries: list[Entry] = []
        first: dict[Any, str] = {}
        for key, leaf in leaves:
            if isinstance(leaf, TensorRef) and archive is not None:
                archive.check(leaf)
                tie = leaf.tie_key()
                dtype, shape = leaf.dtype, leaf.shape
            elif _is_tensor(leaf):
                dtype, shape = _legacy_tensor(uri, key, leaf)
                tie = (leaf.untyped_storage().data_ptr(), dtype, leaf.storage_offset(), shape, leaf.stride())
            else:
                entry, value = _leaf_entry(key, leaf)
                entries.append(entry)
                self._refs[key] = (uri, value)
                continue
            if tie in first and math.prod(shape) > 0:
                entries.append(Entry(key, "link", dtype, shape, target=first[tie]))
            else:
                first.setdefault(tie, key)
                entries.append(Entry(key, "tensor", dtype, shape))
            self._refs[key] = (uri, leaf)
        return entries, _flat_spec(tree, spec)

    def _load_legacy(self, uri: str) -> Any:
        path = self.storage.local_path(uri)
        if path is None:
            raise UnsupportedFormat(
                f"{uri} is a legacy (pre-1.6, non-zip) torch pickle, which can only be read from a local file",
                hint="download it and convert the local copy, or re-save it with a recent torch.save",
            )
        import torch

        self.legacy = True
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            if "weights only" in str(e).lower():
                raise UnsafeCheckpoint(
                    f"{uri}: torch's weights_only loader refused the pickle; nothing was executed "
                    f"({str(e).splitlines()[-1][:300]})"
                ) from None
            raise CorruptCheckpoint(f"{uri} is not a readable torch pickle ({e})") from None
        except Exception as e:
            raise CorruptCheckpoint(f"{uri} is not a readable torch pickle ({type(e).__name__}: {e})") from None

    def entries(self) -> list[Entry]:
        return list(self._entries)

    @property
    def spec(self) -> TreeSpec | None:
        return self._spec

    @property
    def info(self) -> dict[str, Any]:
        return {"files": len(self._files), "legacy_pickle": self.legacy}

    def files(self) -> list[str]:
        return list(self._files)

    def read(self, key: str) -> Any:
        entry = self._by_key.get(key)
        if entry is None:
            raise KeyError(key)
        if entry.kind == "value":
            return entry.value
        if key not in self._refs:  # a link recorded in the index record only
            return self.read(entry.target or "")
        uri, leaf = self._refs[key]
        if isinstance(leaf, TensorRef):
            return _read_ref(self._archives[uri], leaf, self._local.fd(uri))
        if _is_tensor(leaf):
            return leaf.detach().clone()
        return leaf

    def close(self) -> None:
        self._archives = {}
        self._local.close()


def _legacy_tensor(uri: str, key: str, t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    import torch

    if t.layout != torch.strided or t.is_quantized or dtype_name(t.dtype) not in DTYPE_SIZES:
        raise UnsupportedDtype(f"{uri}: {key!r} is a {t.layout} {t.dtype} tensor; ckptconv converts dense tensors")
    return dtype_name(t.dtype), tuple(t.shape)


def _is_tensor(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.Tensor)


# --- writing ---------------------------------------------------------------------------------


class ZipStreamWriter:
    """Writes a zip archive front to back, as ``torch.save`` lays it out, without seeking.

    Members are stored uncompressed, their data aligned to ``alignment`` bytes by an ``FB``
    padding extra field, sizes and CRC in a data descriptor after the data (flag bit 3), and the
    archive always ends with zip64 end records. Members of ``zip64_from`` bytes or more, or
    starting beyond 4 GiB, carry zip64 extra fields.
    """

    def __init__(self, out: HashingWriter, *, alignment: int = 64, zip64_from: int = 0xFFFFFFFF) -> None:
        self.out = out
        self.alignment = alignment
        self.zip64_from = zip64_from
        self.pos = 0
        self.members: list[tuple[bytes, int, int, int]] = []  # name, header offset, crc, size
        self._open: tuple[bytes, int, int, bool] | None = None  # name, header offset, size, zip64
        self._crc = 0
        self._written = 0

    def _emit(self, data: bytes | memoryview) -> None:
        self.out.write(data)
        self.pos += data.nbytes if isinstance(data, memoryview) else len(data)

    def add(self, name: str, data: bytes) -> None:
        self.begin(name, len(data))
        self.feed(data)
        self.end()

    def begin(self, name: str, size: int) -> None:
        if self._open is not None:
            raise RuntimeError("zip member still open")
        raw = name.encode()
        zip64 = size >= self.zip64_from or self.pos >= 0xFFFFFFFF
        extra = struct.pack("<HHQQ", 1, 16, 0, 0) if zip64 else b""
        pad = -(self.pos + 30 + len(raw) + len(extra) + 4) % self.alignment
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding, as torch writes it
        version = 45 if zip64 else 0
        self._emit(struct.pack("<IHHHHHIIIHH", 0x04034B50, version, 0x0808, 0, 0, 0, 0, 0, 0, len(raw), len(extra)))
        self._emit(raw + extra)
        self._open = (raw, self.pos - 30 - len(raw) - len(extra), size, zip64)
        self._crc = 0
        self._written = 0

    def feed(self, data: bytes | memoryview) -> None:
        self._crc = zlib.crc32(data, self._crc)
        self._written += data.nbytes if isinstance(data, memoryview) else len(data)
        self._emit(data)

    def end(self) -> None:
        if self._open is None:
            raise RuntimeError("no zip member open")
        raw, offset, size, zip64 = self._open
        if self._written != size:
            raise RuntimeError(f"zip member {raw!r}: {self._written} bytes written, {size} announced")
        if zip64:
            self._emit(struct.pack("<IIQQ", 0x08074B50, self._crc, size, size))
        else:
            self._emit(struct.pack("<IIII", 0x08074B50, self._crc, size, size))
        self.members.append((raw, offset, self._crc, size))
        self._open = None

    def finish(self) -> None:
        cd_start = self.pos
        for raw, offset, crc, size in self.members:
            big_size = size >= self.zip64_from
            big_offset = offset >= 0xFFFFFFFF
            extra = b""
            if big_size or big_offset:
                fields = (size, size) if big_size else ()
                fields += (offset,) if big_offset else ()
                extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields)
            version = 45 if extra else 0
            self._emit(
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    version,
                    version,
                    0x0808,
                    0,
                    0,
                    0,
                    crc,
                    0xFFFFFFFF if big_size else size,
                    0xFFFFFFFF if big_size else size,
                    len(raw),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    0xFFFFFFFF if big_offset else offset,
                )
            )
            self._emit(raw + extra)
        cd_size = self.pos - cd_start
        n = len(self.members)
        eocd64 = self.pos
        self._emit(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, n, n, cd_size, cd_start))
        self._emit(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
        self._emit(
            struct.pack(
                "<IHHHHIIH",
                0x06054B50,
                0,
                0,
                min(n, 0xFFFF),
                min(n, 0xFFFF),
                min(cd_size, 0xFFFFFFFF),
                min(cd_start, 0xFFFFFFFF),
                0,
            )
        )


class _StorageOut:
    __slots__ = ("dtype", "key", "nbytes")

    def __init__(self, key: str, dtype: str, nbytes: int) -> None:
        self.key = key
        self.dtype = dtype
        self.nbytes = nbytes


class _TensorOut:
    """A placeholder that pickles as torch.save pickles a contiguous tensor of its own storage."""

    __slots__ = ("dtype", "shape", "storage")

    def __init__(self, storage: _StorageOut, dtype: str, shape: tuple[int, ...]) -> None:
        self.storage = storage
        self.dtype = dtype
        self.shape = shape

    def __reduce_ex__(self, protocol: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        from torch import _utils

        stride = []
        step = 1
        for n in reversed(self.shape):
            stride.append(step)
            step *= max(n, 1)
        args = (self.storage, 0, tuple(self.shape), tuple(reversed(stride)), False, collections.OrderedDict())
        if self.dtype in _STORAGE_OF_DTYPE:
            return _utils._rebuild_tensor_v2, args
        return _utils._rebuild_tensor_v3, (*args, torch_dtype(self.dtype))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _StorageOut):
            return None
        import torch

        legacy = _STORAGE_OF_DTYPE.get(obj.dtype)
        if legacy is not None:
            return ("storage", getattr(torch, legacy), obj.key, "cpu", obj.nbytes // DTYPE_SIZES[obj.dtype])
        return ("storage", torch.storage.UntypedStorage, obj.key, "cpu", obj.nbytes)


def pickle_tree(tree: Any) -> bytes:
    """``data.pkl`` for ``tree`` (protocol 2, as torch.save), checked to load under weights_only."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(tree)
    data = buf.getvalue()
    try:
        describe_pickle(data, "output")
    except UnsafeCheckpoint as e:
        raise UnsupportedValue(
            f"a value cannot be saved in a torch pickle that loads with weights_only=True ({e.message})",
            hint="convert to safetensors or cs-h5, which keep such values",
        ) from None
    return data


def _archive_name(uri: str) -> str:
    """The record directory torch.save uses: the file name without its last extension."""
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    return name.rsplit(".", 1)[0] if "." in name else name or "archive"


class _FileOut:
    def __init__(self, uri: str, keys: list[str]) -> None:
        self.uri = uri
        self.keys = keys  # every key of this file's state dict (tensors and links)
        self.prefix = _archive_name(uri)
        self.storage_ids: dict[str, str] = {}  # data key -> storage record name
        self.pkl: bytes | None = None  # written first unless it waits for objects


class TorchSink(ShardedSink):
    """Writes ``pytorch_model.bin`` or shards + index under a directory/prefix, or one named file.

    Options: ``shard_size`` (bytes or "5GB"; None writes one file), ``always_sharded`` (shard names
    and an index even for one shard). Links share their target's
    storage. Values live in ``data.pkl`` (single file) or in the index's ``ckptconv`` record
    (shards). Objects are accepted only as decoded ``pickle`` payloads of values that
    ``weights_only=True`` loads (what :class:`TorchSource` produces for dtypes, bytes, ...), and
    only in a single file; ``data.pkl`` then goes last, once their values have arrived.
    """

    format = "torch"
    supports_links = True
    supports_objects = True
    supported_dtypes = None
    zip64_from = 0xFFFFFFFF  # records this large carry zip64 fields (tests lower it)

    def __init__(self, storage: Storage, uri: str, **options: Any) -> None:
        super().__init__(storage, uri, **options)
        self._files: list[_FileOut] = []
        self._order: list[str] = []
        self._next = 0
        self._file_of: dict[str, int] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._leaves: dict[str, Any] = {}  # key -> what data.pkl holds for it
        self._objects: dict[str, list[str]] = {}  # object key -> keys holding its value (itself, links)
        self._spec: TreeSpec | None = None
        self._keys: list[str] = []
        self._current = -1
        self._zip: ZipStreamWriter | None = None
        self._index: tuple[str, bytes] | None = None

    @classmethod
    def check(cls, entries: Any) -> None:
        entries = list(entries)
        super().check(entries)
        for e in entries:
            if e.kind == "object" and e.meta.get("encoding") != "pickle":
                raise UnsupportedValue(
                    f"{e.key!r} is an opaque {e.meta.get('encoding', 'dill')} object, which a torch pickle "
                    "loaded with weights_only=True cannot hold",
                    hint="convert to safetensors or cs-h5, which keep opaque objects",
                    key=e.key,
                )
            if e.kind == "value" and not plain_value(e.value):
                raise UnsupportedValue(f"{e.key!r} holds a {type(e.value).__name__}, not a plain value", key=e.key)

    def begin(self, entries: list[Entry], spec: TreeSpec | None) -> None:
        self.check(entries)
        by_key = {e.key: e for e in entries}
        tensors = [e for e in entries if e.kind in ("tensor", "array", "link")]
        files, index_uri = self.shard_files(tensors, _SUFFIXES)
        weight_map: dict[str, str] = {}
        total = 0
        leaves = self._leaves
        for i, f in enumerate(files):
            out = _FileOut(f.uri, f.keys)
            for key in f.keys:
                e = by_key[key]
                weight_map[key] = f.uri.rsplit("/", 1)[-1]
                if e.kind == "link":
                    continue
                out.storage_ids[key] = str(len(out.storage_ids))
                storage = _StorageOut(out.storage_ids[key], str(e.dtype), e.nbytes)
                leaves[key] = _TensorOut(storage, str(e.dtype), tuple(e.shape or ()))
                self._file_of[key] = i
                self._meta[key] = (str(e.dtype), tuple(e.shape or ()))
                total += e.nbytes
            self._files.append(out)
        for e in entries:
            if e.kind == "value":
                leaves[e.key] = e.value
            elif e.kind == "object":
                self._objects[e.key] = [e.key]
                leaves[e.key] = None
        for e in entries:  # a link holds the very object its root holds: torch.load restores the tie
            if e.kind == "link":
                root = resolve_link(e.key, by_key)
                if root is None or root not in leaves:
                    raise UnsupportedValue(f"link {e.key!r} points at nothing this checkpoint holds", key=e.key)
                leaves[e.key] = leaves[root]
                if root in self._objects:
                    self._objects[root].append(e.key)
        self._spec = spec
        self._keys = [e.key for e in entries]
        if index_uri is not None:
            if self._objects:
                raise UnsupportedValue("objects cannot be stored in sharded torch pickles; write one file")
            record = build_record(entries, spec)
            extra = {RECORD_KEY: record} if record is not None else None
            self._index = (index_uri, index_bytes(weight_map, total, extra))
            for out in self._files:
                out.pkl = pickle_tree(collections.OrderedDict((k, leaves[k]) for k in out.keys))
        else:
            if spec is not None and sorted(spec.keys()) != sorted(leaves):
                raise UnsupportedValue("the tree spec does not describe the same keys as the entries")
            pkl = pickle_tree(self._tree())  # refuses what weights_only could not load, before any data
            self._files[0].pkl = None if self._objects else pkl
        self._order = [e.key for e in entries if e.kind != "link"]

    def _tree(self) -> Any:
        if self._spec is None:
            return collections.OrderedDict((k, self._leaves[k]) for k in self._keys)
        leaf_keys = self._spec.keys()
        return unflatten([self._leaves[k] for k in leaf_keys], self._spec)

    def write(self, key: str, value: Any) -> None:
        if self._next >= len(self._order) or self._order[self._next] != key:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing"
            raise RuntimeError(f"torch sink: write({key!r}) out of order, expected {expected}")
        self._next += 1
        if key in self._objects:
            if not isinstance(value, OpaqueObject) or not value.decoded:
                raise UnsupportedValue(f"object {key!r} was not decoded; a torch pickle cannot hold its bytes", key=key)
            for k in self._objects[key]:
                self._leaves[k] = value.value
            return
        if key not in self._file_of:
            return  # a value: data.pkl (or the index record) holds it already
        dtype, shape = self._meta[key]
        if dtype_name(value.dtype) != dtype or tuple(value.shape) != shape:
            raise CorruptCheckpoint(
                f"{key!r}: got {dtype_name(value.dtype)}{list(value.shape)}, {dtype}{list(shape)} was announced",
                key=key,
            )
        i = self._file_of[key]
        zw = self._zip_for(i)
        out = self._files[i]
        data = tensor_view(value)
        zw.begin(f"{out.prefix}/data/{out.storage_ids[key]}", data.nbytes)
        zw.feed(data)
        zw.end()

    def _zip_for(self, i: int) -> ZipStreamWriter:
        """The archive of file ``i``, finishing earlier files and starting any not yet started."""
        while self._current < i:
            if self._zip is not None:
                self._finish(self._files[self._current], self._zip)
                self._outputs.close(self._zip.out)
            self._current += 1
            out = self._files[self._current]
            self._zip = ZipStreamWriter(self._outputs.create(out.uri), zip64_from=self.zip64_from)
            # The member order of torch.save: data.pkl and format records, storages, version, id.
            if out.pkl is not None:
                self._zip.add(f"{out.prefix}/data.pkl", out.pkl)
            self._zip.add(f"{out.prefix}/.format_version", b"1")
            self._zip.add(f"{out.prefix}/.storage_alignment", b"64")
            self._zip.add(f"{out.prefix}/byteorder", b"little")
        assert self._zip is not None
        return self._zip

    def _finish(self, out: _FileOut, zw: ZipStreamWriter) -> None:
        if out.pkl is None:
            zw.add(f"{out.prefix}/data.pkl", pickle_tree(self._tree()))
        zw.add(f"{out.prefix}/version", b"3\n")
        # torch writes 40 decimal digits identifying the save; any such string loads.
        zw.add(f"{out.prefix}/.data/serialization_id", str(secrets.randbits(128)).zfill(40).encode())
        zw.finish()

    def commit(self) -> list[OutputFile]:
        if self._next != len(self._order):
            raise RuntimeError(f"torch sink: commit after {self._next} of {len(self._order)} writes")
        try:
            zw = self._zip_for(len(self._files) - 1)
            self._finish(self._files[-1], zw)
            self._zip = None
            if self._index is not None:
                uri, text = self._index
                self._outputs.create(uri, role="index").write(text)
        except BaseException:
            self.abort()
            raise
        return self._outputs.commit()

    def abort(self) -> None:
        self._zip = None
        self._outputs.abort()
