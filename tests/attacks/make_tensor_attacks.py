"""Generate the safetensors and PyTorch pickle files of the attack corpus.

Run from the repository root: ``.venv/bin/python tests/attacks/make_tensor_attacks.py [OUT_DIR]``
(default: this directory). Every file is small (at most a few KiB) and is committed; the tests
read the committed files and also regenerate them to check that this script still works.

The payloads that "execute code" only run ``echo pwned > ckptconv_attack_marker`` in the current
directory, so a loader that wrongly executes them leaves a visible, harmless marker file.
Index files that try to escape their directory come as small directories.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import sys
import zipfile
from pathlib import Path

MARKER = "ckptconv_attack_marker"

# name -> (error class name expected, when it is raised: "open" | "read")
EXPECTED: dict[str, tuple[str, str]] = {
    "st_huge_header_length.safetensors": ("CorruptCheckpoint", "open"),
    "st_header_past_end.safetensors": ("CorruptCheckpoint", "open"),
    "st_not_json.safetensors": ("CorruptCheckpoint", "open"),
    "st_bad_utf8.safetensors": ("CorruptCheckpoint", "open"),
    "st_duplicate_key.safetensors": ("CorruptCheckpoint", "open"),
    "st_overlap.safetensors": ("CorruptCheckpoint", "open"),
    "st_out_of_range.safetensors": ("CorruptCheckpoint", "open"),
    "st_hole.safetensors": ("CorruptCheckpoint", "open"),
    "st_wrong_size.safetensors": ("CorruptCheckpoint", "open"),
    "st_negative_offset.safetensors": ("CorruptCheckpoint", "open"),
    "st_unknown_dtype.safetensors": ("UnsupportedDtype", "open"),
    "st_metadata_not_str.safetensors": ("CorruptCheckpoint", "open"),
    "st_bad_record.safetensors": ("CorruptCheckpoint", "open"),
    "st_link_cycle.safetensors": ("LinkCycle", "open"),
    "st_truncated.safetensors": ("CorruptCheckpoint", "open"),
    "st_deep_header.safetensors": ("CorruptCheckpoint", "open"),
    "st_deep_metadata.safetensors": ("CorruptCheckpoint", "open"),
    "st_deep_record.safetensors": ("CorruptCheckpoint", "open"),
    "st_index_deep": ("CorruptCheckpoint", "open"),
    "st_index_parent_escape": ("PathEscape", "open"),
    "st_index_absolute_escape": ("PathEscape", "open"),
    "torch_exec.pt": ("UnsafeCheckpoint", "open"),
    "torch_exec_legacy.pt": ("UnsafeCheckpoint", "open"),
    "torch_exec_stack_global.pt": ("UnsafeCheckpoint", "open"),
    "torch_truncated.pt": ("CorruptCheckpoint", "open"),
    "torch_storage_too_small.pt": ("CorruptCheckpoint", "open"),
    "torch_self_reference.pt": ("CorruptCheckpoint", "open"),
    "torch_bad_local_header.pt": ("CorruptCheckpoint", "read"),
    "torch_index_escape": ("PathEscape", "open"),
    # A pickle that torch.save did not write: plain data is not a checkpoint, at every protocol;
    # naming a callable is unsafe, at every protocol. Nesting is bounded inside an archive too.
    **{f"torch_plain_list_p{p}.pt": ("UnsupportedFormat", "open") for p in (0, 2, 3, 4, 5)},
    **{f"torch_plain_exec_p{p}.pt": ("UnsafeCheckpoint", "open") for p in (0, 2, 3, 4, 5)},
    "torch_deep_nesting.pt": ("CorruptCheckpoint", "open"),
}


class _RunsShell:
    """Pickles as a call of os.system: what a malicious checkpoint would carry."""

    def __reduce__(self):
        return (os.system, (f"echo pwned > {MARKER}",))


def exec_pickle(protocol: int = 2) -> bytes:
    return pickle.dumps({"w": _RunsShell()}, protocol=protocol)


# --- safetensors -----------------------------------------------------------------------------


def _st(header: dict | bytes, data: bytes, *, length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def _tensor(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def safetensors_files() -> dict[str, bytes]:
    two = {"a": _tensor("F32", [2], 0, 8), "b": _tensor("F32", [2], 8, 16)}
    good = _st(two, bytes(range(16)))
    return {
        "st_huge_header_length.safetensors": _st(b"{}", b"", length=1 << 62),
        "st_header_past_end.safetensors": _st(b"{}", b"", length=4096),
        "st_not_json.safetensors": _st(b"{not json at all", b""),
        "st_bad_utf8.safetensors": _st(b'{"\xff\xfe": 1}', b""),
        "st_duplicate_key.safetensors": _st(
            b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
            b'"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}',
            bytes(16),
        ),
        "st_overlap.safetensors": _st({"a": _tensor("F32", [2], 0, 8), "b": _tensor("F32", [2], 4, 12)}, bytes(12)),
        "st_out_of_range.safetensors": _st({"a": _tensor("F32", [4], 0, 16)}, bytes(8)),
        "st_hole.safetensors": _st({"a": _tensor("F32", [2], 0, 8), "b": _tensor("F32", [2], 12, 20)}, bytes(20)),
        "st_wrong_size.safetensors": _st({"a": _tensor("F32", [3], 0, 8)}, bytes(8)),
        "st_negative_offset.safetensors": _st({"a": _tensor("F32", [2], -8, 0)}, bytes(8)),
        "st_unknown_dtype.safetensors": _st({"a": _tensor("Q4", [2], 0, 8)}, bytes(8)),
        "st_metadata_not_str.safetensors": _st({"__metadata__": {"format": 1}, **two}, bytes(16)),
        "st_bad_record.safetensors": _st(
            {
                "__metadata__": {
                    "format": "pt",
                    "ckptconv": json.dumps(
                        {"version": 1, "keys": ["a", "b", "c"], "entries": {"c": {"kind": "link", "target": "zz"}}}
                    ),
                },
                **two,
            },
            bytes(16),
        ),
        # Two keys recorded as links to each other: both are stored, neither holds the value.
        "st_link_cycle.safetensors": _st(
            {
                "__metadata__": {
                    "format": "pt",
                    "ckptconv": json.dumps(
                        {
                            "version": 1,
                            "keys": ["a", "b"],
                            "entries": {"a": {"kind": "link", "target": "b"}, "b": {"kind": "link", "target": "a"}},
                        }
                    ),
                },
                **two,
            },
            bytes(16),
        ),
        "st_truncated.safetensors": good[: len(good) - 5],
        # Nesting far past Python's recursion limit: json.loads would raise RecursionError.
        "st_deep_header.safetensors": _st(b'{"a":' + b"[" * DEEP + b"]" * DEEP + b"}", b""),
        "st_deep_metadata.safetensors": _st(b'{"__metadata__":{"format":' + b"{" * DEEP + b"}" * DEEP + b"}}", b""),
        # A metadata string that is itself JSON (the record ckptconv writes), nested deep.
        "st_deep_record.safetensors": _st(
            {"__metadata__": {"format": "pt", "ckptconv": "[" * DEEP + "]" * DEEP}, **two}, bytes(16)
        ),
    }


DEEP = 20_000


def _escape_index(shard: str) -> bytes:
    return json.dumps({"metadata": {"total_size": 8}, "weight_map": {"a": shard}}).encode()


def index_dirs() -> dict[str, dict[str, bytes]]:
    shard = _st({"a": _tensor("F32", [2], 0, 8)}, bytes(8))
    return {
        "st_index_parent_escape": {
            "model.safetensors.index.json": _escape_index("../escaped.safetensors"),
            "model.safetensors": shard,
        },
        "st_index_absolute_escape": {
            "model.safetensors.index.json": _escape_index("/etc/passwd"),
            "model.safetensors": shard,
        },
        "st_index_deep": {
            "model.safetensors.index.json": b'{"weight_map":{"a":"model.safetensors"},"metadata":'
            + b"[" * DEEP
            + b"]" * DEEP
            + b"}",
            "model.safetensors": shard,
        },
        "torch_index_escape": {
            "pytorch_model.bin.index.json": _escape_index("../../pytorch_model.bin"),
        },
    }


# --- torch pickles ---------------------------------------------------------------------------


def _torch_bytes(state: object) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _small_state() -> dict:
    import torch

    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.float16)}


def _rezip(original: bytes, replace: dict[str, bytes]) -> bytes:
    """A torch zip archive with some records replaced (same names and order, stored)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(original)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            name = info.filename.split("/", 1)[1]
            dst.writestr(zipfile.ZipInfo(info.filename, (1980, 1, 1, 0, 0, 0)), replace.get(name, src.read(info)))
    return out.getvalue()


