"""The TensorFlow V2 bundle's encoding, shared by its reader (``tf_bundle``) and writer (``tf_bundle_write``).

A bundle is named by its prefix ``P``: ``P.index`` is a sorted table (``ckptconv.formats.tf_table``)
mapping each tensor name to a ``BundleEntryProto`` (``ckptconv.formats.tf_proto``) that says where
its bytes live in ``P.data-SSSSS-of-NNNNN`` (shard, offset, size) and their masked crc32c; the
empty key holds the ``BundleHeaderProto``. Numeric tensors are their raw little-endian bytes;
string tensors are varint lengths, a masked checksum of the lengths, then the bytes.

This module holds what both directions must agree on: the file names of a prefix, the index keys
of partitioned-variable slices, the string-tensor encoding and the tensor bytes of a value.
"""

from __future__ import annotations

import math
import pickle
import re
import struct
import sys
from typing import TYPE_CHECKING, Any

from ckptconv.core.errors import (
    CorruptCheckpoint,
    ObjectNotFound,
)
from ckptconv.core.uri import basename
from ckptconv.formats.base import OpaqueObject
from ckptconv.formats.tf_proto import (
    DT_STRING,
    DTYPE_TO_TF,
    Extent,
    decode_varint,
    encode_varint,
)
from ckptconv.formats.tf_table import crc32c_extend, mask_crc, unmask_crc

if TYPE_CHECKING:
    import torch

    from ckptconv.storage.base import Storage

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
        name = basename(path) if path.startswith("/") or "://" in path else path
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


def native_strings(obj: OpaqueObject, shape_hint: Any) -> tuple[list[bytes], tuple[int, ...]] | None:
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


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor in C order (no copy when it is already contiguous)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def value_tensor(value: Any) -> tuple[int, bytes] | None:
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


JSON_VALUE_TYPES = (bool, int, float, str, type(None))
