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

Writing (``TfSink``): data shards are streamed in the announced order with the crc32c computed on
the way; the index (sorted keys, header with ``num_shards``, little-endian, version producer 1) is
written at commit. Options ``num_shards`` (balanced by bytes), ``shard_size`` (e.g. ``"5GB"``) or
``shard_by`` (glob patterns of weight names, one file per pattern, the rest last) split the data
over several files, whole tensors each. Every file is written under a temporary
name and published by ``commit``, the index last. Links become index entries that point at their
target's bytes, so tied weights are stored once and TensorFlow reads both names. Given the same
tensors in the same order, the files are byte-identical to TensorFlow's own.

What TensorFlow cannot say (a nesting spec, Python values such as ``None``, the array/tensor
distinction, links, opaque objects) is kept in one extra string tensor, ``_CKPTCONV_METADATA``
(JSON), written only when such entries exist; TensorFlow sees it as an ordinary string tensor,
and ``TfSource`` uses it to return the checkpoint exactly as it was written. Values that fit a
tensor (bool, int64, float, str) are also written as scalar tensors so TensorFlow sees them.
"""

from __future__ import annotations

import fnmatch
import json
import math
import pickle
import re
import struct
import sys
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptconv.core.bounded import load_json
from ckptconv.core.dtypes import dtype_size
from ckptconv.core.errors import (
    CorruptCheckpoint,
    InvalidRequest,
    KeyCollision,
    ObjectNotFound,
    TargetExists,
    UnsupportedDtype,
    UnsupportedFormat,
    UnsupportedValue,
)
from ckptconv.core.sizes import parse_size
from ckptconv.formats.base import Entry, OpaqueObject, OutputFile, TensorSink, TensorSource
from ckptconv.formats.tf_proto import (
    BIG,
    DT_STRING,
    DTYPE_TO_TF,
    LITTLE,
    TF_TO_DTYPE,
    BundleEntry,
    BundleHeader,
    Extent,
    VersionDef,
    decode_varint,
    encode_varint,
    tf_dtype_name,
)
from ckptconv.formats.tf_table import build_table, crc32c_extend, mask_crc, read_table, unmask_crc
from ckptconv.formats.tree import DICT, ODICT, TreeSpec

if TYPE_CHECKING:
    import torch

    from ckptconv.storage.base import Storage, Writer

# Bundle format versions this code reads and writes (tensor_bundle.cc kTensorBundleVersion).
BUNDLE_VERSION = 1
BUNDLE_MIN_PRODUCER = 0

METADATA_KEY = "_CKPTCONV_METADATA"
METADATA_FORMAT = "ckptconv-tf/1"
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
STRING_ENCODING = "pickle"  # OpaqueObject.encoding of a string tensor: a pickle of its (nested) bytes

MAX_SHARDS = 100_000
# Index files hold one small entry per tensor; anything bigger is not a bundle index.
MAX_INDEX_BYTES = 1 << 30
MAX_METADATA_BYTES = 1 << 30

if sys.byteorder != "little":  # pragma: no cover - every platform ckptconv runs on
    raise ImportError("ckptconv.formats.tf_bundle assumes a little-endian host")


# --- names -------------------------------------------------------------------------------------


def bundle_prefix(uri: str) -> str:
    """``dir/ckpt`` for ``dir/ckpt`` or ``dir/ckpt.index``."""
    return uri[: -len(".index")] if uri.endswith(".index") else uri


def index_uri(prefix: str) -> str:
    return prefix + ".index"


def data_uri(prefix: str, shard: int, num_shards: int) -> str:
    return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


_CHECKPOINT_PATH = re.compile(r'^\s*model_checkpoint_path\s*:\s*"((?:[^"\\]|\\.)*)"\s*$', re.M)


def resolve_prefix(storage: Storage, uri: str) -> str:
    """The bundle prefix a source URI names: a prefix, an ``.index`` file, or a directory holding
    TensorFlow's ``checkpoint`` state file (its ``model_checkpoint_path``, confined to that directory)."""
    if uri.endswith(".index"):
        return bundle_prefix(uri)
    if storage.exists(index_uri(uri)):
        return uri
    base = uri.rstrip("/")
    state = storage.join(base, "checkpoint")
    if storage.exists(state):
        text = storage.read_all(state)[: 1 << 20].decode("utf-8", "replace")
        m = _CHECKPOINT_PATH.search(text)
        if m is None:
            raise CorruptCheckpoint(f"{state} names no model_checkpoint_path")
        path = m.group(1).encode().decode("unicode_escape")
        # TF1 wrote absolute paths of the machine that trained; the bundle sits beside the state file.
        name = path.rsplit("/", 1)[-1] if path.startswith("/") or "://" in path else path
        return storage.join(base, name)
    raise ObjectNotFound(
        f"no TensorFlow checkpoint at {uri} (looked for {index_uri(uri)} and {state})",
        hint="pass the checkpoint prefix, e.g. dir/ckpt-1 for dir/ckpt-1.index and dir/ckpt-1.data-00000-of-00001",
    )


