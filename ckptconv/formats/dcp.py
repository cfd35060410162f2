"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``, DCP) as a source.

A DCP is a directory (or prefix) holding ``.metadata`` and ``*.distcp`` files: what FSDP2,
torchtitan and other distributed trainings write. ``.metadata`` is a pickle of DCP's ``Metadata``:
for every flattened key (``model.layers.0.attention.wq.weight``, ``optimizer.state...``) the
tensor's global size, dtype and the chunks the ranks saved (offsets and sizes), and where each
chunk's record sits (file, byte offset, length). Every record is a ``torch.save`` archive of one
chunk (or, saved with ``serialization_format=SAFETENSORS``, a tensor of the safetensors data that
ends the file); non-tensor values (step counters, hyperparameters) are ``torch.save`` archives.

Reading never calls ``pickle.load`` or ``torch.load``:

- ``.metadata`` goes through :func:`ckptconv.formats.restricted_pickle.loads` with the DCP classes
  it names mapped to inert records (``DCP_METADATA`` of :mod:`ckptconv.formats.pickle_allowlist`);
  anything else in it is refused (:class:`~ckptconv.core.errors.UnsafeCheckpoint`);
- each record is read as a zip archive inside its ``.distcp`` file by the ``torch.save`` reader
  (:mod:`ckptconv.formats.torch_archive`): its ``data.pkl`` is described by the weights-only
  allowlist, its bytes read with ranged reads.

``read(key)`` allocates the tensor once and copies each chunk into its place, one chunk at a
time: memory is the tensor plus its largest chunk, whatever the number of ranks. Chunks must lie
inside the tensor and cover it exactly (no two overlap, their volumes add up to the tensor's), and a
tensor may not need more bytes than the checkpoint's files hold, else the checkpoint
is refused as corrupt. The keys are DCP's flattened names, in a flat dict (the nesting recorded in
``planner_data`` is not rebuilt). Records written with DCP's stream extensions (compression) are
refused with a hint.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ckptconv.core.errors import CorruptCheckpoint, UnsupportedFormat, UnsupportedValue
from ckptconv.core.uri import basename, parent
from ckptconv.formats import restricted_pickle
from ckptconv.formats.base import Entry, TensorSource, dtype_name
from ckptconv.formats.memory import empty_tensor
from ckptconv.formats.pickle_allowlist import (
    DcpBytesStorage,
    DcpChunk,
    DcpIndex,
    DcpMetadata,
    DcpStorageInfo,
    DcpTensorProperties,
    DcpTensorStorage,
    TensorRef,
    TorchDtype,
)
from ckptconv.formats.safetensors_fmt import read_header
from ckptconv.formats.sharding import LocalFiles, Slot, read_slot
from ckptconv.formats.torch_archive import Archive, read_ref
from ckptconv.formats.torch_pickle import leaf_entry

if TYPE_CHECKING:
    import torch

    from ckptconv.storage.base import Storage

METADATA = ".metadata"
ZIP_MAGIC = b"PK\x03\x04"  # a torch.save record; else DCP's safetensors serialization
MAX_METADATA_BYTES = 512 << 20  # a few MB for a model with thousands of keys and hundreds of ranks


def read_metadata(data: bytes, where: str) -> DcpMetadata:
    """The ``Metadata`` of a DCP, as inert records (see the module docstring)."""
    meta = restricted_pickle.loads(data, what=where, dcp_metadata=True)
    if not isinstance(meta, DcpMetadata) or not isinstance(meta.get("state_dict_metadata"), dict):
        raise CorruptCheckpoint(f"{where} does not hold a distributed checkpoint's Metadata")
    if not isinstance(meta.get("storage_data"), dict):
        raise CorruptCheckpoint(f"{where} has no storage index (storage_data)")
    return meta


# --- the source -------------------------------------------------------------------------------


class _Chunk:
    """One saved piece of a tensor: where it goes and where its record is."""

    __slots__ = ("file", "length", "offset", "offsets", "sizes")

    def __init__(self, offsets: tuple[int, ...], sizes: tuple[int, ...], file: str, offset: int, length: int) -> None:
        self.offsets, self.sizes, self.file, self.offset, self.length = offsets, sizes, file, offset, length


