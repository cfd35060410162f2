"""Which safetensors headers are valid: ckptconv's reader against the reference implementation.

Every accept/reject case of the reference implementation's header tests (the Rust crate's
``tensor.rs`` tests and the Python binding's ``test_simple.py``), plus a few edges of the same
rules. Each case is run through the installed ``safetensors`` library too, so the table is
checked against the reference itself, not only against what it says.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from safetensors import deserialize

from ckptconv.core.errors import CkptconvError
from ckptconv.formats.detect import detect_source_format
from ckptconv.formats.safetensors_fmt import SafetensorsSource
from ckptconv.storage import open_storage

ACCEPT, REJECT = "accept", "reject"


def sfile(header: str | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A file: the length prefix (the header's own length unless given), the header, the data."""
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def tensor(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def hjson(doc: dict) -> str:
    return json.dumps(doc, separators=(",", ":"))


I32_2x2 = hjson({"test": tensor("I32", [2, 2], 0, 16)})
ZEROS16 = bytes(16)

CASES: list[tuple[str, bytes, str]] = [
    # Accepted by the reference.
    ("one tensor", sfile(I32_2x2, ZEROS16), ACCEPT),
    ("one tensor, space padded to 8", sfile(I32_2x2 + "    ", ZEROS16), ACCEPT),
    ("scalar (empty shape)", sfile(hjson({"test": tensor("I32", [], 0, 4)}), bytes(4)), ACCEPT),
    ("zero-sized tensor, no data", sfile('{"test":{"dtype":"I32","shape":[2,0],"data_offsets":[0, 0]}}'), ACCEPT),
    (
        "metadata and a tensor",
        sfile(hjson({"__metadata__": {"framework": "pt"}, "test1": tensor("I32", [2, 2], 0, 16)}) + " " * 7, ZEROS16),
        ACCEPT,
    ),
    ("no tensors", sfile("{}      "), ACCEPT),
    ("no tensors, metadata only", sfile(hjson({"__metadata__": {"framework": "pt"}}) + "     "), ACCEPT),
    ("trailing JSON whitespace", sfile(b"{}\r \t\n"), ACCEPT),
    ("leading JSON whitespace", sfile(b"\t\n{}\r "), ACCEPT),
    ("leading whitespace before a tensor", sfile(b"  \n\t" + I32_2x2.encode(), ZEROS16), ACCEPT),
    (
        "tensors listed out of offset order",
        sfile(hjson({"b": tensor("U8", [2], 2, 4), "a": tensor("U8", [2], 0, 2)}), bytes(4)),
        ACCEPT,
    ),
    # Refused by the reference.
    ("empty file", b"", REJECT),
    ("shorter than the length prefix", b"\x08\x00\x00", REJECT),
    ("header length past the end", sfile(b"", length=60), REJECT),
    ("header length over the limit", b"<\x00\x00\x00\x00\xff\xff\xff" + I32_2x2.encode() + ZEROS16, REJECT),
    ("header not UTF-8", sfile(b"\xff"), REJECT),
    ("header not JSON", sfile(b"{"), REJECT),
    ("header a JSON array", sfile(b"[]"), REJECT),
    ("NUL before the header", sfile(b"\x00\x00{}\r "), REJECT),
    ("byte order mark before the header", sfile(b"\xef\xbb\xbf{}"), REJECT),
    ("junk after the header", sfile(b"{} x"), REJECT),
    ("data past the last tensor", sfile(I32_2x2, ZEROS16 + b"extra_bogus_data_for_polyglot_file"), REJECT),
    ("data shorter than the tensors", sfile(I32_2x2, bytes(14)), REJECT),
    (
        "ten tensors on the same bytes",
        sfile(hjson({f"weight_{i}": tensor("F32", [2, 2], 0, 16) for i in range(10)}), ZEROS16),
        REJECT,
    ),
    (
        "size disagrees with shape and dtype",
        sfile('{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0, 4]}}'),
        REJECT,
    ),
    ("shape overflows", sfile(hjson({"test": tensor("I32", [2, 18446744073709551614], 0, 16)}), ZEROS16), REJECT),
    (
        "shape times dtype overflows",
        sfile(hjson({"test": tensor("I32", [2, 9223372036854775807], 0, 16)}), ZEROS16),
        REJECT,
    ),
    (
        "hole between tensors",
        sfile(hjson({"a": tensor("U8", [2], 0, 2), "b": tensor("U8", [2], 3, 5)}), bytes(5)),
        REJECT,
    ),
    ("unknown dtype", sfile(hjson({"test": tensor("Q7", [2], 0, 2)}), bytes(2)), REJECT),
    ("metadata value not a string", sfile(hjson({"__metadata__": {"n": 1}})), REJECT),
]


def reference_verdict(raw: bytes) -> str:
    try:
        deserialize(raw)
    except Exception:  # the binding raises SafetensorError, and OverflowError/ValueError for some inputs
        return REJECT
    return ACCEPT


def our_verdict(path: Path) -> tuple[str, dict[str, tuple[str, tuple[int, ...]]]]:
    try:
        src = SafetensorsSource(open_storage(str(path)), str(path))
        found = {}
        for e in src.entries():
            t = src.read(e.key)
            found[e.key] = (e.dtype, tuple(t.shape))
    except CkptconvError:
        return REJECT, {}
    return ACCEPT, found


@pytest.mark.parametrize(("name", "raw", "verdict"), CASES, ids=[c[0] for c in CASES])
def test_header_verdicts_match_the_reference(tmp_path: Path, name: str, raw: bytes, verdict: str) -> None:
    assert reference_verdict(raw) == verdict, "the table disagrees with the installed safetensors"
    path = tmp_path / "case.safetensors"
    path.write_bytes(raw)
    ours, found = our_verdict(path)
    assert ours == verdict
    if verdict == ACCEPT:
        ref = {k: v["shape"] for k, v in deserialize(raw)}
        assert {k: list(shape) for k, (_, shape) in found.items()} == ref
        # A file whose name says nothing is told by its bytes, padding included.
        unnamed = tmp_path / "weights.bin"
        unnamed.write_bytes(raw)
        assert detect_source_format(open_storage(str(unnamed)), str(unnamed)) == "safetensors"


def test_a_leading_padded_file_converts(tmp_path: Path) -> None:
    """A file written with leading padding is a checkpoint like any other: it converts and verifies."""
    import torch

    from ckptconv.engine.convert import convert

    header = hjson({"__metadata__": {"format": "pt"}, "w": tensor("F32", [2], 0, 8)})
    src = tmp_path / "padded.safetensors"
    src.write_bytes(sfile("\n  " + header, struct.pack("<2f", 1.5, -2.0)))
    convert(str(src), str(tmp_path / "out.pt"), to="torch")
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert loaded["w"].tolist() == [1.5, -2.0]