# Partitioned variables: each stored slice is an entry keyed by an "ordered code" encoding of
# (0, full name, rank, start/length per dimension) (tensor_slice_util EncodeTensorNameSlice).
_SIGNED_HEADER = [(0, 0), (0x80, 0), (0xC0, 0), (0xE0, 0), (0xF0, 0), (0xF8, 0), (0xFC, 0), (0xFE, 0)]
_SIGNED_HEADER += [(0xFF, 0), (0xFF, 0x80), (0xFF, 0xC0)]


def _ordered_num(value: int) -> bytes:
    raw = value.to_bytes(8, "big").lstrip(b"\0")
    return bytes([len(raw)]) + raw


def _ordered_string(value: bytes) -> bytes:
    out = bytearray()
    for b in value:  # NUL and 0xFF are escaped; NUL 0x01 ends the string
        out += b"\x00\xff" if b == 0 else b"\xff\x00" if b == 0xFF else bytes([b])
    return bytes(out) + b"\x00\x01"


def _ordered_signed(value: int) -> bytes:
    x = ~value if value < 0 else value
    if x < 64:
        return bytes([(0x80 ^ value) & 0xFF])
    n = x.bit_length() // 7 + 1
    raw = bytearray((value & ((1 << 80) - 1)).to_bytes(10, "big")[10 - n :])
    raw[0] ^= _SIGNED_HEADER[n][0]
    raw[1] ^= _SIGNED_HEADER[n][1]
    return bytes(raw)


def slice_key(name: str, extents: tuple[Extent, ...]) -> bytes:
    """The index key of one stored slice of partitioned variable ``name``."""
    out = _ordered_num(0) + _ordered_string(name.encode()) + _ordered_num(len(extents))
    for e in extents:
        out += _ordered_signed(e.start) + _ordered_signed(e.length)
    return out


# --- string tensors ------------------------------------------------------------------------------


def encode_strings(items: list[bytes]) -> tuple[bytes, int]:
    """A string tensor's stored bytes and their (unmasked) bundle checksum.

    The checksum covers each length as a little-endian uint32 (uint64 beyond 4 GiB), not the
    varint bytes, then the masked length checksum, then the string bytes (tensor_bundle.cc).
    """
    crc = 0
    lengths = bytearray()
    for s in items:
        n = len(s)
        lengths += encode_varint(n)
        crc = crc32c_extend(crc, struct.pack("<I", n) if n <= 0xFFFFFFFF else struct.pack("<Q", n))
    length_check = struct.pack("<I", mask_crc(crc))
    crc = crc32c_extend(crc, length_check)
    for s in items:
        crc = crc32c_extend(crc, s)
    return bytes(lengths) + length_check + b"".join(items), crc


