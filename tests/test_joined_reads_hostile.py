"""Hostile and odd inputs for the joined reads over S3 (neighbouring tensors of one file read with
one ranged GET, each into its own buffer), and for the per-key reads they fall back to.

Every value read either way must be what h5py (or the safetensors library) reads from the same
bytes, or a typed error: never an untyped exception, a crash, or a different value. Inputs are
tiny files patched by hand; each test is fast.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from cstorch_tree import NumpyArray, entries_from_tree, write_all
from safetensors.torch import save

from ckptconv.core.errors import CorruptCheckpoint, OutOfMemory
from ckptconv.engine.convert import convert
from ckptconv.engine.prefetch import Prefetcher
from ckptconv.formats.cs_h5 import CsH5Sink, CsH5Source
from ckptconv.formats.detect import open_source
from ckptconv.storage import open_storage


def _save_h5(path: Path, tree: dict) -> None:
    """A Cerebras H5 file in ckptconv's contiguous layout: datasets back to back, as on S3."""
    entries, spec, values = entries_from_tree(tree)
    write_all(CsH5Sink(open_storage(str(path)), str(path)), entries, spec, values)


def _on_s3(bucket: str, path: Path) -> str:
    uri = f"s3://{bucket}/hostile/{path.name}"
    open_storage(uri).write_bytes(uri, path.read_bytes())
    return uri


def _source(where: str) -> CsH5Source:
    return CsH5Source(open_storage(where), where)


def _h5py_values(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: np.asarray(f[k][()]) for k in f}


def _replace_dataset(f: h5py.File, name: str, tid, data: np.ndarray, mtype=None) -> None:
    """Dataset ``name`` again with HDF5 type ``tid`` (contiguous, allocated), its attributes kept."""
    attrs = dict(f[name].attrs)
    del f[name]
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dsid = h5py.h5d.create(f.id, name.encode(), tid, h5py.h5s.create_simple(data.shape), dcpl=dcpl)
    dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, data, mtype=mtype)
    ds = h5py.Dataset(dsid)
    for k, v in attrs.items():
        ds.attrs[k] = v


def _move_dataset(path: Path, name: str, to: int) -> None:
    """Point dataset ``name``'s data address at byte ``to`` (its layout message patched)."""
    with h5py.File(path, "r") as f:
        old = f[name].id.get_offset()
    blob = bytearray(path.read_bytes())
    at = struct.pack("<Q", old)
    assert blob.count(at) == 1  # the layout message's address, and nothing else
    i = blob.index(at)
    blob[i : i + 8] = struct.pack("<Q", to)
    path.write_bytes(bytes(blob))


# --- bools -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "base", [h5py.h5t.STD_U8LE, h5py.h5t.STD_I16LE, h5py.h5t.STD_I8BE], ids=["uint8", "int16", "int8-big-endian"]
)
def test_a_bool_enum_over_another_integer_holding_2_is_refused(base, s3_bucket, tmp_path):
    """h5py names a FALSE/TRUE enum over any integer ``bool``; only over its own int8 are the bytes
    read as they are (and checked). Over another integer HDF5 converts, and turns a stored 2 into
    0xFF: the bool tensor held a byte 255, silently, where an int8 enum's 2 was refused."""
    path = tmp_path / "bools.mdl"
    _save_h5(path, {"a": torch.ones(4), "m": torch.zeros(4, dtype=torch.bool), "c": torch.ones(2)})
    with h5py.File(path, "r+") as f:
        tid = h5py.h5t.enum_create(base)
        tid.enum_insert(b"FALSE", 0)
        tid.enum_insert(b"TRUE", 1)
        _replace_dataset(f, "m", tid, np.array([1, 0, 2, 1], base.dtype), mtype=base)
        assert f["m"].dtype == np.bool_ and f["m"][()].view(np.uint8).max() == 255  # what h5py hands out
    for where in (str(path), _on_s3(s3_bucket, path)):
        with _source(where) as src:
            assert src.extent("m") is None  # not plain bits: never read with its neighbours
            with pytest.raises(CorruptCheckpoint, match="'m': bool tensor holds values other than 0 and 1"):
                src.read("m")
            with pytest.raises(CorruptCheckpoint, match="'m': bool"):
                src.read_neighbours(["a", "m", "c"])
            assert torch.equal(src.read("a"), torch.ones(4))


def test_a_bool_numpy_array_entry_holding_2_is_refused(s3_bucket, tmp_path):
    """A numpy-array entry (kind ``array``) of bools is read past HDF5 as a tensor entry is; its
    bytes were not checked: a byte 2 came out as a bool tensor holding 2."""
    path = tmp_path / "array.mdl"
    _save_h5(path, {"arr": NumpyArray(torch.tensor([True, False, True])), "t": torch.ones(2)})
    with h5py.File(path, "r") as f:
        assert f["arr"].dtype == np.bool_
        offset = f["arr"].id.get_offset()
    blob = bytearray(path.read_bytes())
    blob[offset + 1] = 2
    path.write_bytes(bytes(blob))
    for where in (str(path), _on_s3(s3_bucket, path)):
        with _source(where) as src, pytest.raises(CorruptCheckpoint, match="'arr': bool tensor holds values other"):
            src.read("arr")