def _self_reference_pickle() -> bytes:
    # PROTO 2, EMPTY_DICT, BINPUT 0, "loop", EMPTY_LIST, BINPUT 1, BINGET 1, APPEND, SETITEM, STOP:
    # {"loop": l} where l = [l].
    return b"\x80\x02}q\x00X\x04\x00\x00\x00loop]q\x01h\x01as."


def _stack_global_pickle() -> bytes:
    # Protocol 4 names the callable with STACK_GLOBAL (two strings on the stack) instead of the
    # GLOBAL opcode: a loader that only screened GLOBAL would run it.
    def short(text: str) -> bytes:
        return b"\x8c" + bytes([len(text)]) + text.encode()

    return b"\x80\x04" + short("os") + short("system") + b"\x93" + short(f"echo pwned > {MARKER}") + b"\x85R."


def _deep_pickle(depth: int) -> bytes:
    # PROTO 2, then EMPTY_LIST + MARK ``depth`` times, then APPENDS ``depth`` times: [[[...]]].
    return b"\x80\x02" + b"](" * depth + b"e" * depth + b"."


def _legacy_exec() -> bytes:
    # The legacy (pre-1.6) layout starts with three small pickles; the payload sits where the
    # state dict belongs.
    head = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(1001, protocol=2)
    head += pickle.dumps({"protocol_version": 1001, "little_endian": True}, protocol=2)
    return head + exec_pickle()