def decode_strings(data: bytes, count: int, what: str) -> tuple[list[bytes], int]:
    """Parse ``count`` strings stored as :func:`encode_strings` does; returns them and the checksum."""
    if not data:
        if count:
            raise CorruptCheckpoint(f"{what}: string tensor of {count} elements has no bytes")
        return [], 0
    crc = 0
    pos = 0
    lengths = []
    for _ in range(count):
        n, pos = decode_varint(data, pos)
        lengths.append(n)
        crc = crc32c_extend(crc, struct.pack("<I", n) if n <= 0xFFFFFFFF else struct.pack("<Q", n))
    if pos + 4 > len(data):
        raise CorruptCheckpoint(f"{what}: string lengths run past the stored bytes")
    (stored,) = struct.unpack_from("<I", data, pos)
    if unmask_crc(stored) != crc:
        raise CorruptCheckpoint(f"{what}: string length checksum does not match")
    crc = crc32c_extend(crc, data[pos : pos + 4])
    pos += 4
    if pos + sum(lengths) != len(data):
        raise CorruptCheckpoint(f"{what}: string lengths do not add up to the stored size")
    out = []
    for n in lengths:
        out.append(data[pos : pos + n])
        pos += n
    crc = crc32c_extend(crc, memoryview(data)[pos - sum(lengths) : pos])
    return out, crc


def string_object(flat: list[bytes], shape: tuple[int, ...]) -> OpaqueObject:
    """The object entry value of a string tensor (see the module docstring)."""
    value = _nest(flat, shape)
    return OpaqueObject(pickle.dumps(value, protocol=4), STRING_ENCODING, value, decoded=True)


def _native_strings(obj: OpaqueObject, shape_hint: Any) -> tuple[list[bytes], tuple[int, ...]] | None:
    """(flat strings, shape) when ``obj`` is exactly what :func:`string_object` makes of them."""
    if not obj.decoded or obj.encoding not in ("pickle", "dill"):
        return None
    shape = _strings_shape(obj.value)
    if shape is None:
        return None
    flat = _flatten_strings(obj.value)
    if shape_hint is not None:
        hint = tuple(int(d) for d in shape_hint)
        if math.prod(hint) == len(flat) and _nest(flat, hint) == obj.value:
            shape = hint  # keeps dimensions nesting cannot show, as in (0, 3)
    if pickle.dumps(obj.value, protocol=4) != bytes(obj.payload):
        return None  # reading it back would not give these payload bytes: keep the payload instead
    return flat, shape


def _strings_shape(value: Any) -> tuple[int, ...] | None:
    """The shape of bytes nested in equal-length lists; None for anything else."""
    if isinstance(value, bytes):
        return ()
    if not isinstance(value, list):
        return None
    if not value:
        return (0,)
    shapes = {_strings_shape(v) for v in value}
    if len(shapes) != 1 or None in shapes:
        return None
    return (len(value), *shapes.pop())  # type: ignore[misc]


