"""PyTorch pickles (``torch.save``): single files and shards with ``pytorch_model.bin.index.json``.

Reading (zip format, PyTorch >= 1.6) never calls ``torch.load``: :mod:`ckptconv.formats.torch_archive`
describes ``data.pkl`` through the one restricted unpickler and reads each tensor's bytes with one
ranged read, locally or on S3, so ``entries()`` is metadata only. A file that is not a zip archive
is read by its first pickle, through the same unpickler: the legacy (pre-1.6) ``torch.save`` magic
number means a legacy file, read locally with ``torch.load(weights_only=True)``, which loads it
whole; any other pickle of plain data is refused as UnsupportedFormat (it is not a checkpoint
``torch.save`` wrote), whatever its protocol, and one naming anything outside the allowlist as
UnsafeCheckpoint.

Nested pickles are flattened with :func:`ckptconv.formats.tree.flatten`; non-tensor leaves become
``value`` entries (None, bool, int, float, str) or ``object`` entries (bytes, complex, torch
dtypes and devices, as a protocol-2 pickle payload); a tensor that is the same view of the same
storage as an earlier one becomes a ``link`` to it.

Writing streams the zip archive itself (:class:`~ckptconv.formats.zip_stream.ZipStreamWriter`)
with the member layout ``torch.save`` uses (``data.pkl`` first, storages 64-byte aligned, data
descriptors, zip64 records), one tensor at a time: ``data.pkl`` depends only on the announced
entries, so it is written before any tensor (after them only when the checkpoint holds objects,
whose values arrive with the data), and it is checked by the reader, so it loads with
``torch.load(weights_only=True)``. Links share their target's storage, so ``torch.load`` restores
the tie. Each finished file is committed under the sink's URI (a staging prefix the engine
publishes); ``abort`` removes them all.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import io
import math
import pickle
from typing import TYPE_CHECKING, Any

from ckptconv.core.dtypes import DTYPE_SIZES
from ckptconv.core.errors import (
    CorruptCheckpoint,
    UnsafeCheckpoint,
    UnsupportedDtype,
    UnsupportedFormat,
    UnsupportedValue,
)
from ckptconv.core.uri import basename
from ckptconv.formats.base import (
    Entry,
    OpaqueObject,
    OutputFile,
    TensorSource,
    dtype_name,
    value_dtype,
)
from ckptconv.formats.hf_record import (
    RECORD_KEY,
    build_record,
    entries_from_record,
    parse_record,
    plain_value,
)
from ckptconv.formats.layout import FileLayout, LayoutRecorder
from ckptconv.formats.links import link_root
from ckptconv.formats.listed_entries import ListedEntries
from ckptconv.formats.pickle_allowlist import STORAGE_OF_DTYPE, StorageRef, TensorRef, TorchDtype
from ckptconv.formats.registry import FORMATS
from ckptconv.formats.restricted_pickle import load_stream
from ckptconv.formats.sharding import (
    TORCH,
    LocalFiles,
    ShardedSink,
    find_checkpoint,
    index_bytes,
    read_index,
    tensor_view,
)
from ckptconv.formats.torch_archive import Archive, check_tree, describe_pickle, read_ref
from ckptconv.formats.tree import TreeSpec, flatten, unflatten
from ckptconv.formats.zip_stream import ZipStreamWriter

if TYPE_CHECKING:
    import torch

    from ckptconv.storage.base import Storage

_SUFFIXES = FORMATS["torch"].suffixes
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of a legacy (pre-1.6) torch.save file

# --- reading ---------------------------------------------------------------------------------


def leaf_entry(key: str, leaf: Any) -> tuple[Entry, Any]:
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


class TorchSource(ListedEntries, TensorSource):
    """A ``torch.save`` file, a ``pytorch_model.bin.index.json``, or a directory/prefix holding one."""

    format = "torch"

    def __init__(self, storage: Storage, uri: str, **options: Any) -> None:
        super().__init__(storage, uri)
        self.path = find_checkpoint(storage, uri, TORCH, FORMATS["torch"].names)
        self._local = LocalFiles(storage)
        self._archives: dict[str, Archive] = {}
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
        archive: Archive | None = None
        if head == b"PK\x03\x04":
            archive = self._archives[uri] = Archive(self.storage, uri)
            tree = archive.tree
        else:
            tree = self._load_legacy(uri)
        check_tree(tree, uri)
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
                entry, value = leaf_entry(key, leaf)
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
        # The first pickle tells a legacy torch.save file (its magic number) from a plain pickle,
        # read by the restricted unpickler, so every protocol of the same data ends alike.
        with self.storage.open_reader(uri) as reader:
            head = load_stream(reader, what=uri)
        if type(head) is not int or head != LEGACY_MAGIC:
            raise UnsupportedFormat(
                f"{uri} is a pickle of plain data ({type(head).__name__}), not a checkpoint written by torch.save",
                hint="save the state dict with torch.save, or convert it to safetensors where it was made",
            )
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

    @property
    def info(self) -> dict[str, Any]:
        return {"files": len(self._files), "legacy_pickle": self.legacy}

    def files(self) -> list[str]:
        return list(self._files)

    def read(self, key: str) -> Any:
        entry = self._listed(key)
        if entry.kind == "value":
            return entry.value
        if key not in self._refs:  # a link recorded in the index record only
            return self.read(entry.target or "")
        uri, leaf = self._refs[key]
        if isinstance(leaf, TensorRef):
            return read_ref(self._archives[uri], leaf, self._local.fd(uri))
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


class _TorchGlobal:
    """A torch global that ``data.pkl`` names (a rebuild function, a storage class, a dtype): pickled
    as the reference ``module.name`` that pickle writes for the real object, without importing
    torch (about 1.5 s of CPU and 200 MB in a process that only moves a tensor's bytes)."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name


@functools.cache
def _torch_global(module: str, name: str) -> _TorchGlobal:
    # One object per name: pickle memoizes it, so a second use is a reference, as with torch's own.
    return _TorchGlobal(module, name)


class _TensorOut:
    """A placeholder that pickles as torch.save pickles a contiguous tensor of its own storage."""

    __slots__ = ("dtype", "shape", "storage")

    def __init__(self, storage: StorageRef, dtype: str, shape: tuple[int, ...]) -> None:
        self.storage = storage
        self.dtype = dtype
        self.shape = shape

    def reduction(self) -> tuple[_TorchGlobal, tuple[Any, ...]]:
        """The function and arguments torch.save pickles such a tensor with."""
        stride = []
        step = 1
        for n in reversed(self.shape):
            stride.append(step)
            step *= max(n, 1)
        args = (self.storage, 0, tuple(self.shape), tuple(reversed(stride)), False, collections.OrderedDict())
        if self.dtype in STORAGE_OF_DTYPE:
            return _torch_global("torch._utils", "_rebuild_tensor_v2"), args
        return _torch_global("torch._utils", "_rebuild_tensor_v3"), (*args, _torch_global("torch", self.dtype))


class _Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """Pickles as torch.save does (protocol 2) with torch's globals named, not imported: the
    pure-Python pickler, as only it lets a stand-in write a global of another module's name."""

    dispatch = pickle._Pickler.dispatch.copy()  # type: ignore[attr-defined]

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, StorageRef):
            return None
        legacy = STORAGE_OF_DTYPE.get(obj.dtype)
        if legacy is not None:
            return ("storage", _torch_global("torch", legacy), obj.key, "cpu", obj.nbytes // DTYPE_SIZES[obj.dtype])
        return ("storage", _torch_global("torch.storage", "UntypedStorage"), obj.key, "cpu", obj.nbytes)

    def _save_torch_global(self, obj: _TorchGlobal) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    def _save_tensor(self, obj: _TensorOut) -> None:
        # What save_reduce writes, which refuses a function that is not callable.
        func, args = obj.reduction()
        self.save(func)
        self.save(args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    dispatch[_TorchGlobal] = _save_torch_global
    dispatch[_TensorOut] = _save_tensor


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
    name = basename(uri)
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
    supports_objects = False  # opaque bytes: weights_only loads none (decoded plain data is kept)
    supported_dtypes = None
    accepts_raw = True  # a storage member is the tensor's bytes; data.pkl names torch without it
    zip64_from = 0xFFFFFFFF  # records this large carry zip64 fields (tests lower it)

    def __init__(self, storage: Storage, uri: str, **options: Any) -> None:
        super().__init__(storage, uri, **options)
        self._files: list[_FileOut] = []
        self._file_of: dict[str, int] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._leaves: dict[str, Any] = {}  # key -> what data.pkl holds for it
        self._objects: dict[str, list[str]] = {}  # object key -> keys holding its value (itself, links)
        self._spec: TreeSpec | None = None
        self._keys: list[str] = []
        self._current = -1
        self._zip: ZipStreamWriter | None = None
        self._index: tuple[str, bytes] | None = None
        self._laid_out: list[tuple[FileLayout, bytes]] | None = None  # a skeleton's files (see reserve)
        self._planned = 0  # the archives' tensor bytes and pickles (see planned_local_bytes)

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

    def _begin(self, entries: list[Entry], spec: TreeSpec | None) -> None:
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
                weight_map[key] = basename(f.uri)
                if e.kind == "link":
                    continue
                out.storage_ids[key] = str(len(out.storage_ids))
                storage = StorageRef(out.storage_ids[key], str(e.dtype), e.nbytes)
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
                root = link_root(e.key, by_key)
                if root not in leaves:
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
        self._planned = total + sum(len(out.pkl or b"") for out in self._files)
        if self._index is not None:
            self._planned += len(self._index[1])

    def planned_local_bytes(self) -> int:
        """The tensors' bytes, the pickles and the index: all but the zip records around them (a
        few dozen bytes a member), so at least what the archives take."""
        return self._planned

    def _tree(self) -> Any:
        if self._spec is None:
            return collections.OrderedDict((k, self._leaves[k]) for k in self._keys)
        leaf_keys = self._spec.keys()
        return unflatten([self._leaves[k] for k in leaf_keys], self._spec)

    def _write(self, key: str, value: Any) -> None:
        if key in self._objects:
            if not isinstance(value, OpaqueObject) or not value.decoded:
                raise UnsupportedValue(f"object {key!r} was not decoded; a torch pickle cannot hold its bytes", key=key)
            for k in self._objects[key]:
                self._leaves[k] = value.value
            return
        if key not in self._file_of:
            return  # a value: data.pkl (or the index record) holds it already
        dtype, shape = self._meta[key]
        if value_dtype(value) != dtype or tuple(value.shape) != shape:
            raise CorruptCheckpoint(
                f"{key!r}: got {value_dtype(value)}{list(value.shape)}, {dtype}{list(shape)} was announced",
                key=key,
            )
        i = self._file_of[key]
        zw = self._zip_for(i)
        out = self._files[i]
        data = tensor_view(value)
        zw.begin(f"{out.prefix}/data/{out.storage_ids[key]}", data.nbytes)
        zw.feed(data)
        zw.end()

    # --- the layout, for outputs written by several processes (ckptconv.engine.fanout) --------------

    def placed_keys(self) -> set[str]:
        """Tensors: each a stored member (its data and CRC placed up front); values live in data.pkl."""
        return set(self._file_of)

    def _reserve(self, key: str) -> None:
        if self._laid_out is None:
            self._laid_out = []
        i = self._file_of[key]
        zw = self._zip_for(i)
        out = self._files[i]
        zw.reserve(f"{out.prefix}/data/{out.storage_ids[key]}", self._leaves[key].storage.nbytes, key)

    def _finish_skeleton(self) -> list[tuple[FileLayout, bytes]]:
        """Each archive's layout (its members' data and CRC fields spans, the central directory its
        tail) and gap bytes; a local output file is created preallocated; the index is written whole."""
        if self._laid_out is None:
            self._laid_out = []
        try:
            self._finish(self._files[-1], self._zip_for(len(self._files) - 1))
            self._zip = None
        except BaseException:
            self.abort()
            raise
        return self._lay_out(self._laid_out, [b""] * len(self._laid_out), self._index)

    def _zip_for(self, i: int) -> ZipStreamWriter:
        """The archive of file ``i``, finishing earlier files and starting any not yet started."""
        while self._current < i:
            if self._zip is not None:
                self._finish(self._files[self._current], self._zip)
                if self._laid_out is None:
                    self._outputs.close(self._zip.out)
            self._current += 1
            out = self._files[self._current]
            sink = self._outputs.create(out.uri) if self._laid_out is None else LayoutRecorder(out.uri)
            self._zip = ZipStreamWriter(sink, zip64_from=self.zip64_from)
            # The member order of torch.save: data.pkl and format records, storages, version, id.
            if out.pkl is not None:
                self._zip.add(f"{out.prefix}/data.pkl", out.pkl)
            self._zip.add(f"{out.prefix}/.format_version", b"1")
            self._zip.add(f"{out.prefix}/.storage_alignment", b"64")
            self._zip.add(f"{out.prefix}/byteorder", b"little")
        assert self._zip is not None
        return self._zip

    def _finish(self, out: _FileOut, zw: ZipStreamWriter) -> None:
        pkl = out.pkl
        if pkl is None:
            pkl = pickle_tree(self._tree())
            zw.add(f"{out.prefix}/data.pkl", pkl)
        zw.add(f"{out.prefix}/version", b"3\n")
        # torch writes 40 decimal digits identifying the save; any such string loads. Derived from
        # what the archive holds, so a conversion run again (or by several processes) writes the
        # same bytes.
        digest = hashlib.sha256(out.prefix.encode() + b"\0" + pkl)
        for key in out.keys:
            if key in self._meta:
                digest.update(repr((key, self._meta[key])).encode())
        zw.add(f"{out.prefix}/.data/serialization_id", str(int(digest.hexdigest()[:32], 16)).zfill(40).encode())
        zw.finish()
        if isinstance(zw.out, LayoutRecorder) and self._laid_out is not None:
            self._laid_out.append((zw.out.layout(tail=zw.cd_start, checksum="crc32"), bytes(zw.out.gaps)))

    def _commit(self) -> list[OutputFile]:
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

    def _abort(self) -> None:
        self._zip = None
        super()._abort()
