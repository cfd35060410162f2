"""The sorted key/value table behind a TensorFlow bundle's ``.index`` file (LevelDB's table format).

Layout, as TensorFlow's ``table::TableBuilder`` writes it:

- data blocks of entries ``varint32 shared, varint32 non_shared, varint32 value_len, key suffix,
  value`` (keys are prefix-compressed against the previous key, except at restart points), then
  the restart offsets as fixed32 and their count as fixed32;
- after every block a 5-byte trailer: compression type (0 none, 1 snappy) and the masked crc32c of
  the block plus that type byte;
- a metaindex block (empty: bundles use no filters) and an index block whose entries map a key
  ``>=`` the last key of each data block to that block's handle (varint64 offset, varint64 size);
- a 48-byte footer: the metaindex and index handles, zero padding to 40 bytes, and the fixed64
  magic number ``0xdb4775248b80fb57``.

TensorFlow up to 1.1 wrote bundle index blocks snappy-compressed (type 1), as LevelDB does, and
every TensorFlow still reads them (TF Serving's test models are such files); they are decoded with
``cramjam``. Newer TensorFlow, and ckptconv's writer, leave blocks uncompressed.

The index holds one small entry per tensor, so it is read and written whole; tensor data never
passes through here.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable

import cramjam
import crc32c as _crc32c

from ckptconv.core.errors import CorruptCheckpoint, UnsupportedFormat
from ckptconv.formats.tf_proto import decode_varint, encode_varint

MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48
BLOCK_TRAILER_SIZE = 5
NO_COMPRESSION = 0
SNAPPY_COMPRESSION = 1

# TensorFlow's table::Options defaults; readers accept any values.
BLOCK_SIZE = 256 << 10
RESTART_INTERVAL = 16
# A block decompresses to at most this much (TensorFlow's are ~256 KiB; an index is read whole anyway).
MAX_BLOCK_BYTES = 1 << 30
# Snappy's densest element, a 3-byte copy, yields 64 bytes: no block expands more than this.
MAX_SNAPPY_RATIO = 22

_MASK_DELTA = 0xA282EAD8


def crc32c_extend(crc: int, data: bytes | bytearray | memoryview) -> int:
    """Continue a CRC-32C (Castagnoli) over ``data``; start with 0."""
    return _crc32c.crc32c(data, value=crc)


def mask_crc(crc: int) -> int:
    """LevelDB/TensorFlow checksum masking: stored checksums are rotated and offset."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def unmask_crc(masked: int) -> int:
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


# --- reading -----------------------------------------------------------------------------------


def _handle(buf: bytes, pos: int) -> tuple[int, int, int]:
    offset, pos = decode_varint(buf, pos)
    size, pos = decode_varint(buf, pos)
    return offset, size, pos


def _block(data: bytes, offset: int, size: int, what: str) -> memoryview:
    """The contents of one block, checksum verified and trailer removed."""
    end = offset + size
    if end + BLOCK_TRAILER_SIZE > len(data) - FOOTER_SIZE:
        raise CorruptCheckpoint(f"TensorFlow index {what} block [{offset}, +{size}) lies outside the file")
    ctype = data[end]
    (stored,) = struct.unpack_from("<I", data, end + 1)
    actual = crc32c_extend(crc32c_extend(0, memoryview(data)[offset:end]), data[end : end + 1])
    if unmask_crc(stored) != actual:
        raise CorruptCheckpoint(f"TensorFlow index {what} block fails its crc32c check")
    if ctype == SNAPPY_COMPRESSION:
        return memoryview(_unsnappy(bytes(memoryview(data)[offset:end]), what))
    if ctype != NO_COMPRESSION:
        raise CorruptCheckpoint(f"TensorFlow index {what} block has unknown compression type {ctype}")
    return memoryview(data)[offset:end]


