"""safetensors: single files and shards with ``model.safetensors.index.json``, local or on S3.

File layout (the safetensors specification): an 8-byte little-endian header length N, N bytes
of JSON ``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
padded with spaces, then the data area, which the tensors cover exactly (no holes, no overlap).
JSON whitespace may pad the header on either side: writers pad the end (8-byte alignment of the
data area) and the reference reader accepts leading whitespace too, so this one does.

Reading parses the header with ranged reads, validates every size and offset before use, and
reads one tensor with one ranged read (on S3 nothing else of the file is downloaded). Writing
computes the header from the announced entries, writes it first, then streams each tensor's bytes
in header order straight into the storage writer; memory holds one tensor at a time.

What safetensors cannot express travels in ``__metadata__["ckptconv"]`` (in the index's
``metadata`` when sharded), a JSON record written only when needed::

    {"version": 1, "keys": [every key in checkpoint order], "spec": "<torch treespec>",
     "entries": {key: {"kind": "value", "value": 10} | {"kind": "link", "target": "k"} |
                      {"kind": "array"} | {"kind": "object", "encoding": "dill"}}}

Values live only in the record. Arrays are stored as tensors. Links are stored as full copies
of their target (safetensors cannot alias) and come back as links. Opaque objects are stored as
1-D uint8 tensors of their payload, because the header, which precedes all data, must be final
before the first payload arrives; their size is announced in ``Entry.meta["nbytes"]``.
``__metadata__`` always carries ``{"format": "pt"}``, which ``transformers`` requires.
"""

from __future__ import annotations

import json
import math
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptconv.core.bounded import load_json
from ckptconv.core.dtypes import DTYPE_SIZES
from ckptconv.core.errors import (
    CorruptCheckpoint,
    UnsupportedDtype,
    UnsupportedValue,
)
from ckptconv.core.uri import basename
from ckptconv.formats.base import (
    Entry,
    Extent,
    OpaqueObject,
    OutputFile,
    TensorSource,
    check_bool_bytes,
    value_dtype,
)
from ckptconv.formats.hf_record import (
    RECORD_KEY,
    build_record,
    entries_from_record,
    parse_record,
    plain_value,
)
from ckptconv.formats.layout import FileLayout, Span
from ckptconv.formats.links import link_root
from ckptconv.formats.listed_entries import ListedEntries
from ckptconv.formats.registry import FORMATS
from ckptconv.formats.sharding import (
    SAFETENSORS,
    LocalFiles,
    ShardedSink,
    Slot,
    find_checkpoint,
    index_bytes,
    read_index,
    read_neighbours,
    read_slot,
    tensor_view,
)
from ckptconv.formats.signatures import JSON_WHITESPACE, SAFETENSORS_MAX_HEADER
from ckptconv.formats.tree import TreeSpec

if TYPE_CHECKING:
    from ckptconv.storage.base import ObjectInfo, Storage

# ckptconv dtype name <-> safetensors dtype code.
ST_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
# Read but never written: older safetensors releases cannot load C64.
_READ_ONLY = {"C64": "complex64"}
DTYPES_FROM_ST = {**{v: k for k, v in ST_DTYPES.items()}, **_READ_ONLY}

MAX_HEADER = SAFETENSORS_MAX_HEADER
_SUFFIXES = FORMATS["safetensors"].suffixes


# --- header ----------------------------------------------------------------------------------


@dataclass
class Header:
    uri: str
    slots: dict[str, Slot]  # in data-offset order
    metadata: dict[str, str]
    file: ObjectInfo  # the file's size and ETag, learned with its first bytes


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} appears twice")
        out[k] = v
    return out


def _is_uint(x: Any) -> bool:
    return type(x) is int and x >= 0


# The first read of a file takes this much: the length prefix and, nearly always, the whole header
# (one request per shard instead of two; object stores charge latency per request).
HEAD_READ = 64 << 10


def read_headers(storage: Storage, uris: list[str]) -> list[Header]:
    """The headers of several files (an index's shards), read in parallel: as many at once as the
    storage serves reads (on S3 each is one GET, taking one of its GET slots)."""
    workers = min(storage.read_parallelism, len(uris))
    if workers <= 1:
        return [read_header(storage, u) for u in uris]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="st-headers") as pool:
        return list(pool.map(lambda u: read_header(storage, u), uris))


