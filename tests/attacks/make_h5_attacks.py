"""Generate the Cerebras H5 files of the attack corpus (see README.md beside this script).

Run from the repository root: ``.venv/bin/python tests/attacks/make_h5_attacks.py [OUT_DIR]``
(default: this directory). Every file is small (a few KiB) and is committed; the tests read the
committed files and also regenerate them to check that this script still works.

The payloads that "execute code" only run ``echo pwned > ckptconv_attack_marker`` in the current
directory, so a loader that wrongly executes them leaves a visible, harmless marker file.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from pathlib import Path

import h5py
import numpy as np

MARKER = "ckptconv_attack_marker"

# name -> (error class name expected, when it is raised: "open" | "read")
EXPECTED: dict[str, tuple[str, str]] = {
    "h5_no_success.mdl": ("IncompleteCheckpoint", "open"),
    "h5_truncated.mdl": ("CorruptCheckpoint", "open"),
    "h5_shape_mismatch.mdl": ("CorruptCheckpoint", "open"),
    "h5_missing_metadata.mdl": ("CorruptCheckpoint", "open"),
    "h5_link_cycle.mdl": ("LinkCycle", "open"),
    "h5_unknown_serializer.mdl": ("UnsupportedFormat", "open"),
    "h5_external_link.mdl": ("UnsafeCheckpoint", "open"),
    "h5_bad_lz4_chunk.mdl": ("CorruptCheckpoint", "read"),
    "h5_bytes_exec.mdl": (None, "read"),  # reads fine: the payload stays opaque, never executed
    "h5_legacy_spec_exec.mdl": ("UnsafeCheckpoint", "open"),
    # Attributes no writer makes: refused by type and size before h5py materializes them.
    "h5_reference_attr.mdl": ("CorruptCheckpoint", "open"),
    "h5_nested_compound_attr.mdl": ("CorruptCheckpoint", "open"),
    "h5_amplified_strings.mdl": ("CorruptCheckpoint", "open"),
    "h5_huge_attr.mdl": ("CorruptCheckpoint", "open"),
    # A global heap collection HDF5 would walk forever: refused before HDF5 parses it.
    "h5_heap_loop.mdl": ("CorruptCheckpoint", "open"),
    "h5_heap_loop_far.mdl": ("CorruptCheckpoint", "open"),  # the same past the first 4 KiB read
}


class _RunsShell:
    """Pickles as a call of os.system: what a malicious checkpoint would carry."""

    def __reduce__(self):
        return (os.system, (f"echo pwned > {MARKER}",))


def exec_pickle() -> bytes:
    return pickle.dumps(_RunsShell(), protocol=4)


def _small_checkpoint(path: Path) -> None:
    import torch

    from ckptconv.formats.base import Entry
    from ckptconv.formats.cs_h5 import CsH5Sink
    from ckptconv.formats.tree import flatten
    from ckptconv.storage import open_storage

    state = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}, "step": 3}
    leaves, spec = flatten(state)
    entries = [
        Entry(k, "tensor", str(v.dtype).removeprefix("torch."), tuple(v.shape))
        if isinstance(v, torch.Tensor)
        else Entry(k, "value", value=v)
        for k, v in leaves
    ]
    # LZ4-chunked, as cstorch writes it (the bad-chunk attack needs a chunked dataset).
    sink = CsH5Sink(open_storage(str(path)), str(path), fsync=False, compression="lz4")
    sink.begin(entries, spec)
    for k, v in leaves:
        sink.write(k, v)
    sink.commit()


def make(out: Path) -> list[Path]:
    import json

    out.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []

    def fresh(name: str) -> Path:
        p = out / name
        if p.exists():
            p.unlink()
        made.append(p)
        return p

    p = fresh("h5_no_success.mdl")
    _small_checkpoint(p)
    with h5py.File(p, "r+") as f:
        del f.attrs["__SUCCESS__"]

    p = fresh("h5_truncated.mdl")
    _small_checkpoint(p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])

    p = fresh("h5_shape_mismatch.mdl")
    _small_checkpoint(p)
    with h5py.File(p, "r+") as f:
        rec = json.loads(f.attrs["model.w.__metadata__"])
        rec["model.w.__metadata__"]["shapes"] = [[3, 2]]
        f.attrs["model.w.__metadata__"] = json.dumps(rec, indent=4)
        del f["model.w"].attrs["shapes"]

    p = fresh("h5_missing_metadata.mdl")
    _small_checkpoint(p)
    with h5py.File(p, "r+") as f:
        del f.attrs["model.b.__metadata__"]

    p = fresh("h5_link_cycle.mdl")
    _small_checkpoint(p)
    with h5py.File(p, "r+") as f:  # model.w and model.b tied to each other: no value behind either
        for key, target in (("model.w", "model.b"), ("model.b", "model.w")):
            rec = json.loads(f.attrs[f"{key}.__metadata__"])
            rec[f"{key}.__metadata__"] = {
                "key": target,
                "__LINKED__": True,
                "__TYPE__": "LinkedObject",
                "__NONE__": True,
            }
            f.attrs[f"{key}.__metadata__"] = json.dumps(rec, indent=4)

    p = fresh("h5_unknown_serializer.mdl")
    _small_checkpoint(p)
    with h5py.File(p, "r+") as f:
        rec = json.loads(f.attrs["step.__metadata__"])
        rec["step.__metadata__"]["__TYPE__"] = "EvalSerializer"
        f.attrs["step.__metadata__"] = json.dumps(rec, indent=4)

    p = fresh("h5_external_link.mdl")
    _small_checkpoint(p)
    with h5py.File(p, "r+") as f:
        del f["model.b"]
        f["model.b"] = h5py.ExternalLink("elsewhere.h5", "/secret")

    p = fresh("h5_bad_lz4_chunk.mdl")
    _small_checkpoint(p)
    with h5py.File(p, "r") as f:
        info = f["model.w"].id.get_chunk_info(0)
    with open(p, "r+b") as fh:
        fh.seek(info.byte_offset)
        fh.write((1 << 40).to_bytes(8, "big"))  # claims a 1 TiB chunk

    p = fresh("h5_bytes_exec.mdl")
    _small_checkpoint(p)
    with h5py.File(p, "r+") as f:
        rec = json.loads(f.attrs["step.__metadata__"])
        rec["step.__metadata__"] = {"__TYPE__": "ObjectSerializer", "__BYTES__": True, "compressed": False}
        f.attrs["step.__metadata__"] = json.dumps(rec, indent=4)
        ds = f.create_dataset("step", data=h5py.Empty("f"), track_order=True)
        ds.attrs["__TYPE__"] = "ObjectSerializer"
        ds.attrs["compressed"] = np.bool_(False)
        ds.attrs["__BYTES__"] = np.frombuffer(exec_pickle(), dtype="V1")

    p = fresh("h5_legacy_spec_exec.mdl")
    with h5py.File(p, "w") as f:
        f.attrs["__spec__"] = exec_pickle().hex()
        f.attrs["__version__"] = 0.4
        ds = f.create_dataset("w", data=np.zeros(3, np.float32))
        ds.attrs["__H5_TYPE__"] = "TorchTensorH5Type"
        ds.attrs["is_bfloat16"] = np.bool_(False)
    p = fresh("h5_reference_attr.mdl")
    _small_checkpoint(p)
    with h5py.File(p, "r+") as f:
        f.attrs["model.w.__metadata__"] = np.array([f["model.w"].ref] * 3)

    p = fresh("h5_nested_compound_attr.mdl")
    _small_checkpoint(p)
    nested = np.dtype("i4")
    for _ in range(30):
        nested = np.dtype([("a", nested)])
    with h5py.File(p, "r+") as f:
        f["model.w"].attrs.create("dtypes", np.zeros((), nested))

    p = fresh("h5_amplified_strings.mdl")
    _amplified_strings(p)

    p = fresh("h5_huge_attr.mdl")
    _small_checkpoint(p)
    with h5py.File(p, "r+") as f:
        f["model.w"].attrs["shapes"] = np.full((1, 997), 7, dtype=np.int64)
    data = p.read_bytes()
    # The attribute's dataspace (its size and maximum size): 8 TiB of int64 in a 24 KB file.
    p.write_bytes(data.replace(struct.pack("<Q", 997), struct.pack("<Q", 1 << 40)))

    p = fresh("h5_heap_loop.mdl")
    _small_checkpoint(p)
    _zero_free_space(p)

    p = fresh("h5_heap_loop_far.mdl")
    _small_checkpoint(p)
    with h5py.File(p, "r+") as f:  # a string of its own collection, larger than HDF5's first read
        f.attrs["model.w.__metadata__"] = f.attrs["model.w.__metadata__"] + " " * 6000
    _free_space_past_first_read(p)
    return made


def _free_space_past_first_read(path: Path) -> None:
    """In the collection holding one string longer than 4 KiB, declare that string shorter and
    follow it with free space of 0 bytes, 4,232 bytes in: HDF5 reads a collection's first 4 KiB,
    then the rest, and walks the whole."""
    data = bytearray(path.read_bytes())
    at = data.find(b"GCOL")
    while struct.unpack_from("<Q", data, at + 8)[0] <= 4096:
        at = data.find(b"GCOL", at + 1)
    struct.pack_into("<Q", data, at + 16 + 8, 4200)  # the first object: 16 + 4200 bytes
    struct.pack_into("<HHIQ", data, at + 16 + 16 + 4200, 0, 0, 0, 0)
    path.write_bytes(bytes(data))


def _zero_free_space(path: Path) -> None:
    """Set to 0 the size of the free space that ends the first global heap collection (where the
    variable-length strings of the root's attributes live): HDF5 then never leaves that object."""
    data = bytearray(path.read_bytes())
    at = data.find(b"GCOL")
    (size,) = struct.unpack_from("<Q", data, at + 8)
    p = 16  # each object: index (2), reference count (2), reserved (4), size (8), data padded to 8
    while p + 16 <= size:
        index, length = struct.unpack_from("<H", data, at + p)[0], struct.unpack_from("<Q", data, at + p + 8)[0]
        if index == 0:
            struct.pack_into("<Q", data, at + p + 8, 0)
            path.write_bytes(bytes(data))
            return
        p += 16 + ((length + 7) & ~7)
    raise RuntimeError("the collection has no free space to zero")


def _amplified_strings(path: Path, count: int = 400, size: int = 20_000) -> None:
    """A dataset attribute of ``count`` variable-length strings that all point at one heap
    object of ``size`` bytes: 48 KB on disk, 8 MB once read (more with larger counts)."""
    _small_checkpoint(path)
    with h5py.File(path, "r+") as f:
        f["model.w"].attrs["dtypes"] = np.array(["A" * size] + [""] * count, dtype=h5py.string_dtype())
    data = bytearray(path.read_bytes())
    # Each element on disk: length (4 bytes), heap collection address (8), object index (4).
    first = data.find(struct.pack("<I", size))
    ref = bytes(data[first : first + 16])
    for k in range(1, count + 1):
        at = first + 16 * k
        assert data[at : at + 4] == bytes(4), "the empty strings follow the long one"
        data[at : at + 16] = ref
    path.write_bytes(bytes(data))


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    for path in make(target):
        print(f"{path.name}: {path.stat().st_size} bytes")