def _unsnappy(raw: bytes, what: str) -> bytes:
    """A raw (unframed) snappy block, its announced size checked before anything is allocated."""
    try:
        size, _ = decode_varint(raw, 0)
    except CorruptCheckpoint:
        raise CorruptCheckpoint(f"TensorFlow index {what} block: snappy data without a length") from None
    if size > min(MAX_BLOCK_BYTES, MAX_SNAPPY_RATIO * len(raw)):
        raise CorruptCheckpoint(
            f"TensorFlow index {what} block of {len(raw)} bytes claims {size} bytes once snappy-decompressed"
        )
    try:
        out = bytes(cramjam.snappy.decompress_raw(raw))
    except cramjam.DecompressionError as e:
        raise CorruptCheckpoint(f"TensorFlow index {what} block is not valid snappy data: {e}") from None
    if len(out) != size:
        raise CorruptCheckpoint(f"TensorFlow index {what} block: snappy gave {len(out)} bytes, not {size}")
    return out


def iter_block(block: memoryview | bytes) -> list[tuple[bytes, bytes]]:
    """Decode every (key, value) of one uncompressed block, in stored order."""
    n = len(block)
    if n < 4:
        raise CorruptCheckpoint("TensorFlow index block is shorter than its restart count")
    (num_restarts,) = struct.unpack_from("<I", block, n - 4)
    limit = n - 4 - 4 * num_restarts
    if num_restarts == 0 and n > 4:
        raise CorruptCheckpoint("TensorFlow index block has entries but no restart points")
    if limit < 0:
        raise CorruptCheckpoint("TensorFlow index block restart array is larger than the block")
    out: list[tuple[bytes, bytes]] = []
    pos = 0
    key = b""
    while pos < limit:
        shared, pos = decode_varint(block, pos, limit)
        non_shared, pos = decode_varint(block, pos, limit)
        value_len, pos = decode_varint(block, pos, limit)
        if shared > len(key) or pos + non_shared + value_len > limit:
            raise CorruptCheckpoint("TensorFlow index block entry is malformed")
        key = key[:shared] + bytes(block[pos : pos + non_shared])
        pos += non_shared
        out.append((key, bytes(block[pos : pos + value_len])))
        pos += value_len
    return out