def read_header(storage: Storage, uri: str, *, base: int = 0) -> Header:
    """Read and validate the header of one safetensors file (usually one request: a ranged read
    that also tells the file's size).

    ``base``: the safetensors data starts at this byte of ``uri`` and runs to its end (as in the
    ``.distcp`` files of a distributed checkpoint saved in DCP's safetensors format); the slots
    returned are offsets in ``uri``.
    """
    head, file = storage.read_head(uri, HEAD_READ, offset=base)
    size = file.size - base
    if size < 8:
        raise CorruptCheckpoint(f"{uri} is {size} bytes: too short for a safetensors file")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER:
        raise CorruptCheckpoint(f"{uri}: header length {n} exceeds the {MAX_HEADER}-byte limit")
    if n > size - 8:
        raise CorruptCheckpoint(f"{uri}: header length {n} runs past the end of the {size}-byte file")
    raw = head[8 : 8 + n] if 8 + n <= len(head) else storage.read_range(uri, base + 8, n)
    if not raw.lstrip(JSON_WHITESPACE).startswith(b"{"):
        raise CorruptCheckpoint(f"{uri}: the safetensors header is not a JSON object")
    # A header is one object of objects (two levels, __metadata__ included): refuse deeper nesting early.
    doc = load_json(raw, what=f"{uri}: the safetensors header", max_depth=4, object_pairs_hook=_no_duplicate_keys)
    if not isinstance(doc, dict):
        raise CorruptCheckpoint(f"{uri}: the safetensors header is not a JSON object")
    metadata = doc.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpoint(f"{uri}: __metadata__ must map strings to strings")
    data_start = 8 + n
    data_len = size - data_start
    spans: list[tuple[int, int, str]] = []
    slots: dict[str, Slot] = {}
    for key, info in doc.items():
        if not isinstance(info, dict):
            raise CorruptCheckpoint(f"{uri}: header entry {key!r} is not an object")
        st_dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(st_dtype, str):
            raise CorruptCheckpoint(f"{uri}: {key!r} has no dtype")
        if st_dtype not in DTYPES_FROM_ST:
            raise UnsupportedDtype(f"{uri}: {key!r} has dtype {st_dtype}, which ckptconv does not handle", key=key)
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise CorruptCheckpoint(f"{uri}: {key!r} has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
            raise CorruptCheckpoint(f"{uri}: {key!r} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        dtype = DTYPES_FROM_ST[st_dtype]
        if begin > end or end > data_len:
            raise CorruptCheckpoint(
                f"{uri}: {key!r} occupies bytes {begin}..{end}, outside the {data_len}-byte data area"
            )
        if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise CorruptCheckpoint(
                f"{uri}: {key!r} has {end - begin} bytes, but {st_dtype}{shape} needs a different size"
            )
        spans.append((begin, end, key))
        slots[key] = Slot(uri, base + data_start + begin, end - begin, dtype, tuple(shape))
    # The specification forbids holes and overlaps: the tensors tile the data area exactly.
    spans.sort(key=lambda s: (s[0], s[1]))
    cursor = 0
    for begin, end, key in spans:
        if begin != cursor:
            what = "overlaps the tensor before it" if begin < cursor else f"leaves a hole at byte {cursor}"
            raise CorruptCheckpoint(f"{uri}: {key!r} at bytes {begin}..{end} {what}")
        cursor = end
    if cursor != data_len:
        raise CorruptCheckpoint(f"{uri}: the tensors cover {cursor} bytes of a {data_len}-byte data area")
    ordered = {key: slots[key] for _, _, key in spans}
    return Header(uri, ordered, metadata, file)


def header_bytes(tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header for ``[(key, dtype, shape, nbytes), ...]`` in data order."""
    doc: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, dtype, shape, nbytes in tensors:
        doc[key] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # as safetensors pads: the data area starts 8-byte aligned
    if len(text) > MAX_HEADER:
        raise UnsupportedValue(
            f"the safetensors header would be {len(text)} bytes, over the {MAX_HEADER}-byte limit",
            hint="shard the output (shard_size) or use another format",
        )
    return struct.pack("<Q", len(text)) + text


# --- source ----------------------------------------------------------------------------------


class SafetensorsSource(ListedEntries, TensorSource):
    """A safetensors file, an index file, or a directory/prefix holding one of them."""

    format = "safetensors"

    def __init__(self, storage: Storage, uri: str, **options: Any) -> None:
        super().__init__(storage, uri)
        self.path = find_checkpoint(storage, uri, SAFETENSORS, FORMATS["safetensors"].names)
        # Every tensor is a known byte range, read by positioned reads: reads may run in parallel.
        self.read_parallelism = storage.read_parallelism
        self._local = LocalFiles(storage)
        self._files = [self.path]
        if self.path.endswith(".index.json"):
            index = read_index(storage, self.path)
            self.learned(index.file)
            self._files += index.shards
            slots: dict[str, Slot] = {}
            for header in read_headers(storage, index.shards):
                self.learned(header.file)
                for key, slot in header.slots.items():
                    if key in slots:
                        raise CorruptCheckpoint(f"{key!r} is stored in both {slots[key].uri} and {slot.uri}")
                    slots[key] = slot
            for key, shard in index.weight_map.items():
                if key not in slots or slots[key].uri != shard:
                    raise CorruptCheckpoint(f"{self.path} places {key!r} in {shard}, which does not hold it")
            metadata: dict[str, Any] = index.metadata
        else:
            header = read_header(storage, self.path)
            self.learned(header.file)
            slots, metadata = header.slots, header.metadata
        raw = metadata.get(RECORD_KEY)
        record = parse_record(raw, self.path) if raw is not None else None
        self.metadata = {k: v for k, v in metadata.items() if k != RECORD_KEY}
        self._slots = slots
        stored = {k: Entry(k, "tensor", s.dtype, s.shape) for k, s in slots.items()}
        self._entries, self._spec = entries_from_record(record, stored, self.path)
        self._by_key = {e.key: e for e in self._entries}

    @property
    def info(self) -> dict[str, Any]:
        return {"metadata": self.metadata, "files": len(self._files)}

    def files(self) -> list[str]:
        return list(self._files)

    def read(self, key: str) -> Any:
        entry = self._listed(key)
        if entry.kind == "value":
            return entry.value
        if entry.kind == "link":  # its copy in the file is for plain readers; the target is the value
            return self.read(entry.target or "")
        slot = self._slots[key]
        # An object's payload is plain bytes: no tensor needed in either case.
        raw = self.raw_reads or entry.kind == "object"
        t = read_slot(self.storage, slot, self._local.fd(slot.uri), raw=raw)
        if entry.kind == "object":
            return OpaqueObject(tensor_view(t).tobytes(), encoding=entry.meta["encoding"])
        check_bool_bytes(key, slot.dtype, tensor_view(t))
        return t

    def extent(self, key: str) -> Extent | None:
        entry = self._by_key.get(key)
        if entry is None or entry.kind != "tensor" or not self.storage.coalesce_bytes:
            return None
        slot = self._slots[key]
        return Extent(slot.uri, slot.offset, slot.nbytes)

    def read_neighbours(self, keys: list[str]) -> list[Any]:
        if not all(self.extent(k) for k in keys):
            return super().read_neighbours(keys)
        values = read_neighbours(self.storage, [self._slots[k] for k in keys], raw=self.raw_reads)
        for key, value in zip(keys, values, strict=True):
            check_bool_bytes(key, self._slots[key].dtype, tensor_view(value))
        return values

    def close(self) -> None:
        self._local.close()


# --- sink ------------------------------------------------------------------------------------


@dataclass
class _Region:
    key: str  # the key the bytes are stored under
    source: str  # the key whose value fills it (a link's root, or the key itself)
    nbytes: int


@dataclass
class _File:
    uri: str
    header: bytes
    regions: list[_Region]

    def layout(self) -> FileLayout:
        """Header first, then every region in order, exactly tiling the data area."""
        spans, offset = [], len(self.header)
        for r in self.regions:
            spans.append(Span(r.key, r.source, offset, r.nbytes))
            offset += r.nbytes
        return FileLayout(self.uri, offset, spans)


class SafetensorsSink(ShardedSink):
    """Writes ``model.safetensors`` or shards + index under a directory/prefix, or one named file.

    Options: ``shard_size`` (bytes or "5GB"; None writes one file), ``always_sharded`` (shard names
    and an index even for one shard). Each finished file is
    committed under the sink's URI (a staging prefix the engine publishes); ``abort`` removes
    them all.
    """

    format = "safetensors"
    supports_links = False
    supports_objects = True
    supported_dtypes = frozenset(ST_DTYPES)
    accepts_raw = True

    def __init__(self, storage: Storage, uri: str, **options: Any) -> None:
        super().__init__(storage, uri, **options)
        self._files: list[_File] = []
        self._regions_of: dict[str, tuple[int, list[_Region]]] = {}
        self._current: int | None = None
        self._writer: Any = None
        self._index: tuple[str, bytes] | None = None
        self._dtypes: dict[str, str] = {}

    @classmethod
    def check(cls, entries: Any) -> None:
        entries = list(entries)
        super().check(entries)
        for e in entries:
            if e.kind == "value" and not plain_value(e.value):
                raise UnsupportedValue(
                    f"{e.key!r} holds a {type(e.value).__name__}; safetensors metadata keeps only "
                    "None, bool, int, float and str values",
                    key=e.key,
                )
            if e.kind == "object" and not isinstance(e.meta.get("nbytes"), int):
                raise UnsupportedValue(
                    f"object {e.key!r} has no announced size; safetensors needs it before writing",
                    key=e.key,
                )

    def _begin(self, entries: list[Entry], spec: TreeSpec | None) -> None:
        self.check(entries)
        by_key = {e.key: e for e in entries}
        files, index_uri = self.shard_files(entries, _SUFFIXES)
        record = build_record(entries, spec)
        weight_map: dict[str, str] = {}
        total = 0
        for i, f in enumerate(files):
            regions: list[_Region] = []
            tensors = []
            for key in f.keys:
                root = link_root(key, by_key)
                root = root if root in by_key else key
                e = by_key[root]
                dtype, shape = (e.dtype, e.shape) if e.kind != "object" else ("uint8", (e.nbytes,))
                region = _Region(key, root, e.nbytes)
                regions.append(region)
                tensors.append((key, dtype, tuple(shape or ()), e.nbytes))
                self._regions_of.setdefault(root, (i, []))[1].append(region)
                weight_map[key] = basename(f.uri)
                total += e.nbytes
            metadata = {"format": "pt"}
            if record is not None and index_uri is None:
                metadata[RECORD_KEY] = json.dumps(record, separators=(",", ":"))
            self._files.append(_File(f.uri, header_bytes(tensors, metadata), regions))
        if index_uri is not None:
            extra = {RECORD_KEY: record} if record is not None else None
            self._index = (index_uri, index_bytes(weight_map, total, extra))
        self._dtypes = {e.key: str(e.dtype) for e in entries if e.kind in ("tensor", "array")}

    def planned_local_bytes(self) -> int:
        """Every file's size (its header and values) and the index's."""
        index = len(self._index[1]) if self._index is not None else 0
        return sum(f.layout().size for f in self._files) + index

    def _write(self, key: str, value: Any) -> None:
        if key not in self._regions_of:
            return  # a value: it lives in the metadata record
        i, regions = self._regions_of[key]
        if isinstance(value, OpaqueObject):
            data: bytes | memoryview = value.payload
        else:
            want = self._dtypes[key]
            if value_dtype(value) != want:
                raise CorruptCheckpoint(f"{key!r}: got a {value_dtype(value)} tensor, {want} was announced", key=key)
            data = tensor_view(value)
        nbytes = len(data) if isinstance(data, bytes) else data.nbytes
        if nbytes != regions[0].nbytes:
            raise CorruptCheckpoint(f"{key!r}: got {nbytes} bytes, but {regions[0].nbytes} were announced", key=key)
        writer = self._writer_for(i)
        for _ in regions:  # the value, then a copy for each link to it
            writer.write(data)

    def _writer_for(self, i: int) -> Any:
        """The writer of file ``i``, opening it (header first) and any earlier file not yet opened."""
        while self._current is None or self._current < i:
            if self._writer is not None:
                self._outputs.close(self._writer)
            self._current = 0 if self._current is None else self._current + 1
            f = self._files[self._current]
            self._writer = self._outputs.create(f.uri, size=f.layout().size)
            self._writer.write(f.header)
        return self._writer

    def _commit(self) -> list[OutputFile]:
        try:
            self._writer_for(len(self._files) - 1)  # files with no data still need their header
            if self._index is not None:
                uri, text = self._index
                self._outputs.create(uri, role="index").write(text)
        except BaseException:
            self.abort()
            raise
        return self._outputs.commit()

    # --- the layout, for outputs written by several processes (ckptconv.engine.fanout) --------------

    def placed_keys(self) -> set[str]:
        """Entries whose bytes are spans of a file; the others live in headers."""
        return set(self._regions_of)

    def _reserve(self, key: str) -> None:
        pass  # the header, computed at begin, already holds the entry

    def _finish_skeleton(self) -> list[tuple[FileLayout, bytes]]:
        """Each file's layout and gap bytes (its header); a local output file is created
        preallocated with its header in place; the index (when sharded) is written whole."""
        files = [(f.layout(), f.header) for f in self._files]
        return self._lay_out(files, [f.header for f in self._files], self._index)