class DcpSource(TensorSource):
    """A PyTorch distributed checkpoint: a directory or prefix with ``.metadata`` (or that file)."""

    format = "dcp"

    def __init__(self, storage: Storage, uri: str, **options: Any) -> None:
        super().__init__(storage, uri)
        self._local = LocalFiles(storage)
        root = uri.rstrip("/")
        if basename(root) == METADATA:
            root = parent(root)
        self.root = root
        self.metadata_uri = storage.join(root, METADATA)
        size = storage.stat(self.metadata_uri).size
        if size > MAX_METADATA_BYTES:
            raise CorruptCheckpoint(f"{self.metadata_uri} is larger than {MAX_METADATA_BYTES} bytes")
        meta = read_metadata(storage.read_range(self.metadata_uri, 0, size), self.metadata_uri)
        self.version = meta.get("version")
        self._sizes: dict[str, int] = {}
        self._entries: list[Entry] = []
        self._chunks: dict[str, list[_Chunk]] = {}
        self._values: dict[str, Any] = {}
        self._headers: dict[tuple[str, int], Any] = {}  # (file, offset) -> safetensors Header
        where = self._locations(meta.storage_data)
        for key, md in meta.state_dict_metadata.items():
            if not isinstance(key, str):
                raise CorruptCheckpoint(f"{self.metadata_uri}: a key that is not a string ({type(key).__name__})")
            if isinstance(md, DcpTensorStorage):
                self._entries.append(self._tensor(key, md, where))
            elif isinstance(md, DcpBytesStorage):
                entry, value = self._value(key, where.get((key, None)))
                self._entries.append(entry)
                self._values[key] = value
            else:
                raise CorruptCheckpoint(f"{self.metadata_uri}: {key!r} has unknown storage metadata")
        self._by_key = {e.key: e for e in self._entries}

    def _file(self, name: Any) -> str:
        if not isinstance(name, str) or not name:
            raise CorruptCheckpoint(f"{self.metadata_uri}: a record names no file")
        uri = self.storage.join(self.root, name)  # refuses names that would leave the checkpoint
        if uri not in self._sizes:
            self._sizes[uri] = self.storage.stat(uri).size
        return uri

    def _locations(self, storage_data: dict[Any, Any]) -> dict[tuple[str, tuple[int, ...] | None], _Chunk]:
        """(key, chunk offsets or None for values) -> the record's file and byte range."""
        out: dict[tuple[str, tuple[int, ...] | None], _Chunk] = {}
        for index, info in storage_data.items():
            if not isinstance(index, DcpIndex) or not isinstance(info, DcpStorageInfo):
                raise CorruptCheckpoint(f"{self.metadata_uri}: the storage index holds something else")
            if info.get("transform_descriptors"):
                raise UnsupportedFormat(
                    f"{self.metadata_uri}: {index.get('fqn')!r} was saved through DCP stream extensions "
                    f"({', '.join(map(str, info.transform_descriptors))})",
                    hint="save the checkpoint again without extensions (no compression), or load it with "
                    "torch.distributed.checkpoint and save it with torch.save",
                )
            file = self._file(info.get("relative_path"))
            offset, length = info.get("offset"), info.get("length")
            if type(offset) is not int or type(length) is not int or offset < 0 or length <= 0:
                raise CorruptCheckpoint(f"{self.metadata_uri}: a record has a bad byte range")
            if offset + length > self._sizes[file]:
                raise CorruptCheckpoint(f"{file}: a record runs past the end of the file")
            fqn, chunk_offsets = index.get("fqn"), index.get("offset")
            if not isinstance(fqn, str):
                raise CorruptCheckpoint(f"{self.metadata_uri}: the storage index names a key that is not a string")
            dims = None if chunk_offsets is None else self._dims(chunk_offsets, f"the record offsets of {fqn!r}")
            out[(fqn, dims)] = _Chunk(dims or (), (), file, offset, length)
        return out

    def _dims(self, value: Any, what: str) -> tuple[int, ...]:
        """A size or offsets from the metadata: non-negative plain integers, else corrupt."""
        if not isinstance(value, tuple | list) or not all(type(i) is int and i >= 0 for i in value):
            raise CorruptCheckpoint(f"{self.metadata_uri}: {what}: expected non-negative integers, found {value!r:.80}")
        return tuple(value)

    def _tensor(self, key: str, md: DcpTensorStorage, where: dict[Any, _Chunk]) -> Entry:
        props = md.get("properties")
        if not isinstance(props, DcpTensorProperties) or md.get("size") is None:
            raise CorruptCheckpoint(f"{self.metadata_uri}: {key!r} has no dtype or size")
        shape = self._dims(md.size, f"the size of {key!r}")
        if props.get("layout") not in (None, "torch.strided"):
            raise UnsupportedFormat(f"{self.metadata_uri}: {key!r} is a {props.layout} tensor; only dense ones convert")
        if not isinstance(props.get("dtype"), TorchDtype):
            raise CorruptCheckpoint(f"{self.metadata_uri}: {key!r} has no dtype")
        import torch

        torch_dtype = getattr(torch, props.dtype.name)
        dtype = dtype_name(torch_dtype)  # an alias (torch.float) by its name (float32)
        # Every element is stored at least once (stream extensions are refused): a size beyond the
        # checkpoint's bytes is a lie, refused before anything is allocated for it.
        nbytes = math.prod(shape) * torch_dtype.itemsize
        if nbytes > sum(self._sizes.values()):
            raise CorruptCheckpoint(
                f"{self.metadata_uri}: {key!r} of size {list(shape)} needs {nbytes} bytes, more than the "
                f"checkpoint's files hold"
            )
        listed = md.get("chunks")
        if not isinstance(listed, list | tuple):
            raise CorruptCheckpoint(f"{self.metadata_uri}: {key!r} has no list of chunks")
        chunks = []
        covered = 0
        for c in listed:
            if not isinstance(c, DcpChunk):
                raise CorruptCheckpoint(f"{self.metadata_uri}: {key!r} lists something else as a chunk")
            offsets = self._dims(c.get("offsets"), f"the chunk offsets of {key!r}")
            sizes = self._dims(c.get("sizes"), f"the chunk sizes of {key!r}")
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise CorruptCheckpoint(f"{self.metadata_uri}: a chunk of {key!r} has a bad shape")
            if any(o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
                raise CorruptCheckpoint(f"{self.metadata_uri}: a chunk of {key!r} lies outside its {list(shape)}")
            loc = where.get((key, offsets))
            if loc is None:
                raise CorruptCheckpoint(f"{self.metadata_uri}: the chunk of {key!r} at {list(offsets)} has no record")
            chunks.append(_Chunk(offsets, sizes, loc.file, loc.offset, loc.length))
            covered += math.prod(sizes)
        if covered != math.prod(shape):
            raise CorruptCheckpoint(
                f"{self.metadata_uri}: the chunks of {key!r} hold {covered} elements, its size {list(shape)} "
                f"has {math.prod(shape)}",
                hint="a rank's files may be missing, or the checkpoint was not finished",
            )
        _refuse_overlaps(self.metadata_uri, key, chunks)
        self._chunks[key] = chunks
        return Entry(key, "tensor", dtype, shape)

    def _archive(self, chunk: _Chunk) -> Archive:
        return Archive(self.storage, chunk.file, base=chunk.offset, size=chunk.length)

    def _value(self, key: str, loc: _Chunk | None) -> tuple[Entry, Any]:
        if loc is None:
            raise CorruptCheckpoint(f"{self.metadata_uri}: the value {key!r} has no record")
        tree = self._archive(loc).tree
        if isinstance(tree, TensorRef):
            raise UnsupportedValue(f"{key!r} is a tensor saved as an object; not supported in a DCP")
        if isinstance(tree, dict | list | tuple):
            raise UnsupportedValue(f"{key!r} holds a {type(tree).__name__}, which DCP saves flattened; refused")
        return leaf_entry(key, tree)

    def entries(self) -> list[Entry]:
        return list(self._entries)

    @property
    def info(self) -> dict[str, Any]:
        files = {c.file for chunks in self._chunks.values() for c in chunks}
        return {"dcp_version": self.version, "files": len(files) + 1, "chunks": sum(map(len, self._chunks.values()))}

    def files(self) -> list[str]:
        return [self.metadata_uri, *sorted(self._sizes)]

    def read(self, key: str) -> Any:
        entry = self._by_key.get(key)
        if entry is None:
            raise KeyError(key)
        if entry.kind != "tensor":
            return self._values[key]

        assert entry.shape is not None and entry.dtype is not None
        out = empty_tensor(entry.shape, entry.dtype)
        for chunk in self._chunks[key]:
            part = self._read_chunk(key, entry, chunk)
            region = out
            for dim, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                region = region.narrow(dim, o, s)
            region.copy_(part)
            del part, region  # one chunk in memory besides the tensor
        return out

    def _read_chunk(self, key: str, entry: Entry, chunk: _Chunk) -> torch.Tensor:
        fd = self._local.fd(chunk.file)
        if self.storage.read_range(chunk.file, chunk.offset, 4) != ZIP_MAGIC:
            return read_slot(self.storage, self._safetensors_slot(key, entry, chunk), fd)
        archive = self._archive(chunk)
        ref = archive.tree
        if not isinstance(ref, TensorRef):
            raise CorruptCheckpoint(f"{chunk.file}: the record of {key!r} at {list(chunk.offsets)} is not a tensor")
        self._check_record(key, entry, chunk, ref.dtype, tuple(ref.shape))
        archive.check(ref)
        return read_ref(archive, ref, fd)

    def _safetensors_slot(self, key: str, entry: Entry, chunk: _Chunk) -> Slot:
        """A chunk saved with ``serialization_format=SAFETENSORS``: the record is a tensor of the
        safetensors file that starts at the record's offset (one chunk per key in each file)."""
        where = (chunk.file, chunk.offset)
        if where not in self._headers:
            self._headers[where] = read_header(self.storage, chunk.file, base=chunk.offset)
        slot = self._headers[where].slots.get(key)
        if slot is None:
            raise CorruptCheckpoint(f"{chunk.file}: the safetensors data at byte {chunk.offset} has no {key!r}")
        self._check_record(key, entry, chunk, slot.dtype, slot.shape)
        return slot

    def _check_record(self, key: str, entry: Entry, chunk: _Chunk, dtype: str | None, shape: tuple) -> None:
        if dtype != entry.dtype or shape != chunk.sizes:
            raise CorruptCheckpoint(
                f"{chunk.file}: the record of {key!r} at {list(chunk.offsets)} holds {dtype}{list(shape)}, "
                f"the metadata says {entry.dtype}{list(chunk.sizes)}"
            )

    def close(self) -> None:
        self._local.close()


def _refuse_overlaps(where: str, key: str, chunks: list[_Chunk]) -> None:
    """Chunks inside a tensor whose volumes add up to it cover it only if no two overlap: else some
    elements are never written and the output would carry uninitialized memory. Swept along dim 0
    (how FSDP shards), so chunks that split dim 0 compare only with their neighbours."""
    boxes = sorted((c for c in chunks if math.prod(c.sizes)), key=lambda c: c.offsets[:1])
    active: list[_Chunk] = []
    for c in boxes:
        start = c.offsets[0] if c.offsets else 0
        active = [a for a in active if not a.offsets or a.offsets[0] + a.sizes[0] > start]
        for a in active:
            if all(o < p + t and p < o + s for o, s, p, t in zip(c.offsets, c.sizes, a.offsets, a.sizes, strict=True)):
                raise CorruptCheckpoint(
                    f"{where}: the chunks of {key!r} at {list(a.offsets)} and {list(c.offsets)} overlap, so "
                    "part of the tensor is not saved",
                    hint="a rank's files may be missing, or the checkpoint was not finished",
                )
        active.append(c)
