"""Writing TensorFlow V2 bundles (``TfSink``); the encoding is in ``tf_bundle_codec``.

Data shards are streamed in the announced order with the crc32c computed on the way; the index
(sorted keys, header with ``num_shards``, little-endian, version producer 1) is written at commit.
Options ``num_shards`` (balanced by bytes), ``shard_size`` (e.g. ``"5GB"``) or ``shard_by`` (glob
patterns of weight names, one file per pattern, the rest last) split the data over several files,
whole tensors each. Every file is written under a temporary name and published by ``commit``, the
index last. Links become index entries that point at their target's bytes, so tied weights are
stored once and TensorFlow reads both names. Given the same tensors in the same order, the files
are byte-identical to TensorFlow's own.

What TensorFlow cannot say (a nesting spec, Python values such as ``None``, the array/tensor
distinction, links, opaque objects) is kept in one extra string tensor, ``_CKPTCONV_METADATA``
(JSON), written only when such entries exist; values that fit a tensor (bool, int64, float, str)
are also written as scalar tensors so TensorFlow sees them.
"""

from __future__ import annotations

import fnmatch
import json
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptconv.core.errors import (
    InvalidRequest,
    KeyCollision,
    TargetExists,
    UnsupportedValue,
)
from ckptconv.core.sizes import parse_size
from ckptconv.formats.base import Entry, OpaqueObject, OutputFile, RawTensor, TensorSink, value_dtype
from ckptconv.formats.layout import DATA, FileLayout, LayoutRecorder
from ckptconv.formats.links import link_root
from ckptconv.formats.sharding import (
    WRITE_PIECE_BYTES,
    HashingWriter,
    create_local_skeletons,
    split_by_size,
    tensor_view,
)
from ckptconv.formats.tf_bundle_codec import (
    BUNDLE_VERSION,
    JSON_VALUE_TYPES,
    METADATA_FORMAT,
    METADATA_KEY,
    bundle_prefix,
    data_uri,
    encode_strings,
    index_uri,
    native_strings,
    value_tensor,
)
from ckptconv.formats.tf_proto import (
    DT_STRING,
    DTYPE_TO_TF,
    LITTLE,
    BundleEntry,
    BundleHeader,
    VersionDef,
)
from ckptconv.formats.tf_table import build_table, crc32c_extend, mask_crc
from ckptconv.formats.tree import DICT, ODICT, TreeSpec
from ckptconv.storage.digests import hex_digest
from ckptconv.storage.part_upload import announce

if TYPE_CHECKING:
    from ckptconv.storage.base import Storage, Writer

# --- writing -------------------------------------------------------------------------------------


@dataclass
class _Item:
    """One announced entry and, once written, where its bytes went."""

    entry: Entry
    shard: int = 0
    estimate: int = 0
    stored: BundleEntry | None = None
    crc_of: str | None = None  # reserved (a skeleton): the key whose value's CRC-32C ``stored`` lacks
    encoding: str | None = None  # objects: OpaqueObject.encoding
    has_data: bool = True  # False: kept in the metadata tensor only


@dataclass
class _ShardState:
    index: int
    staged: str
    final: str
    writer: Writer | LayoutRecorder
    size: int = 0
    hashed: HashingWriter | None = None  # a local data file: its digest, computed as it is written