# --- datasets that share bytes, point outside, or are not plain ------------------------------------


def test_overlapping_and_coinciding_datasets_read_as_h5py_reads_them(s3_bucket, tmp_path):
    """Two datasets over the same bytes, or one overlapping its neighbour: never joined (their
    extents do not follow each other), and every value is h5py's, through the whole conversion."""
    tree = {k: torch.arange(8, dtype=torch.float32) + 100 * i for i, k in enumerate("abcd")}
    path = tmp_path / "overlap.mdl"
    _save_h5(path, tree)
    with h5py.File(path, "r") as f:
        a = f["a"].id.get_offset()
    _move_dataset(path, "b", a + 8)  # half over a's bytes
    _move_dataset(path, "d", a)  # exactly a's bytes
    expected = _h5py_values(path)
    assert expected["b"].tolist() == [2, 3, 4, 5, 6, 7, 100, 101]  # really overlapping
    uri = _on_s3(s3_bucket, path)
    with _source(uri) as src:
        extents = [src.extent(k) for k in "abcd"]
        assert extents[3].offset == extents[0].offset and extents[1].offset == extents[0].offset + 8
        pf = Prefetcher(src, list("abcd"), {k: 32 for k in "abcd"}, 1 << 20, workers=2)
        try:
            for k in "abcd":
                assert pf.get(k).numpy().tolist() == expected[k].tolist(), k
        finally:
            pf.stop()
    out = tmp_path / "out.safetensors"
    convert(uri, str(out), to="safetensors")
    with open_source(str(out)) as back:
        assert all(back.read(k).numpy().tolist() == expected[k].tolist() for k in "abcd")


def test_odd_datasets_among_joined_ones_read_as_h5py_reads_them(s3_bucket, tmp_path):
    """Big-endian floats, a float with its own exponent bias (h5py calls it float64), an empty
    dataset, bf16 bits and bools among plain neighbours, in an order of keys that is not the file's:
    only plain bits are joined, and every value is h5py's, joined or not, locally and on S3."""
    g = torch.Generator().manual_seed(3)
    tree = {
        "z.first": torch.randn(5, generator=g),
        "be": torch.zeros(6),
        "empty": torch.zeros(0),
        "odd": torch.zeros(3),
        "bf": torch.randn(7, generator=g).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "a.last": torch.randn(4, generator=g).double(),
    }
    path = tmp_path / "odd.mdl"
    _save_h5(path, tree)
    with h5py.File(path, "r+") as f:
        _replace_dataset(f, "be", h5py.h5t.IEEE_F32BE, np.array([1.5, -2, 3e10, 0, 7, 8], np.float32))
        biased = h5py.h5t.IEEE_F32LE.copy()
        biased.set_ebias(100)
        _replace_dataset(f, "odd", biased, np.array([1.0, 2.0, -0.5], np.float32), mtype=h5py.h5t.NATIVE_FLOAT)
    expected = _h5py_values(path)

    def as_h5py(key: str, value: torch.Tensor) -> list:
        if key == "bf":  # stored as its int16 bits
            return torch.from_numpy(expected[key]).view(torch.bfloat16).tolist()
        return torch.from_numpy(expected[key].astype(expected[key].dtype.newbyteorder("="))).to(value.dtype).tolist()

    uri = _on_s3(s3_bucket, path)
    with _source(uri) as src:
        assert [k for k in tree if src.extent(k) is None] == ["be", "empty", "odd"]
        plain = sorted((k for k in tree if src.extent(k)), key=lambda k: src.extent(k).offset)
        runs: list[list[str]] = []  # the replaced datasets left holes: runs of neighbours
        for k in plain:
            last = src.extent(runs[-1][-1]) if runs else None
            if last is not None and last.offset + last.nbytes == src.extent(k).offset:
                runs[-1].append(k)
            else:
                runs.append([k])
        assert max(len(r) for r in runs) >= 3
        for run in runs:
            for k, v in zip(run, src.read_neighbours(run), strict=True):
                assert v.tolist() == as_h5py(k, v) == src.read(k).tolist(), k
    for where in (str(path), uri):
        out = tmp_path / f"out-{where[:2]}.safetensors"
        convert(where, str(out), to="safetensors")
        with open_source(str(out)) as back:
            for k in tree:
                value = back.read(k)
                assert value.dtype == tree[k].dtype and value.tolist() == as_h5py(k, value), (where, k)


# --- objects that change after they were opened ------------------------------------------------------


