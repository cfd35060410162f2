"""The few TensorFlow protobuf messages a saver bundle index holds, encoded and decoded by hand.

A bundle's ``.index`` maps each tensor name to a serialized ``BundleEntryProto`` and the empty key
to a ``BundleHeaderProto`` (``tensorflow/core/protobuf/tensor_bundle.proto``). Those messages and
the ones they embed (``TensorShapeProto``, ``TensorSliceProto``, ``VersionDef``) are small and
stable, so ckptconv speaks their wire format directly instead of depending on protobuf or
TensorFlow at run time.

Encoding follows proto3 as TensorFlow serializes it: fields in number order, scalar fields equal
to their default omitted, embedded messages present even when empty (a scalar's shape is an empty
``TensorShapeProto``), so the bytes match what TensorFlow writes. Decoding skips unknown fields and
raises :class:`~ckptconv.core.errors.CorruptCheckpoint` on malformed input.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ckptconv.core.errors import CorruptCheckpoint

# --- DataType (tensorflow/core/framework/types.proto) ----------------------------------------

DT_STRING = 7
DT_RESOURCE = 20
DT_VARIANT = 21

# TF DataType enum value -> ckptconv dtype name (see ckptconv.core.dtypes.DTYPE_SIZES).
TF_TO_DTYPE: dict[int, str] = {
    1: "float32",  # DT_FLOAT
    2: "float64",  # DT_DOUBLE
    3: "int32",  # DT_INT32
    4: "uint8",  # DT_UINT8
    5: "int16",  # DT_INT16
    6: "int8",  # DT_INT8
    8: "complex64",  # DT_COMPLEX64
    9: "int64",  # DT_INT64
    10: "bool",  # DT_BOOL
    14: "bfloat16",  # DT_BFLOAT16
    17: "uint16",  # DT_UINT16
    18: "complex128",  # DT_COMPLEX128
    19: "float16",  # DT_HALF
    22: "uint32",  # DT_UINT32
    23: "uint64",  # DT_UINT64
    24: "float8_e5m2",  # DT_FLOAT8_E5M2
    25: "float8_e4m3fn",  # DT_FLOAT8_E4M3FN
}
DTYPE_TO_TF: dict[str, int] = {v: k for k, v in TF_TO_DTYPE.items()}

# Names for messages about dtypes ckptconv cannot map (quantized, resource, variant, 4-bit...).
TF_DTYPE_NAMES: dict[int, str] = {
    0: "DT_INVALID",
    7: "DT_STRING",
    11: "DT_QINT8",
    12: "DT_QUINT8",
    13: "DT_QINT32",
    15: "DT_QINT16",
    16: "DT_QUINT16",
    20: "DT_RESOURCE",
    21: "DT_VARIANT",
    26: "DT_FLOAT8_E4M3FNUZ",
    27: "DT_FLOAT8_E4M3B11FNUZ",
    28: "DT_FLOAT8_E5M2FNUZ",
    29: "DT_INT4",
    30: "DT_UINT4",
}


def tf_dtype_name(code: int) -> str:
    if code in TF_TO_DTYPE:
        return TF_TO_DTYPE[code]
    return TF_DTYPE_NAMES.get(code, f"DataType {code}")


# --- wire primitives ---------------------------------------------------------------------------

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_U64 = (1 << 64) - 1


def encode_varint(value: int) -> bytes:
    """Unsigned LEB128; negative ints are encoded as their 64-bit two's complement (10 bytes)."""
    value &= _U64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(buf: bytes | memoryview, pos: int, limit: int | None = None) -> tuple[int, int]:
    """Decode one unsigned varint at ``pos``; returns (value, next position)."""
    end = len(buf) if limit is None else limit
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise CorruptCheckpoint("truncated varint in TensorFlow index")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise CorruptCheckpoint("varint longer than 10 bytes in TensorFlow index")


def _signed64(value: int) -> int:
    value &= _U64
    return value - (1 << 64) if value >= 1 << 63 else value


def _signed32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _fields(buf: bytes | memoryview) -> list[tuple[int, int, int | bytes]]:
    """Every (field number, wire type, value) of one message; LEN values as bytes."""
    out: list[tuple[int, int, int | bytes]] = []
    pos = 0
    end = len(buf)
    while pos < end:
        tag, pos = decode_varint(buf, pos)
        num, wire = tag >> 3, tag & 7
        if num == 0:
            raise CorruptCheckpoint("protobuf field number 0 in TensorFlow index")
        if wire == _VARINT:
            value, pos = decode_varint(buf, pos)
            out.append((num, wire, value))
        elif wire == _FIXED64:
            if pos + 8 > end:
                raise CorruptCheckpoint("truncated fixed64 in TensorFlow index")
            out.append((num, wire, struct.unpack_from("<Q", buf, pos)[0]))
            pos += 8
        elif wire == _FIXED32:
            if pos + 4 > end:
                raise CorruptCheckpoint("truncated fixed32 in TensorFlow index")
            out.append((num, wire, struct.unpack_from("<I", buf, pos)[0]))
            pos += 4
        elif wire == _LEN:
            length, pos = decode_varint(buf, pos)
            if pos + length > end:
                raise CorruptCheckpoint("length-delimited field runs past its message in TensorFlow index")
            out.append((num, wire, bytes(buf[pos : pos + length])))
            pos += length
        else:
            raise CorruptCheckpoint(f"unsupported protobuf wire type {wire} in TensorFlow index")
    return out