class TfSink(TensorSink):
    """Writes a TensorFlow V2 bundle. See the module docstring.

    Options: ``num_shards`` (int, tensors balanced by bytes over that many data files),
    ``shard_size`` (bytes or ``"5GB"``: a new data file starts before a tensor would exceed it) or
    ``shard_by`` (glob patterns of weight names, ``fnmatch`` style where ``*`` also matches ``/``:
    data file ``i`` holds the tensors whose name first matches pattern ``i``, a last file the rest;
    how a model too big for one host is split by layer, e.g. ``["layer_0/*", "layer_1/*"]``).
    ``skeleton``: lay the data files out for other processes (ckptconv.engine.fanout): tensors are
    reserved, everything else is written, and the index is written last from their CRC-32Cs
    (:meth:`late_files`).
    """

    format = "tf"
    supports_links = True
    supports_objects = True
    supported_dtypes = frozenset(DTYPE_TO_TF)
    accepts_raw = True  # a tensor is its bytes and their CRC-32C: no torch needed

    @classmethod
    def check(cls, entries: Any) -> None:
        entries = list(entries)
        super().check(entries)
        seen: set[str] = set()
        for e in entries:
            if e.key in seen:
                raise KeyCollision(f"{e.key!r} appears twice")
            seen.add(e.key)
            if not e.key or e.key.startswith("\0") or e.key == METADATA_KEY:
                raise UnsupportedValue(
                    f"{e.key!r} cannot be a TensorFlow checkpoint key (empty, starting with NUL, or reserved)",
                    key=e.key,
                )
            if e.kind == "value" and not isinstance(e.value, JSON_VALUE_TYPES):
                raise UnsupportedValue(
                    f"{e.key!r} holds a {type(e.value).__name__}, which a TensorFlow checkpoint cannot store",
                    key=e.key,
                )

    def __init__(self, storage: Storage, uri: str, **options: Any) -> None:
        super().__init__(storage, uri, **options)
        unknown = set(options) - {"num_shards", "shard_size", "shard_by", "skeleton"}
        if unknown:
            raise InvalidRequest(f"unknown option(s) for the tf format: {', '.join(sorted(unknown))}")
        given = [k for k in ("num_shards", "shard_size", "shard_by") if options.get(k) is not None]
        if len(given) > 1:
            raise InvalidRequest(f"give one of num_shards, shard_size and shard_by, not {' and '.join(given)}")
        self.prefix = bundle_prefix(uri)
        self._token = uuid.uuid4().hex[:12]
        self._items: list[_Item] = []
        self._by_key: dict[str, _Item] = {}
        self._links: list[Entry] = []
        self._link_roots: dict[str, str] = {}  # link key -> the key holding its value
        self._announced: list[Entry] = []
        self._spec: TreeSpec | None = None
        self._num_shards = 1
        # Data files being written. Runs of the announced order fill one file after the other, so one
        # is open at a time; with shard_by the files interleave, so each stays open until commit.
        self._open: dict[int, _ShardState] = {}
        self._done: list[_ShardState] = []
        # Data files whose size is known before their first byte, announced to their writer (a
        # local one then writes around the page cache): one open at a time only, as each holds
        # its staging buffers while open.
        self._exact_sizes: dict[int, int] = {}
        self._finished = False
        self._hasher: ThreadPoolExecutor | None = None  # hashes a local data file's writes beside them
        self.skeleton = bool(options.get("skeleton"))
        self._skeletons: list[str] = []  # preallocated files _finish_skeleton created (abort removes them)
        self._recipe: dict[str, Any] | None = None
        self._crc_of: dict[bytes, str | None] = {}  # index key -> the key whose CRC-32C its entry lacks

    def _staged(self, final: str) -> str:
        return f"{final}.ckptconv-{self._token}.partial"

    # -- planning ------------------------------------------------------------------------------

    def _begin(self, entries: list[Entry], spec: TreeSpec | None) -> None:
        self.check(entries)
        if self.storage.exists(index_uri(self.prefix)):
            raise TargetExists(f"{index_uri(self.prefix)} already exists")
        self._spec = spec
        self._announced = list(entries)
        for e in entries:
            if e.kind == "link":
                self._links.append(e)
                continue
            item = _item(e)
            self._items.append(item)
            self._by_key[e.key] = item
        announced = {e.key: e for e in entries}
        for link in self._links:
            root = link_root(link.key, announced)
            if root not in self._by_key:
                raise UnsupportedValue(
                    f"link {link.key!r} points at {link.target!r}, which is not an entry", key=link.key
                )
            self._link_roots[link.key] = root
        self._assign_shards([i for i in self._items if i.has_data])

    def planned_local_bytes(self) -> int:
        """The data files' bytes (the tensors' exactly, objects' as announced); the index is small."""
        return sum(i.estimate for i in self._items if i.has_data)

    @classmethod
    def planned_shards(cls, entries: list[Entry], options: dict[str, Any]) -> list[tuple[list[str], int]]:
        """The data files ``entries`` go to under ``options`` (each one's keys and estimated bytes),
        as a sink given them assigns them: what a plan shows."""
        stored = [i for i in (_item(e) for e in entries if e.kind != "link") if i.has_data]
        return [([i.entry.key for i in g], sum(i.estimate for i in g)) for g in _shard_groups(stored, options)]

    def _assign_shards(self, stored: list[_Item]) -> None:
        groups = _shard_groups(stored, self.options)
        self._num_shards = len(groups)
        for shard, group in enumerate(groups):
            for item in group:
                item.shard = shard
            if self.options.get("shard_by") is None and all(i.entry.kind in ("tensor", "array") for i in group):
                # Tensors only: the data file's size is known to the byte before it is written.
                self._exact_sizes[shard] = sum(i.estimate for i in group)

    # -- data ----------------------------------------------------------------------------------

    def _write(self, key: str, value: Any) -> None:
        item = self._by_key[key]
        e = item.entry
        if not item.has_data:
            return
        if e.kind in ("tensor", "array"):
            self._write_tensor(item, value)
        elif e.kind == "value":
            tf_dtype, raw = value_tensor(e.value)  # type: ignore[misc]
            if tf_dtype == DT_STRING:
                data, crc = encode_strings([raw])
            else:
                data, crc = raw, crc32c_extend(0, raw)
            self._append(item, tf_dtype, (), [memoryview(data)], crc)
        else:
            self._write_object(item, value)

    def _write_tensor(self, item: _Item, value: Any) -> None:
        e = item.entry
        torch = sys.modules.get("torch")  # a torch tensor means torch is loaded; a RawTensor needs none
        if not isinstance(value, RawTensor) and (torch is None or not isinstance(value, torch.Tensor)):
            raise UnsupportedValue(f"{e.key!r} was announced as a tensor but {type(value).__name__} was written")
        dtype = value_dtype(value)
        if dtype != e.dtype or tuple(value.shape) != tuple(e.shape or ()):
            raise UnsupportedValue(
                f"{e.key!r} was announced as {e.dtype}{list(e.shape or ())} but {dtype}{list(value.shape)} was written"
            )
        view = tensor_view(value)
        self._append(item, DTYPE_TO_TF[dtype], tuple(value.shape), [view], crc32c_extend(0, view))

    def _write_object(self, item: _Item, value: Any) -> None:
        e = item.entry
        if not isinstance(value, OpaqueObject):
            raise UnsupportedValue(f"{e.key!r} was announced as an object but {type(value).__name__} was written")
        native = native_strings(value, e.meta.get("tf_shape"))
        if native is not None:
            item.encoding = None  # a plain string tensor: TfSource returns it as it came
            flat, shape = native
        else:
            item.encoding = value.encoding
            shape, flat = (), [bytes(value.payload)]
        data, crc = encode_strings(flat)
        self._append(item, DT_STRING, shape, [memoryview(data)], crc)

    def _append(self, item: _Item, tf_dtype: int, shape: tuple[int, ...], chunks: list[memoryview], crc: int) -> None:
        shard = self._shard_for(item.shard)
        offset = shard.size
        out = shard.hashed or shard.writer
        for chunk in chunks:
            out.write(chunk)
            shard.size += len(chunk)
        item.stored = BundleEntry(tf_dtype, shape, item.shard, offset, shard.size - offset, mask_crc(crc))

    def _shard_for(self, index: int) -> _ShardState:
        if index in self._open:
            return self._open[index]
        if self.options.get("shard_by") is None:
            self._close_shards()
        return self._open_shard(index)

    def _open_shard(self, index: int) -> _ShardState:
        final = data_uri(self.prefix, index, self._num_shards)
        if self.skeleton:  # laid out, not written; the files are created once complete
            shard = _ShardState(index, final, final, LayoutRecorder(final))
            self._open[index] = shard
            return shard
        staged = self._staged(final)
        # A local file of known size: one extent, and its bytes go around the page cache.
        writer = announce(self.storage.open_writer(staged, overwrite=True), self._exact_sizes.get(index), bulk=False)
        shard = _ShardState(index, staged, final, writer)
        if self.storage.local_path(staged) is not None:
            # Hashed as written, in pieces read from the caches by both the write and the hash:
            # otherwise the engine reads the whole file back for its digest once it is written.
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tf-digest")
            shard.hashed = HashingWriter(writer, "data", self._hasher, WRITE_PIECE_BYTES)
        self._open[index] = shard
        return shard

    def _stop_hasher(self) -> None:
        hasher, self._hasher = self._hasher, None
        if hasher is not None:
            hasher.shutdown(wait=True)

    def _close_shards(self) -> None:
        for index in sorted(self._open):
            shard = self._open.pop(index)
            if not isinstance(shard.writer, LayoutRecorder):
                shard.writer.commit()
            self._done.append(shard)

    # -- commit --------------------------------------------------------------------------------

    def _metadata(self) -> bytes | None:
        """The JSON of ``_CKPTCONV_METADATA``, or None when TensorFlow's own view loses nothing."""
        keys = [i.entry.key for i in self._items] + [e.key for e in self._links]
        plain = (
            all(i.entry.kind == "tensor" or (i.entry.kind == "object" and i.encoding is None) for i in self._items)
            and not self._links
        )
        if plain and self._spec is not None:
            plain = self._spec.type in (DICT, ODICT) and all(c.is_leaf for c in self._spec.children)
            plain = plain and sorted(map(str, self._spec.context)) == sorted(keys)
        if plain:
            return None
        records: list[dict[str, Any]] = []
        by_key = {**{i.entry.key: i.entry for i in self._items}, **{e.key: e for e in self._links}}
        order = [e.key for e in self._announced]
        for key in order:
            e = by_key[key]
            rec: dict[str, Any] = {"key": key, "kind": e.kind}
            if e.kind == "value":
                rec["value"] = e.value
            elif e.kind == "link":
                rec["target"] = e.target
            elif e.kind == "object" and self._by_key[key].encoding is not None:
                rec["encoding"] = self._by_key[key].encoding
            records.append(rec)
        doc = {
            "format": METADATA_FORMAT,
            "spec": json.loads(self._spec.to_json()) if self._spec is not None else None,
            "entries": records,
        }
        return json.dumps(doc).encode()

    def _finish_data(self) -> dict[bytes, BundleEntry]:
        """Append the metadata tensor, close every data file; the index's entries by key."""
        stored = [i for i in self._items if i.stored is not None]
        meta = self._metadata()
        if meta is not None:  # appended to the last data file
            item = _Item(Entry(METADATA_KEY, "object"), shard=self._num_shards - 1)
            data, crc = encode_strings([meta])
            self._append(item, DT_STRING, (), [memoryview(data)], crc)
            stored.append(item)
        self._shard_for(self._num_shards - 1)  # opens it when nothing was written (an empty checkpoint)
        self._close_shards()
        self._crc_of = {i.entry.key.encode(): i.crc_of for i in stored}
        entries = {i.entry.key.encode(): i.stored for i in stored}
        for link in self._links:
            target = self._by_key[self._link_roots[link.key]]
            if target.stored is not None:  # a link to a None value lives in the metadata only
                entries[link.key.encode()] = target.stored
                self._crc_of[link.key.encode()] = target.crc_of
        return entries  # type: ignore[return-value]

    @staticmethod
    def _table(entries: dict[bytes, BundleEntry], num_shards: int) -> bytes:
        header = BundleHeader(num_shards, LITTLE, VersionDef(BUNDLE_VERSION, 0))
        return build_table([(b"", header.encode()), *sorted((k, e.encode()) for k, e in entries.items())])

    def _commit(self) -> list[OutputFile]:
        table = self._table(self._finish_data(), self._num_shards)
        self._stop_hasher()
        idx_final = index_uri(self.prefix)
        idx_staged = self._staged(idx_final)
        self.storage.write_bytes(idx_staged, table, overwrite=True)
        pairs = [(s.staged, s.final) for s in self._done] + [(idx_staged, idx_final)]
        try:
            self.storage.publish(pairs)
        except BaseException:
            self._delete_staged()
            raise
        self._finished = True
        out = [OutputFile(s.final, s.size, s.hashed.hash.hexdigest() if s.hashed else None, "data") for s in self._done]
        out.append(OutputFile(idx_final, len(table), hex_digest(table), "index"))
        return out

    # -- the layout, for outputs written by several processes (ckptconv.engine.fanout) -----------

    def placed_keys(self) -> set[str]:
        """Tensors: runs of a data file; values and strings are written with the layout."""
        return {i.entry.key for i in self._items if i.has_data and i.entry.kind in ("tensor", "array")}

    def _reserve(self, key: str) -> None:
        item = self._by_key[key]
        e = item.entry
        shard = self._shard_for(item.shard)
        assert isinstance(shard.writer, LayoutRecorder), "reserve needs a sink created with skeleton=True"
        offset, nbytes = shard.size, e.nbytes
        if nbytes:
            shard.writer.place(key, nbytes, DATA)
            item.crc_of = key
        shard.size += nbytes
        crc = 0 if nbytes else mask_crc(0)  # an empty tensor's CRC is known
        item.stored = BundleEntry(DTYPE_TO_TF[str(e.dtype)], tuple(e.shape or ()), item.shard, offset, nbytes, crc)

    def _finish_skeleton(self) -> list[tuple[FileLayout, bytes]]:
        """Each data file's layout (tensors are spans, the rest gaps) and gap bytes; local data
        files are created preallocated; the index waits for the tensors' CRC-32Cs (late_files)."""
        try:
            entries = self._finish_data()
            files = []
            for s in self._done:
                recorder = s.writer
                assert isinstance(recorder, LayoutRecorder)
                files.append((recorder.layout(checksum="crc32c"), bytes(recorder.gaps)))
            create_local_skeletons(self.storage, [f for f, _ in files], [b""] * len(files), self._skeletons)
        except BaseException:
            self.abort()
            raise
        self._finished = True
        self._recipe = {
            "index": index_uri(self.prefix),
            "num_shards": self._num_shards,
            "entries": [
                [k.decode(), e.dtype, list(e.shape), e.shard_id, e.offset, e.size, e.crc32c, self._crc_of[k]]
                for k, e in entries.items()
            ],
        }
        return files

    def late_recipe(self) -> dict[str, Any] | None:
        return self._recipe

    @classmethod
    def late_files(cls, recipe: dict[str, Any], checksums: dict[str, int]) -> list[tuple[str, bytes, str]]:
        """The index, each reserved tensor's entry with the CRC-32C of its bytes."""
        entries = {}
        for key, dtype, shape, shard, offset, size, crc, crc_of in recipe["entries"]:
            if crc_of is not None:
                crc = mask_crc(checksums[crc_of])
            entries[key.encode()] = BundleEntry(dtype, tuple(shape), shard, offset, size, crc)
        return [(recipe["index"], cls._table(entries, recipe["num_shards"]), "index")]

    def _abort(self) -> None:
        self._stop_hasher()
        skeletons, self._skeletons = self._skeletons, []
        for uri in skeletons:
            self.storage.delete(uri)
        if self._finished:
            return
        for shard in self._open.values():
            shard.writer.abort()
        self._open.clear()
        self._delete_staged()
        self._finished = True

    def _delete_staged(self) -> None:
        for s in self._done:
            self.storage.delete(s.staged)
        self.storage.delete(self._staged(index_uri(self.prefix)))


