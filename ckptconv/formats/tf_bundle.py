"""TensorFlow checkpoints (TF2 ``tf.train.Checkpoint`` and TF1 V2 ``Saver`` bundles), without TensorFlow.

A bundle is named by its prefix ``P``: ``P.index`` is a sorted table (``ckptconv.formats.tf_table``)
mapping each tensor name to a ``BundleEntryProto`` (``ckptconv.formats.tf_proto``) that says where
its bytes live in ``P.data-SSSSS-of-NNNNN`` (shard, offset, size) and their masked crc32c; the
empty key holds the ``BundleHeaderProto``. Numeric tensors are their raw little-endian bytes;
string tensors are varint lengths, a masked checksum of the lengths, then the bytes.

Reading (``TfSource``): the URI is the prefix, the ``.index`` file, or a directory with a TF
``checkpoint`` file. Names keep their slashes (``model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE``).
Each tensor is one ranged read, checked against its crc32c. String tensors (such as the TF2 object
graph ``_CHECKPOINTABLE_OBJECT_GRAPH``) become ``object`` entries whose value is the bytes (a
scalar) or nested lists of bytes, and whose payload is the protocol-4 pickle of that value: the
form every other format stores plain objects in, so a string tensor survives a trip through a
Cerebras checkpoint and back byte for byte. Partitioned variables (TF1 ``Saver`` slices) are
reassembled into one tensor. Entries of TensorFlow-internal dtypes (variant, resource, quantized,
4-bit) are listed as objects and refused when read.

Writing (``TfSink``) is in ``ckptconv.formats.tf_bundle_write``, re-exported here so that the
format registry names one module; the encoding both share (file names, slice keys, string tensors)
is in ``ckptconv.formats.tf_bundle_codec``. The writer keeps what TensorFlow cannot say (a nesting
spec, Python values, links, opaque objects) in one extra string tensor, ``_CKPTCONV_METADATA``
(JSON); ``TfSource`` uses it to return the checkpoint exactly as it was written.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptconv.core.bounded import load_json
from ckptconv.core.dtypes import dtype_size
from ckptconv.core.errors import (
    CorruptCheckpoint,
    ObjectNotFound,
    UnsupportedDtype,
    UnsupportedFormat,
)
from ckptconv.formats.base import Entry, OpaqueObject, RawTensor, TensorSource
from ckptconv.formats.links import link_root, refuse_link_cycles
from ckptconv.formats.memory import empty_raw, empty_tensor
from ckptconv.formats.restricted_pickle import try_loads
from ckptconv.formats.tf_bundle_codec import (
    BUNDLE_MIN_PRODUCER,
    BUNDLE_VERSION,
    JSON_VALUE_TYPES,
    MAX_INDEX_BYTES,
    MAX_METADATA_BYTES,
    MAX_SHARDS,
    METADATA_FORMAT,
    METADATA_KEY,
    OBJECT_GRAPH_KEY,
    byte_view,
    data_uri,
    decode_strings,
    index_uri,
    resolve_prefix,
    slice_key,
    string_object,
)
from ckptconv.formats.tf_bundle_write import TfSink
from ckptconv.formats.tf_proto import (
    BIG,
    DT_STRING,
    LITTLE,
    TF_TO_DTYPE,
    BundleEntry,
    BundleHeader,
    tf_dtype_name,
)
from ckptconv.formats.tf_table import crc32c_extend, read_table, unmask_crc
from ckptconv.formats.tree import TreeSpec
from ckptconv.storage.direct_io import ALIGN
from ckptconv.storage.direct_reads import read_file_into

if TYPE_CHECKING:
    import torch

    from ckptconv.storage.base import Storage

# The format registry names this module for both directions; the writer lives beside it.
__all__ = ["TfSink", "TfSource"]


# --- reading -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stored:
    key: str
    entry: BundleEntry


class TfSource(TensorSource):
    """A TensorFlow V2 bundle. See the module docstring."""

    format = "tf"

    def __init__(self, storage: Storage, uri: str) -> None:
        super().__init__(storage, uri)
        self.prefix = resolve_prefix(storage, uri)
        idx = index_uri(self.prefix)
        size = storage.stat(idx).size
        if size > MAX_INDEX_BYTES:
            raise CorruptCheckpoint(f"{idx} is {size} bytes, more than a bundle index can be")
        items = read_table(storage.read_range(idx, 0, size))
        if not items or items[0][0] != b"":
            raise CorruptCheckpoint(f"{idx} has no bundle header entry")
        self.header = BundleHeader.decode(items[0][1])
        self._check_header(idx)
        self._stored: dict[str, BundleEntry] = {}
        self._slices: dict[bytes, BundleEntry] = {}
        for raw_key, value in items[1:]:
            entry = BundleEntry.decode(value)
            if raw_key.startswith(b"\0"):
                self._slices[raw_key] = entry
                continue
            try:
                key = raw_key.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CorruptCheckpoint(f"{idx} has a tensor name that is not UTF-8: {raw_key[:80]!r}") from e
            self._stored[key] = entry
        self._shard_sizes = self._stat_shards()
        for key, entry in [*self._stored.items(), *((repr(k), e) for k, e in self._slices.items())]:
            self._check_entry(key, entry)
        self._meta: dict[str, Any] | None = self._read_metadata()
        self._entries = self._build_entries()
        self._by_key = {e.key: e for e in self._entries}
        refuse_link_cycles(self._entries)

    # -- metadata ----------------------------------------------------------------------------

    def _check_header(self, idx: str) -> None:
        h = self.header
        v = h.version
        if v.producer < BUNDLE_MIN_PRODUCER or v.min_consumer > BUNDLE_VERSION or BUNDLE_VERSION in v.bad_consumers:
            raise UnsupportedFormat(
                f"{idx} is bundle format version {v.producer} (needs a reader of version {v.min_consumer}+); "
                f"ckptconv reads version {BUNDLE_VERSION}",
                hint="re-save the checkpoint with an older TensorFlow, or upgrade ckptconv",
            )
        if h.endianness == BIG:
            raise UnsupportedFormat(
                f"{idx} was written on a big-endian machine; ckptconv reads little-endian bundles only",
                hint="load and re-save the checkpoint with TensorFlow on a little-endian machine",
            )
        if h.endianness != LITTLE:
            raise CorruptCheckpoint(f"{idx} has an unknown endianness value {h.endianness}")
        if not 1 <= h.num_shards <= MAX_SHARDS:
            raise CorruptCheckpoint(f"{idx} says it has {h.num_shards} data shards")

    def _stat_shards(self) -> list[int]:
        used = {e.shard_id for e in [*self._stored.values(), *self._slices.values()] if not e.slices}
        sizes = [0] * self.header.num_shards
        for shard in sorted(used):
            if shard >= self.header.num_shards:
                continue  # reported by _check_entry with the tensor's name
            uri = data_uri(self.prefix, shard, self.header.num_shards)
            try:
                sizes[shard] = self.storage.stat(uri).size
            except ObjectNotFound as e:
                raise CorruptCheckpoint(
                    f"data file {uri} of this TensorFlow checkpoint is missing",
                    hint="copy every <prefix>.data-* file along with <prefix>.index",
                ) from e
        return sizes

    def _check_entry(self, key: str, e: BundleEntry) -> None:
        if e.slices:
            return  # checked when read: its slices are entries of their own
        if e.shard_id >= self.header.num_shards:
            raise CorruptCheckpoint(f"{key!r} lives in shard {e.shard_id} of a {self.header.num_shards}-shard bundle")
        if e.offset + e.size > self._shard_sizes[e.shard_id]:
            raise CorruptCheckpoint(
                f"{key!r} spans bytes [{e.offset}, {e.offset + e.size}) of data shard {e.shard_id}, "
                f"which has {self._shard_sizes[e.shard_id]} bytes"
            )
        if e.dtype in TF_TO_DTYPE:
            want = math.prod(e.shape) * dtype_size(TF_TO_DTYPE[e.dtype])
            if e.size != want:
                raise CorruptCheckpoint(f"{key!r}: {e.size} bytes stored for {TF_TO_DTYPE[e.dtype]}{list(e.shape)}")
        elif e.dtype == DT_STRING and e.size < math.prod(e.shape):
            raise CorruptCheckpoint(f"{key!r}: {e.size} bytes cannot hold {math.prod(e.shape)} strings")

    def _read_metadata(self) -> dict[str, Any] | None:
        e = self._stored.get(METADATA_KEY)
        if e is None or e.dtype != DT_STRING or e.shape != () or e.slices:
            return None
        if e.size > MAX_METADATA_BYTES:
            raise CorruptCheckpoint(f"{METADATA_KEY} is {e.size} bytes")
        (text,) = decode_strings(self._read_checked(METADATA_KEY, e), 1, METADATA_KEY)[0]
        doc = load_json(text, what=METADATA_KEY)
        if not isinstance(doc, dict) or doc.get("format") != METADATA_FORMAT:
            return None  # someone else's tensor of that name: treat the bundle as plain TensorFlow
        if not isinstance(doc.get("entries"), list):
            raise CorruptCheckpoint(f"{METADATA_KEY} has no entry list")
        return doc

    def _build_entries(self) -> list[Entry]:
        if self._meta is None:
            return [self._plain_entry(k, e) for k, e in self._stored.items()]
        out: list[Entry] = []
        seen: set[str] = set()
        for rec in self._meta["entries"]:
            if not isinstance(rec, dict) or not isinstance(rec.get("key"), str):
                raise CorruptCheckpoint(f"{METADATA_KEY} has a malformed entry record")
            key, kind = rec["key"], rec.get("kind", "tensor")
            if key in seen:
                raise CorruptCheckpoint(f"{METADATA_KEY} lists {key!r} twice")
            seen.add(key)
            if kind == "value":
                if not isinstance(rec.get("value"), JSON_VALUE_TYPES):
                    raise CorruptCheckpoint(f"{METADATA_KEY}: value of {key!r} is not a plain value")
                out.append(Entry(key, "value", value=rec.get("value")))
            elif kind == "link":
                if not isinstance(rec.get("target"), str):
                    raise CorruptCheckpoint(f"{METADATA_KEY}: link {key!r} has no target")
                out.append(Entry(key, "link", target=rec["target"]))
            elif kind in ("tensor", "array", "object"):
                if key not in self._stored:
                    raise CorruptCheckpoint(
                        f"{METADATA_KEY} lists {key!r} but the bundle holds no such tensor",
                        hint="the checkpoint was modified after ckptconv wrote it; delete the "
                        f"{METADATA_KEY} tensor to read it as a plain TensorFlow checkpoint",
                    )
                entry = self._plain_entry(key, self._stored[key])
                if kind == "array" and entry.kind == "tensor":
                    entry = Entry(key, "array", entry.dtype, entry.shape, meta=entry.meta)
                elif kind == "object":
                    meta = dict(entry.meta)
                    if "encoding" in rec:  # a payload stored as one string; else a plain string tensor
                        meta["encoding"] = str(rec["encoding"])
                    entry = Entry(key, "object", meta=meta)
                out.append(entry)
            else:
                raise CorruptCheckpoint(f"{METADATA_KEY}: unknown entry kind {kind!r} for {key!r}")
        # Tensors added to the bundle by other software after ckptconv wrote it are kept too.
        out.extend(self._plain_entry(k, e) for k, e in self._stored.items() if k not in seen and k != METADATA_KEY)
        return out

    def _plain_entry(self, key: str, e: BundleEntry) -> Entry:
        meta: dict[str, Any] = {"tf_dtype": tf_dtype_name(e.dtype), "tf_shape": list(e.shape)}
        if e.slices:
            meta["tf_slices"] = len(e.slices)
        if e.dtype in TF_TO_DTYPE:
            return Entry(key, "tensor", TF_TO_DTYPE[e.dtype], e.shape, meta=meta)
        meta["nbytes"] = e.size
        if e.dtype == DT_STRING:
            meta["strings"] = True
        return Entry(key, "object", meta=meta)

    # -- the protocol --------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        return list(self._entries)

    @property
    def spec(self) -> TreeSpec | None:
        if self._meta is None or self._meta.get("spec") is None:
            return None
        return TreeSpec.from_json(json.dumps(self._meta["spec"]))

    @property
    def info(self) -> dict[str, Any]:
        return {
            "tf_bundle_version": self.header.version.producer,
            "num_shards": self.header.num_shards,
            "object_graph": OBJECT_GRAPH_KEY in self._stored,
            "partitioned_variables": sum(1 for e in self._stored.values() if e.slices),
            "ckptconv_metadata": self._meta is not None,
        }

    def files(self) -> list[str]:
        n = self.header.num_shards
        return [index_uri(self.prefix), *(data_uri(self.prefix, i, n) for i in range(n))]

    def read(self, key: str) -> Any:
        entry = self._by_key.get(key)
        if entry is None:
            raise KeyError(key)
        if entry.kind == "value":
            return entry.value
        if entry.kind == "link":
            root = link_root(key, self._by_key)
            if root not in self._by_key:
                raise CorruptCheckpoint(f"link {key!r} does not resolve to an entry")
            return self.read(root)
        stored = self._stored[key]
        if stored.slices and stored.dtype not in TF_TO_DTYPE:
            raise UnsupportedDtype(
                f"{key!r} is a partitioned variable of dtype {tf_dtype_name(stored.dtype)}, which ckptconv cannot "
                "reassemble",
                key=key,
            )
        if stored.dtype in TF_TO_DTYPE:
            if stored.slices:
                return self._read_partitioned(key, stored)
            return self._read_tensor(key, stored, raw=self.raw_reads)
        if stored.dtype == DT_STRING:
            raw = self._read_checked(key, stored)
            flat = decode_strings(raw, math.prod(stored.shape), key)[0]
            enc = entry.meta.get("encoding")
            if enc is None:
                return string_object(flat, stored.shape)
            # A payload another format stored (written by TfSink as one string), returned as it came.

            ok, value = try_loads(flat[0]) if enc in ("dill", "pickle") else (False, None)
            return OpaqueObject(flat[0], enc, value if ok else None, ok)
        raise UnsupportedDtype(
            f"{key!r} holds TensorFlow-internal state of dtype {tf_dtype_name(stored.dtype)}, which ckptconv cannot "
            "convert",
            hint="convert the model weights without this entry",
            key=key,
        )

    def _read_checked(self, key: str, e: BundleEntry) -> bytes:
        data = self.storage.read_range(data_uri(self.prefix, e.shard_id, self.header.num_shards), e.offset, e.size)
        if e.dtype == DT_STRING:
            flat_crc = decode_strings(data, math.prod(e.shape), key)[1] if e.size else 0
            actual = flat_crc
        else:
            actual = crc32c_extend(0, data)
        if actual != unmask_crc(e.crc32c):
            raise CorruptCheckpoint(f"{key!r} fails its crc32c check: the data file is damaged")
        return data

    def _read_tensor(self, key: str, e: BundleEntry, *, raw: bool = False) -> torch.Tensor | RawTensor:
        """One stored tensor, checked against its CRC-32C; ``raw``: as a :class:`RawTensor`, without torch."""
        out: torch.Tensor | RawTensor
        # In phase with the file: its whole blocks are read around the page cache (storage.direct_reads).
        phase = e.offset % ALIGN
        if raw:
            out = empty_raw(e.shape, TF_TO_DTYPE[e.dtype], phase=phase)
            view = memoryview(out.data).cast("B")
        else:
            out = empty_tensor(e.shape, TF_TO_DTYPE[e.dtype], phase=phase)
            view = byte_view(out)
        if e.size == 0:
            return out
        uri = data_uri(self.prefix, e.shard_id, self.header.num_shards)
        path = self.storage.local_path(uri)
        if path is not None:
            # Read straight into the tensor: no intermediate bytes object for a multi-GB tensor.
            with open(path, "rb", buffering=0) as f:
                if read_file_into(f.fileno(), e.offset, view[: e.size]) < e.size:
                    raise CorruptCheckpoint(f"{uri} is truncated inside {key!r}")
        else:
            self.storage.read_into(uri, e.offset, view)
        if crc32c_extend(0, view) != unmask_crc(e.crc32c):
            raise CorruptCheckpoint(f"{key!r} fails its crc32c check: the data file is damaged")
        return out

    def _read_partitioned(self, key: str, full: BundleEntry) -> torch.Tensor:
        shape = full.shape
        boxes: list[tuple[tuple[int, int], ...]] = []
        for extents in full.slices:
            if len(extents) != len(shape):
                raise CorruptCheckpoint(f"a slice of {key!r} has rank {len(extents)}, the tensor {len(shape)}")
            box = []
            for ext, dim in zip(extents, shape, strict=True):
                stop = dim if ext.is_full else ext.start + ext.length
                if ext.start > dim or stop > dim:
                    raise CorruptCheckpoint(f"a slice of {key!r} lies outside its shape {list(shape)}")
                box.append((ext.start, stop))
            boxes.append(tuple(box))
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                if all(max(x[0], y[0]) < min(x[1], y[1]) for x, y in zip(a, b, strict=True)):
                    raise CorruptCheckpoint(f"slices of {key!r} overlap")
        if sum(math.prod(hi - lo for lo, hi in box) for box in boxes) != math.prod(shape):
            raise CorruptCheckpoint(f"the saved slices of {key!r} do not cover the whole tensor")
        parts = []
        for extents, box in zip(full.slices, boxes, strict=True):
            part = self._slices.get(slice_key(key, extents))
            if part is None:
                raise CorruptCheckpoint(f"a slice of {key!r} listed in its entry is missing from the index")
            want = tuple(hi - lo for lo, hi in box)
            if part.dtype != full.dtype or part.shape != want:
                raise CorruptCheckpoint(f"a slice of {key!r} has {tf_dtype_name(part.dtype)}{list(part.shape)}")
            parts.append((part, box))
        # Allocated only now: the stored slices, whose sizes the data files bound, cover the shape.
        out = empty_tensor(shape, TF_TO_DTYPE[full.dtype])
        for part, box in parts:
            out[tuple(slice(lo, hi) for lo, hi in box)] = self._read_tensor(key, part)
        return out
