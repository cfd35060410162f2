"""Generate the TensorFlow bundle files of the attack corpus (see README.md beside this script).

Run from the repository root: ``.venv/bin/python tests/attacks/make_tf_attacks.py [OUT_DIR]``
(default: this directory). Each attack is a small directory holding TensorFlow's ``checkpoint``
state file, ``ckpt.index`` and ``ckpt.data-00000-of-00001``, so its URI is the directory. The
index tables are assembled here byte by byte, because every one of them is something a correct
writer never produces.
"""

from __future__ import annotations

import shutil
import struct
import sys
from pathlib import Path

# name -> (error class name expected, when it is raised: "open" | "read")
EXPECTED: dict[str, tuple[str | None, str]] = {
    "tf_block_reuse": ("CorruptCheckpoint", "open"),
    "tf_block_past_end": ("CorruptCheckpoint", "open"),
    "tf_snappy_claim": ("CorruptCheckpoint", "open"),
    "tf_huge_length": ("CorruptCheckpoint", "open"),
    "tf_long_varint": ("CorruptCheckpoint", "open"),
    "tf_deep_rank": ("CorruptCheckpoint", "open"),
    "tf_huge_dims": ("CorruptCheckpoint", "open"),
    "tf_many_slices": ("CorruptCheckpoint", "open"),
    "tf_many_shards": ("CorruptCheckpoint", "open"),
    "tf_string_count": ("CorruptCheckpoint", "open"),
    # Nesting inside a field the reader does not know is skipped whole, never descended into.
    "tf_deep_unknown_field": (None, "read"),
}

DATA = struct.pack("<2f", 1.0, 2.0)  # the one float32[2] tensor "w" every bundle here holds
MAGIC = 0xDB4775248B80FB57


def varint(value: int) -> bytes:
    from ckptconv.formats.tf_proto import encode_varint

    return encode_varint(value)


def field(num: int, wire: int, payload: bytes) -> bytes:
    """One protobuf field; ``payload`` is the varint or the bytes of a length-delimited value."""
    return varint(num << 3 | wire) + (varint(len(payload)) + payload if wire == 2 else payload)


def header(num_shards: int = 1) -> bytes:
    """BundleHeaderProto: shards, little-endian, VersionDef(producer=1)."""
    return field(1, 0, varint(num_shards)) + field(3, 2, field(1, 0, varint(1)))


def entry(shape: list[int], *, dtype: int = 1, size: int = len(DATA), extra: bytes = b"") -> bytes:
    """BundleEntryProto of shard 0, offset 0, with the masked crc32c of DATA."""
    from ckptconv.formats.tf_table import crc32c_extend, mask_crc

    dims = b"".join(field(2, 2, field(1, 0, varint(d))) for d in shape)
    crc = mask_crc(crc32c_extend(0, DATA))
    crc_field = field(6, 5, struct.pack("<I", crc))
    return field(1, 0, varint(dtype)) + field(2, 2, dims) + field(5, 0, varint(size)) + crc_field + extra


def block(items: list[tuple[bytes, bytes]]) -> bytes:
    """A table block without prefix compression: one restart point per entry."""
    body, restarts = bytearray(), []
    for key, value in items:
        restarts.append(len(body))
        body += varint(0) + varint(len(key)) + varint(len(value)) + key + value
    return bytes(body) + b"".join(struct.pack("<I", r) for r in restarts) + struct.pack("<I", len(restarts))


def table(data_blocks: list[bytes], handles: list[tuple[int, int]] | None = None, *, snappy: bool = False) -> bytes:
    """A table file; ``handles`` (block number, size override) make the index lie."""
    from ckptconv.formats.tf_table import crc32c_extend, mask_crc

    out = bytearray()

    def put(contents: bytes, ctype: int = 0) -> tuple[int, int]:
        at = len(out)
        out.extend(contents)
        crc = crc32c_extend(crc32c_extend(0, contents), bytes([ctype]))
        out.extend(bytes([ctype]) + struct.pack("<I", mask_crc(crc)))
        return at, len(contents)

    placed = [put(b, 1 if snappy else 0) for b in data_blocks]
    if handles is None:
        handles = [(i, placed[i][1]) for i in range(len(placed))]
    index = [(b"k%06d" % n, varint(placed[i][0]) + varint(size)) for n, (i, size) in enumerate(handles)]
    meta = put(block([]))
    idx = put(block(index))
    footer = (varint(meta[0]) + varint(meta[1]) + varint(idx[0]) + varint(idx[1])).ljust(40, b"\0")
    return bytes(out) + footer + struct.pack("<Q", MAGIC)


def plain(value: bytes) -> bytes:
    """The index of a bundle whose tensor "w" has the entry ``value``."""
    return table([block([(b"", header()), (b"w", value)])])


def indexes() -> dict[str, bytes]:
    many = [(b"", header())] + [(b"w%05d" % i, entry([2])) for i in range(400)]
    deep = b""
    for _ in range(5000):
        deep = field(1, 2, deep)
    return {
        # 2,000 index entries naming one 20 KB data block: decoded once each, 40 MB from 40 KB.
        "tf_block_reuse": table([block(many)], [(0, len(block(many)))] * 2000),
        "tf_block_past_end": table([block([(b"", header()), (b"w", entry([2]))])], [(0, 1 << 40)]),
        # A 16-byte snappy block that announces (just under) a gibibyte once decompressed.
        "tf_snappy_claim": table([varint((1 << 30) - 1) + bytes(12)], snappy=True),
        "tf_huge_length": plain(field(1, 0, varint(1)) + varint(2 << 3 | 2) + varint(1 << 62)),
        "tf_long_varint": plain(field(1, 0, varint(1)) + varint(5 << 3) + b"\xff" * 11 + b"\x01"),
        "tf_deep_rank": plain(entry([1] * 300)),
        "tf_huge_dims": plain(entry([1 << 40, 1 << 40])),
        "tf_many_slices": plain(entry([2]) + field(7, 2, field(1, 2, b"")) * 2000),
        "tf_many_shards": table([block([(b"", header(1 << 30)), (b"w", entry([2]))])]),
        "tf_string_count": plain(entry([10**12], dtype=7)),
        "tf_deep_unknown_field": plain(entry([2], extra=field(99, 2, deep))),
    }


def make(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for name, index in indexes().items():
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
        (d / "checkpoint").write_text('model_checkpoint_path: "ckpt"\n')
        (d / "ckpt.index").write_bytes(index)
        (d / "ckpt.data-00000-of-00001").write_bytes(DATA)
        made.append(d)
    return made


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    for path in make(target):
        print(f"{path.name}: {sum(p.stat().st_size for p in path.iterdir())} bytes")