def _item(e: Entry) -> _Item:
    """The item of a non-link entry, with the bytes its data file will hold."""
    item = _Item(e)
    if e.kind in ("tensor", "array"):
        item.estimate = e.nbytes
    elif e.kind == "object":
        item.estimate = int(e.meta.get("nbytes", 0))
    else:
        item.has_data = value_tensor(e.value) is not None
        item.estimate = 16
    return item


def _shard_groups(stored: list[_Item], options: dict[str, Any]) -> list[list[_Item]]:
    """The items of each data file, by ``num_shards``, ``shard_size`` or ``shard_by`` (one file by default)."""
    num = options.get("num_shards")
    size = options.get("shard_size")
    patterns = options.get("shard_by")
    if patterns is not None:
        return _by_names(stored, patterns)
    if num is not None:
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise InvalidRequest(f"num_shards must be a positive integer, got {num!r}")
        return _balanced(stored, min(num, max(len(stored), 1)))
    if size is not None:
        return split_by_size(stored, lambda i: i.estimate, parse_size(size))
    return [stored]


def _by_names(items: list[_Item], patterns: Any) -> list[list[_Item]]:
    """One group per glob pattern (a tensor joins the first it matches), then the unmatched ones."""
    if isinstance(patterns, str) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise InvalidRequest(f"shard_by must be a non-empty list of glob patterns, got {patterns!r}")
    groups: list[list[_Item]] = [[] for _ in patterns]
    rest: list[_Item] = []
    for item in items:
        i = next((i for i, p in enumerate(patterns) if fnmatch.fnmatchcase(item.entry.key, p)), None)
        (rest if i is None else groups[i]).append(item)
    empty = [p for p, g in zip(patterns, groups, strict=True) if not g]
    if empty:
        raise InvalidRequest(
            f"shard_by pattern(s) {', '.join(map(repr, empty))} match no weight (or only names an earlier "
            "pattern took)",
            hint="list the names with `ckptconv inspect SOURCE`; '*' also matches '/'",
        )
    return [*groups, rest] if rest else groups


def _balanced(items: list[_Item], n: int) -> list[list[_Item]]:
    """Split ``items`` in order into ``n`` non-empty runs of roughly equal bytes."""
    if n <= 1 or not items:
        return [items]
    weights = [i.estimate for i in items]
    if not any(weights):
        weights = [1] * len(items)
    total = sum(weights)
    groups: list[list[_Item]] = []
    start = 0
    acc = 0
    for g in range(n):
        remaining_groups = n - g
        if remaining_groups == 1:
            groups.append(items[start:])
            break
        target = total * (g + 1) / n
        end = start + 1  # every shard gets at least one tensor
        acc += weights[start]
        # Take more while the cut gets closer to the target and enough items remain for later shards.
        while end < len(items) - (remaining_groups - 1) and abs(acc + weights[end] - target) <= abs(acc - target):
            acc += weights[end]
            end += 1
        groups.append(items[start:end])
        start = end
    return groups