def _storage_too_small(good: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(good)) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    # Storage "0" of 6 floats claims 1000 elements (the pickled BININT1 6 becomes BININT2 1000).
    patched = pkl.replace(b"X\x03\x00\x00\x00cpuq\x06K\x06t", b"X\x03\x00\x00\x00cpuq\x06M\xe8\x03t", 1)
    if patched == pkl:
        raise RuntimeError("torch.save's pickle changed; update _storage_too_small")
    return _rezip(good, {"data.pkl": patched})


def _bad_local_header(good: bytes) -> bytes:
    """Storage ``1``'s local header signature broken: the central directory still reads fine."""
    with zipfile.ZipFile(io.BytesIO(good)) as z:
        offset = next(i.header_offset for i in z.infolist() if i.filename.endswith("/data/1"))
    raw = bytearray(good)
    raw[offset : offset + 4] = b"XXXX"
    return bytes(raw)


def torch_files() -> dict[str, bytes]:
    good = _torch_bytes(_small_state())
    return {
        "torch_exec.pt": _rezip(good, {"data.pkl": exec_pickle()}),
        "torch_exec_legacy.pt": _legacy_exec(),
        "torch_exec_stack_global.pt": _rezip(good, {"data.pkl": _stack_global_pickle()}),
        "torch_truncated.pt": good[: len(good) // 2],
        "torch_storage_too_small.pt": _storage_too_small(good),
        "torch_self_reference.pt": _rezip(good, {"data.pkl": _self_reference_pickle()}),
        "torch_bad_local_header.pt": _bad_local_header(good),
        **{f"torch_plain_list_p{p}.pt": pickle.dumps([1, 2, 3], protocol=p) for p in (0, 2, 3, 4, 5)},
        **{f"torch_plain_exec_p{p}.pt": pickle.dumps(_RunsShell(), protocol=p) for p in (0, 2, 3, 4, 5)},
        "torch_deep_nesting.pt": _rezip(good, {"data.pkl": _deep_pickle(5_000)}),
    }


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, data in {**safetensors_files(), **torch_files()}.items():
        (out / name).write_bytes(data)
    for name, files in index_dirs().items():
        (out / name).mkdir(exist_ok=True)
        for fname, data in files.items():
            (out / name / fname).write_bytes(data)
    missing = set(EXPECTED) - {p.name for p in out.iterdir()}
    if missing:
        raise RuntimeError(f"not generated: {sorted(missing)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