def test_an_object_shortened_after_open_is_a_typed_error_joined_or_not(s3_bucket, tmp_path):
    """The object cut inside the second of three neighbours after the source recorded their
    extents: the joined read is a short read (CorruptCheckpoint), and the prefetcher's one-by-one
    retry hands over the first value and fails the second, typed."""
    tree = {k: torch.arange(8, dtype=torch.float32) + 100 * i for i, k in enumerate("abc")}
    path = tmp_path / "cut.mdl"
    _save_h5(path, tree)
    uri = _on_s3(s3_bucket, path)
    storage = open_storage(uri)
    with _source(uri) as src:
        b = src.extent("b")
        storage.write_bytes(uri, path.read_bytes()[: b.offset + 10], overwrite=True)
        with pytest.raises(CorruptCheckpoint, match="ends early"):
            src.read_neighbours(["a", "b", "c"])
        pf = Prefetcher(src, list("abc"), {k: 32 for k in "abc"}, 1 << 20, workers=1)
        try:
            assert torch.equal(pf.get("a"), tree["a"])
            with pytest.raises(CorruptCheckpoint, match="ends early"):
                pf.get("b")
        finally:
            pf.stop()


@pytest.mark.parametrize("joined", [True, False])
def test_an_object_replaced_after_open_is_refused_not_read_as_the_old_one(s3_bucket, tmp_path, joined):
    # An object replaced by one of the same size between the open and the reads of its tensors
    # (a training job writing its latest checkpoint to the same key): every read is of the
    # version the source was opened on, or refused.
    tree = {k: torch.arange(8, dtype=torch.float32) + 100 * i for i, k in enumerate("abc")}
    path = tmp_path / "replaced.mdl"
    _save_h5(path, tree)
    uri = _on_s3(s3_bucket, path)
    with open_source(uri) as src:
        b = src.extent("b")
        blob = bytearray(path.read_bytes())
        blob[b.offset : b.offset + b.nbytes] = np.full(8, -1.0, np.float32).tobytes()
        open_storage(uri).write_bytes(uri, bytes(blob), overwrite=True)  # same size, another ETag
        with pytest.raises(CorruptCheckpoint, match="was replaced while it was being read"):
            src.read_neighbours(["a", "b", "c"]) if joined else src.read("b")


# --- what a reader may not hand out -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_safetensors_bool_holding_2_is_refused_at_the_source(s3_bucket, tmp_path, where):
    # Passed through, the byte 2 would make a cs-h5 file that ckptconv's own reader refuses.
    blob = bytearray(save({"a": torch.ones(4), "m": torch.tensor([True, False, True]), "c": torch.zeros(2)}))
    n = int.from_bytes(blob[:8], "little")
    blob[8 + n + json.loads(blob[8 : 8 + n])["m"]["data_offsets"][0] + 1] = 2
    uri = f"s3://{s3_bucket}/hostile/bool.safetensors" if where == "s3" else str(tmp_path / "bool.safetensors")
    open_storage(uri).write_bytes(uri, bytes(blob))
    out = tmp_path / "out.mdl"
    with pytest.raises(CorruptCheckpoint, match="'m': bool tensor holds values other than 0 and 1"):
        convert(uri, str(out), to="cs-h5")
    assert not out.exists()
    with open_source(uri) as src:
        with pytest.raises(CorruptCheckpoint, match="'m': bool tensor"):
            src.read("m")
        if where == "s3":
            with pytest.raises(CorruptCheckpoint, match="'m': bool tensor"):
                src.read_neighbours(sorted("amc", key=lambda k: src.extent(k).offset))


def test_a_huge_declared_dataset_with_no_storage_is_a_typed_error(tmp_path, s3_bucket):
    path = tmp_path / "huge.mdl"
    _save_h5(path, {"a": torch.ones(2), "h": torch.zeros(8)})
    n = 1 << 40
    with h5py.File(path, "r+") as f:
        attrs = dict(f["h"].attrs, shapes=np.array([[n]]))
        del f["h"]
        ds = f.create_dataset("h", shape=(n,), dtype="f4")  # contiguous, never written: no storage
        for k, v in attrs.items():
            ds.attrs[k] = v
        record = json.loads(f.attrs["h.__metadata__"])
        record["h.__metadata__"]["shapes"] = [[n]]
        f.attrs["h.__metadata__"] = json.dumps(record)
    assert path.stat().st_size < 2 << 20
    with _source(str(path)) as src:
        assert src.entries()[1].nbytes == 4 * n
        with pytest.raises(OutOfMemory, match="no memory for a value of 4,398,046,511,104 bytes"):
            src.read("h")
    with pytest.raises(OutOfMemory):
        convert(str(path), f"s3://{s3_bucket}/huge/out.mdl", to="cs-h5")
    assert not list(open_storage(f"s3://{s3_bucket}/").list(f"s3://{s3_bucket}/huge/"))