def _expect(wire: int, want: int, what: str) -> None:
    if wire != want:
        raise CorruptCheckpoint(f"{what} has protobuf wire type {wire}, expected {want}")


def _tag(num: int, wire: int) -> bytes:
    return encode_varint((num << 3) | wire)


def _int_field(num: int, value: int) -> bytes:
    return _tag(num, _VARINT) + encode_varint(value) if value else b""


def _msg_field(num: int, payload: bytes) -> bytes:
    return _tag(num, _LEN) + encode_varint(len(payload)) + payload


# --- messages ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VersionDef:
    producer: int = 0
    min_consumer: int = 0
    bad_consumers: tuple[int, ...] = ()

    def encode(self) -> bytes:
        out = _int_field(1, self.producer) + _int_field(2, self.min_consumer)
        if self.bad_consumers:
            packed = b"".join(encode_varint(v) for v in self.bad_consumers)
            out += _msg_field(3, packed)
        return out

    @classmethod
    def decode(cls, buf: bytes) -> VersionDef:
        producer = min_consumer = 0
        bad: list[int] = []
        for num, wire, value in _fields(buf):
            if num == 1:
                _expect(wire, _VARINT, "VersionDef.producer")
                producer = _signed32(value)  # type: ignore[arg-type]
            elif num == 2:
                _expect(wire, _VARINT, "VersionDef.min_consumer")
                min_consumer = _signed32(value)  # type: ignore[arg-type]
            elif num == 3:
                if wire == _VARINT:
                    bad.append(_signed32(value))  # type: ignore[arg-type]
                else:
                    _expect(wire, _LEN, "VersionDef.bad_consumers")
                    pos = 0
                    while pos < len(value):  # type: ignore[arg-type]
                        v, pos = decode_varint(value, pos)  # type: ignore[arg-type]
                        bad.append(_signed32(v))
        return cls(producer, min_consumer, tuple(bad))


LITTLE, BIG = 0, 1


@dataclass(frozen=True)
class BundleHeader:
    """``BundleHeaderProto``: the value stored under the empty key of every bundle index."""

    num_shards: int = 1
    endianness: int = LITTLE
    version: VersionDef = field(default_factory=VersionDef)

    def encode(self) -> bytes:
        return _int_field(1, self.num_shards) + _int_field(2, self.endianness) + _msg_field(3, self.version.encode())

    @classmethod
    def decode(cls, buf: bytes) -> BundleHeader:
        num_shards, endianness, version = 0, LITTLE, VersionDef()
        for num, wire, value in _fields(buf):
            if num == 1:
                _expect(wire, _VARINT, "BundleHeaderProto.num_shards")
                num_shards = _signed32(value)  # type: ignore[arg-type]
            elif num == 2:
                _expect(wire, _VARINT, "BundleHeaderProto.endianness")
                endianness = int(value)  # type: ignore[arg-type]
            elif num == 3:
                _expect(wire, _LEN, "BundleHeaderProto.version")
                version = VersionDef.decode(value)  # type: ignore[arg-type]
        return cls(num_shards, endianness, version)


FULL_EXTENT = -1  # TensorSlice's length of an extent that covers its whole dimension


@dataclass(frozen=True)
class Extent:
    start: int = 0
    length: int = FULL_EXTENT  # FULL_EXTENT when the proto's ``length`` is unset

    @property
    def is_full(self) -> bool:
        return self.length == FULL_EXTENT


def encode_slice(extents: tuple[Extent, ...]) -> bytes:
    """``TensorSliceProto``: one ``extent`` message per dimension."""
    out = b""
    for e in extents:
        body = _int_field(1, e.start)
        if not e.is_full:  # oneof member: present even when 0
            body += _tag(2, _VARINT) + encode_varint(e.length)
        out += _msg_field(1, body)
    return out