def _nest(flat: list[bytes], shape: tuple[int, ...]) -> Any:
    """Row-major nested lists of ``flat`` in ``shape`` (a scalar is the bytes themselves)."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return list(flat)
    step = math.prod(shape[1:])
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _flatten_strings(value: Any) -> list[bytes]:
    if isinstance(value, bytes):
        return [value]
    return [s for v in value for s in _flatten_strings(v)]


# --- tensor bytes --------------------------------------------------------------------------------


def _byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor in C order (no copy when it is already contiguous)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def _value_tensor(value: Any) -> tuple[int, bytes] | None:
    """(TF dtype, stored bytes) of a Python value TensorFlow can hold as a scalar; None otherwise."""
    if isinstance(value, bool):
        return DTYPE_TO_TF["bool"], bytes([value])
    if isinstance(value, int):
        if -(1 << 63) <= value < (1 << 63):
            return DTYPE_TO_TF["int64"], struct.pack("<q", value)
        return None
    if isinstance(value, float):
        return DTYPE_TO_TF["float64"], struct.pack("<d", value)
    if isinstance(value, str):
        return DT_STRING, value.encode()
    return None


_JSON_VALUE_TYPES = (bool, int, float, str, type(None))


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
                if not isinstance(rec.get("value"), _JSON_VALUE_TYPES):
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
            seen = {key}
            while entry.kind == "link":
                if entry.target in seen or entry.target not in self._by_key:
                    raise CorruptCheckpoint(f"link {key!r} does not resolve to an entry")
                seen.add(entry.target)
                entry = self._by_key[entry.target]
            return self.read(entry.key)
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
            return self._read_tensor(key, stored)
        if stored.dtype == DT_STRING:
            raw = self._read_checked(key, stored)
            flat = decode_strings(raw, math.prod(stored.shape), key)[0]
            enc = entry.meta.get("encoding")
            if enc is None:
                return string_object(flat, stored.shape)
            # A payload another format stored (written by TfSink as one string), returned as it came.
            from ckptconv.formats.restricted_pickle import try_loads

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

    def _read_tensor(self, key: str, e: BundleEntry) -> torch.Tensor:
        from ckptconv.formats.memory import empty_tensor

        out = empty_tensor(e.shape, TF_TO_DTYPE[e.dtype])
        if e.size == 0:
            return out
        view = _byte_view(out)
        uri = data_uri(self.prefix, e.shard_id, self.header.num_shards)
        path = self.storage.local_path(uri)
        if path is not None:
            # Read straight into the tensor: no intermediate bytes object for a multi-GB tensor.
            with open(path, "rb") as f:
                f.seek(e.offset)
                got = 0
                while got < e.size:
                    n = f.readinto(view[got:])
                    if not n:
                        raise CorruptCheckpoint(f"{uri} is truncated inside {key!r}")
                    got += n
        else:
            self.storage.read_into(uri, e.offset, view)
        if crc32c_extend(0, view) != unmask_crc(e.crc32c):
            raise CorruptCheckpoint(f"{key!r} fails its crc32c check: the data file is damaged")
        return out

    def _read_partitioned(self, key: str, full: BundleEntry) -> torch.Tensor:
        from ckptconv.formats.memory import empty_tensor

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


# --- writing -------------------------------------------------------------------------------------


@dataclass
class _Item:
    """One announced entry and, once written, where its bytes went."""

    entry: Entry
    shard: int = 0
    estimate: int = 0
    stored: BundleEntry | None = None
    encoding: str | None = None  # objects: OpaqueObject.encoding
    has_data: bool = True  # False: kept in the metadata tensor only


@dataclass
class _ShardState:
    index: int
    staged: str
    final: str
    writer: Writer
    size: int = 0


class TfSink(TensorSink):
    """Writes a TensorFlow V2 bundle. See the module docstring.

    Options: ``num_shards`` (int, tensors balanced by bytes over that many data files),
    ``shard_size`` (bytes or ``"5GB"``: a new data file starts before a tensor would exceed it) or
    ``shard_by`` (glob patterns of weight names, ``fnmatch`` style where ``*`` also matches ``/``:
    data file ``i`` holds the tensors whose name first matches pattern ``i``, a last file the rest;
    how a model too big for one host is split by layer, e.g. ``["layer_0/*", "layer_1/*"]``).
    """

    format = "tf"
    supports_links = True
    supports_objects = True
    supported_dtypes = frozenset(DTYPE_TO_TF)

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
            if e.kind == "value" and not isinstance(e.value, _JSON_VALUE_TYPES):
                raise UnsupportedValue(
                    f"{e.key!r} holds a {type(e.value).__name__}, which a TensorFlow checkpoint cannot store",
                    key=e.key,
                )

    def __init__(self, storage: Storage, uri: str, **options: Any) -> None:
        super().__init__(storage, uri, **options)
        unknown = set(options) - {"num_shards", "shard_size", "shard_by"}
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
        self._link_map: dict[str, Entry] = {}
        self._announced: list[Entry] = []
        self._spec: TreeSpec | None = None
        self._num_shards = 1
        # Data files being written. Runs of the announced order fill one file after the other, so one
        # is open at a time; with shard_by the files interleave, so each stays open until commit.
        self._open: dict[int, _ShardState] = {}
        self._done: list[_ShardState] = []
        self._finished = False

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
            item = _Item(e)
            if e.kind in ("tensor", "array"):
                item.estimate = e.nbytes
            elif e.kind == "object":
                item.estimate = int(e.meta.get("nbytes", 0))
            else:
                item.has_data = _value_tensor(e.value) is not None
                item.estimate = 16
            self._items.append(item)
            self._by_key[e.key] = item
        self._link_map = {e.key: e for e in self._links}
        for link in self._links:
            if self._resolve(link.key) is None:
                raise UnsupportedValue(
                    f"link {link.key!r} points at {link.target!r}, which is not an entry", key=link.key
                )
        self._assign_shards([i for i in self._items if i.has_data])

    def _resolve(self, key: str) -> str | None:
        """The non-link entry a link finally aliases; None when it points nowhere or in a cycle."""
        links = self._link_map
        seen = {key}
        while key in links:
            key = links[key].target or ""
            if key in seen:
                return None
            seen.add(key)
        return key if key in self._by_key else None

    def _assign_shards(self, stored: list[_Item]) -> None:
        from ckptconv.formats.sharding import split_by_size

        num = self.options.get("num_shards")
        size = self.options.get("shard_size")
        patterns = self.options.get("shard_by")
        if patterns is not None:
            groups = _by_names(stored, patterns)
        elif num is not None:
            if isinstance(num, bool) or not isinstance(num, int) or num < 1:
                raise InvalidRequest(f"num_shards must be a positive integer, got {num!r}")
            groups = _balanced(stored, min(num, max(len(stored), 1)))
        elif size is not None:
            groups = split_by_size(stored, lambda i: i.estimate, parse_size(size))
        else:
            groups = [stored]
        self._num_shards = len(groups)
        for shard, group in enumerate(groups):
            for item in group:
                item.shard = shard

    # -- data ----------------------------------------------------------------------------------

    def _write(self, key: str, value: Any) -> None:
        item = self._by_key[key]
        e = item.entry
        if not item.has_data:
            return
        if e.kind in ("tensor", "array"):
            self._write_tensor(item, value)
        elif e.kind == "value":
            tf_dtype, raw = _value_tensor(e.value)  # type: ignore[misc]
            if tf_dtype == DT_STRING:
                data, crc = encode_strings([raw])
            else:
                data, crc = raw, crc32c_extend(0, raw)
            self._append(item, tf_dtype, (), [memoryview(data)], crc)
        else:
            self._write_object(item, value)

    def _write_tensor(self, item: _Item, value: Any) -> None:
        import torch

        e = item.entry
        if not isinstance(value, torch.Tensor):
            raise UnsupportedValue(f"{e.key!r} was announced as a tensor but {type(value).__name__} was written")
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype != e.dtype or tuple(value.shape) != tuple(e.shape or ()):
            raise UnsupportedValue(
                f"{e.key!r} was announced as {e.dtype}{list(e.shape or ())} but {dtype}{list(value.shape)} was written"
            )
        view = _byte_view(value)
        self._append(item, DTYPE_TO_TF[dtype], tuple(value.shape), [view], crc32c_extend(0, view))

    def _write_object(self, item: _Item, value: Any) -> None:
        e = item.entry
        if not isinstance(value, OpaqueObject):
            raise UnsupportedValue(f"{e.key!r} was announced as an object but {type(value).__name__} was written")
        native = _native_strings(value, e.meta.get("tf_shape"))
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
        for chunk in chunks:
            shard.writer.write(chunk)
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
        staged = self._staged(final)
        shard = _ShardState(index, staged, final, self.storage.open_writer(staged, overwrite=True))
        self._open[index] = shard
        return shard

    def _close_shards(self) -> None:
        for index in sorted(self._open):
            shard = self._open.pop(index)
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

    def _commit(self) -> list[OutputFile]:
        stored = [i for i in self._items if i.stored is not None]
        meta = self._metadata()
        if meta is not None:  # appended to the last data file
            item = _Item(Entry(METADATA_KEY, "object"), shard=self._num_shards - 1)
            data, crc = encode_strings([meta])
            self._append(item, DT_STRING, (), [memoryview(data)], crc)
            stored.append(item)
        self._shard_for(self._num_shards - 1)  # opens it when nothing was written (an empty checkpoint)
        self._close_shards()
        index_items = {i.entry.key.encode(): i.stored.encode() for i in stored}  # type: ignore[union-attr]
        for link in self._links:
            target = self._by_key[self._resolve(link.key)]  # type: ignore[index]
            if target.stored is not None:  # a link to a None value lives in the metadata only
                index_items[link.key.encode()] = target.stored.encode()
        header = BundleHeader(self._num_shards, LITTLE, VersionDef(BUNDLE_VERSION, 0))
        table = build_table([(b"", header.encode()), *sorted(index_items.items())])
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
        out = [OutputFile(s.final, s.size, None, "data") for s in self._done]
        out.append(OutputFile(idx_final, len(table), None, "index"))
        return out

    def _abort(self) -> None:
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