def read_table(data: bytes) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a whole table file, in key order; checks structure and checksums."""
    if len(data) < FOOTER_SIZE:
        raise CorruptCheckpoint(f"TensorFlow index is {len(data)} bytes, shorter than its 48-byte footer")
    footer_at = len(data) - FOOTER_SIZE
    (magic,) = struct.unpack_from("<Q", data, len(data) - 8)
    if magic != MAGIC:
        raise UnsupportedFormat(
            "not a TensorFlow bundle index (footer magic number does not match)",
            hint="pass the checkpoint prefix (e.g. dir/ckpt-1, beside dir/ckpt-1.index) of a TF2 or TF1 V2 checkpoint",
        )
    footer = data[footer_at : len(data) - 8]
    _meta_off, _meta_size, pos = _handle(footer, 0)
    index_off, index_size, _ = _handle(footer, pos)
    if index_off + index_size + BLOCK_TRAILER_SIZE > footer_at:
        raise CorruptCheckpoint("TensorFlow index footer points past the end of the file")
    out: list[tuple[bytes, bytes]] = []
    # Data blocks are written one after the other: handles that go back or overlap would make a
    # small file decode the same block over and over, so each block is read once at most.
    next_free = 0
    for _sep, handle in iter_block(_block(data, index_off, index_size, "index")):
        off, size, end = _handle(handle, 0)
        if end != len(handle) or off + size + BLOCK_TRAILER_SIZE > index_off:
            raise CorruptCheckpoint("TensorFlow index block handle is malformed or out of range")
        if off < next_free:
            raise CorruptCheckpoint("TensorFlow index data blocks overlap or are listed out of order")
        next_free = off + size + BLOCK_TRAILER_SIZE
        out.extend(iter_block(_block(data, off, size, "data")))
    for (a, _), (b, _) in itertools.pairwise(out):
        if not a < b:
            raise CorruptCheckpoint("TensorFlow index keys are not strictly increasing")
    return out


# --- writing -----------------------------------------------------------------------------------


class _BlockBuilder:
    def __init__(self, restart_interval: int) -> None:
        self.restart_interval = restart_interval
        self.buf = bytearray()
        self.restarts = [0]
        self.count = 0
        self.last_key = b""

    def add(self, key: bytes, value: bytes) -> None:
        shared = 0
        if self.count < self.restart_interval:
            limit = min(len(key), len(self.last_key))
            while shared < limit and key[shared] == self.last_key[shared]:
                shared += 1
        else:
            self.restarts.append(len(self.buf))
            self.count = 0
        self.buf += encode_varint(shared) + encode_varint(len(key) - shared) + encode_varint(len(value))
        self.buf += key[shared:] + value
        self.last_key = key
        self.count += 1

    def size_estimate(self) -> int:
        return len(self.buf) + 4 * len(self.restarts) + 4

    def empty(self) -> bool:
        return not self.buf

    def finish(self) -> bytes:
        return (
            bytes(self.buf)
            + b"".join(struct.pack("<I", r) for r in self.restarts)
            + struct.pack("<I", len(self.restarts))
        )


def _shortest_separator(start: bytes, limit: bytes) -> bytes:
    """A short key k with start <= k < limit (LevelDB's BytewiseComparator::FindShortestSeparator)."""
    n = min(len(start), len(limit))
    i = 0
    while i < n and start[i] == limit[i]:
        i += 1
    if i < n and start[i] < 0xFF and start[i] + 1 < limit[i]:
        return start[:i] + bytes([start[i] + 1])
    return start


def _short_successor(key: bytes) -> bytes:
    """A short key >= ``key`` (LevelDB's FindShortSuccessor)."""
    for i, b in enumerate(key):
        if b != 0xFF:
            return key[:i] + bytes([b + 1])
    return key


def build_table(
    items: Iterable[tuple[bytes, bytes]],
    *,
    block_size: int = BLOCK_SIZE,
    restart_interval: int = RESTART_INTERVAL,
    snappy: bool = False,
) -> bytes:
    """Serialize (key, value) pairs, which must be strictly increasing, as one table file.

    ``snappy`` compresses every block as TensorFlow up to 1.1 did; ckptconv writes uncompressed
    tables (every TensorFlow reads those), and uses this only to produce such files for its tests.
    """
    out = bytearray()
    index = _BlockBuilder(1)  # index blocks restart at every entry, as LevelDB's do
    data = _BlockBuilder(restart_interval)
    last: bytes | None = None

    def write_block(contents: bytes) -> bytes:
        offset = len(out)
        if snappy:
            contents = bytes(cramjam.snappy.compress_raw(contents))
        trailer_type = bytes([SNAPPY_COMPRESSION if snappy else NO_COMPRESSION])
        crc = crc32c_extend(crc32c_extend(0, contents), trailer_type)
        out.extend(contents)
        out.extend(trailer_type + struct.pack("<I", mask_crc(crc)))
        return encode_varint(offset) + encode_varint(len(contents))

    pending: tuple[bytes, bytes] | None = None  # (last key, handle) of a block awaiting its index entry

    def flush() -> None:
        nonlocal data, pending
        if data.empty():
            return
        pending = (data.last_key, write_block(data.finish()))
        data = _BlockBuilder(restart_interval)

    for key, value in items:
        if last is not None and not last < key:
            raise ValueError(f"table keys must be strictly increasing: {last!r} then {key!r}")
        if pending is not None:
            # Index keys are short separators between blocks, as LevelDB chooses them, so the
            # index is byte-identical to TensorFlow's for the same entries.
            index.add(_shortest_separator(pending[0], key), pending[1])
            pending = None
        data.add(key, value)
        last = key
        if data.size_estimate() >= block_size:
            flush()
    flush()
    if pending is not None:
        index.add(_short_successor(pending[0]), pending[1])
    meta_handle = write_block(_BlockBuilder(restart_interval).finish())
    index_handle = write_block(index.finish())
    footer = (meta_handle + index_handle).ljust(FOOTER_SIZE - 8, b"\0") + struct.pack("<Q", MAGIC)
    out.extend(footer)
    return bytes(out)