def decode_slice(buf: bytes) -> tuple[Extent, ...]:
    extents: list[Extent] = []
    for num, wire, value in _fields(buf):
        if num != 1:
            continue
        _expect(wire, _LEN, "TensorSliceProto.extent")
        if len(extents) == MAX_RANK:
            raise CorruptCheckpoint(f"tensor slice has more than {MAX_RANK} extents")
        start, length = 0, FULL_EXTENT
        for n2, w2, v2 in _fields(value):  # type: ignore[arg-type]
            if n2 == 1:
                _expect(w2, _VARINT, "TensorSliceProto.Extent.start")
                start = _signed64(v2)  # type: ignore[arg-type]
            elif n2 == 2:
                _expect(w2, _VARINT, "TensorSliceProto.Extent.length")
                length = _signed64(v2)  # type: ignore[arg-type]
        if start < 0 or (length < 0 and length != FULL_EXTENT):
            raise CorruptCheckpoint(f"tensor slice extent has a negative start or length ({start}, {length})")
        extents.append(Extent(start, length))
    return tuple(extents)


def encode_shape(shape: tuple[int, ...]) -> bytes:
    """``TensorShapeProto``: one ``dim`` message per dimension (a 0-sized dim is an empty message)."""
    return b"".join(_msg_field(2, _int_field(1, d)) for d in shape)


# TensorFlow's TensorShape holds at most 254 dimensions: a deeper shape was not written by it.
MAX_RANK = 254
# Partitioned variables are split in as many slices as parameter servers: a few, at most hundreds.
# Their overlap check compares every pair, so the count is bounded.
MAX_SLICES = 1024


def decode_shape(buf: bytes) -> tuple[int, ...]:
    dims: list[int] = []
    for num, wire, value in _fields(buf):
        if num == 2:
            _expect(wire, _LEN, "TensorShapeProto.dim")
            if len(dims) == MAX_RANK:
                raise CorruptCheckpoint(f"tensor shape has more than {MAX_RANK} dimensions")
            size = 0
            for n2, w2, v2 in _fields(value):  # type: ignore[arg-type]
                if n2 == 1:
                    _expect(w2, _VARINT, "TensorShapeProto.Dim.size")
                    size = _signed64(v2)  # type: ignore[arg-type]
            if size < 0:
                raise CorruptCheckpoint("tensor shape has an unknown (negative) dimension")
            dims.append(size)
        elif num == 3 and value:
            raise CorruptCheckpoint("tensor shape has unknown rank")
    return tuple(dims)


@dataclass(frozen=True)
class BundleEntry:
    """``BundleEntryProto``: where one tensor's bytes live and how to check them."""

    dtype: int = 0
    shape: tuple[int, ...] = ()
    shard_id: int = 0
    offset: int = 0
    size: int = 0
    crc32c: int = 0  # masked crc32c of the stored bytes
    slices: tuple[tuple[Extent, ...], ...] = ()

    def encode(self) -> bytes:
        out = _int_field(1, self.dtype) + _msg_field(2, encode_shape(self.shape))
        out += _int_field(3, self.shard_id) + _int_field(4, self.offset) + _int_field(5, self.size)
        if self.crc32c:
            out += _tag(6, _FIXED32) + struct.pack("<I", self.crc32c)
        for s in self.slices:
            out += _msg_field(7, encode_slice(s))
        return out

    @classmethod
    def decode(cls, buf: bytes) -> BundleEntry:
        dtype = shard_id = offset = size = crc = 0
        shape: tuple[int, ...] = ()
        slices: list[tuple[Extent, ...]] = []
        for num, wire, value in _fields(buf):
            if num == 1:
                _expect(wire, _VARINT, "BundleEntryProto.dtype")
                dtype = int(value)  # type: ignore[arg-type]
            elif num == 2:
                _expect(wire, _LEN, "BundleEntryProto.shape")
                shape = decode_shape(value)  # type: ignore[arg-type]
            elif num == 3:
                _expect(wire, _VARINT, "BundleEntryProto.shard_id")
                shard_id = _signed32(value)  # type: ignore[arg-type]
            elif num == 4:
                _expect(wire, _VARINT, "BundleEntryProto.offset")
                offset = _signed64(value)  # type: ignore[arg-type]
            elif num == 5:
                _expect(wire, _VARINT, "BundleEntryProto.size")
                size = _signed64(value)  # type: ignore[arg-type]
            elif num == 6:
                _expect(wire, _FIXED32, "BundleEntryProto.crc32c")
                crc = int(value)  # type: ignore[arg-type]
            elif num == 7:
                _expect(wire, _LEN, "BundleEntryProto.slices")
                if len(slices) == MAX_SLICES:
                    raise CorruptCheckpoint(f"bundle entry lists more than {MAX_SLICES} slices")
                slices.append(decode_slice(value))  # type: ignore[arg-type]
        if shard_id < 0 or offset < 0 or size < 0:
            raise CorruptCheckpoint(f"bundle entry has a negative shard, offset or size ({shard_id}, {offset}, {size})")
        return cls(dtype, shape, shard_id, offset, size, crc, tuple(slices))
