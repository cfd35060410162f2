"""Cerebras H5 format 0.5: bit-compatibility with real ``cstorch.save``/``cstorch.load`` 2.10 files.

The fixtures in tests/fixtures/cstorch were written by the real cstorch; their JSON says what the
real loader returned (``loaded``) and how the file looks in HDF5 (``h5``). Our reader must return
the same tree; our writer must produce files that read back to the same tree and look the same
in HDF5 (types, dataspaces, filters, attributes, JSON text).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import pickle
import shutil
import struct
import sys
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest
import torch
from cstorch_tree import (
    NumpyArray,
    assert_same_tree,
    copy_checkpoint,
    describe,
    entries_from_tree,
    h5_layout,
    h5_view,
    load_tree,
    write_all,
)
from forked import outcome_in_child
from s3_area import OnS3

from ckptconv.core.errors import (
    CorruptCheckpoint,
    IncompleteCheckpoint,
    InvalidRequest,
    KeyCollision,
    TargetExists,
    UnsafeCheckpoint,
    UnsupportedDtype,
    UnsupportedFormat,
    UnsupportedValue,
)
from ckptconv.formats.base import Entry, OpaqueObject
from ckptconv.formats.cs_h5 import CsH5Sink, CsH5Source
from ckptconv.formats.cs_h5_chunks import lz4_decode_into, lz4_encode, slab_chunk_shape
from ckptconv.formats.tree import flatten
from ckptconv.storage import open_storage
from ckptconv.testing.format_tests import FormatTests

FIXTURES = Path(__file__).parent / "fixtures" / "cstorch"
MDLS = sorted(FIXTURES.glob("*.mdl"))
ATTACKS = Path(__file__).parent / "attacks"
sys.path.insert(0, str(ATTACKS))
import make_h5_attacks  # noqa: E402


def fixture(mdl: Path) -> dict:
    return json.loads(mdl.with_suffix(".json").read_text())


def source(path: Path | str, **kw) -> CsH5Source:
    return CsH5Source(open_storage(str(path)), str(path), **kw)


def sink(path: Path | str, **kw) -> CsH5Sink:
    return CsH5Sink(open_storage(str(path)), str(path), **kw)


def save(path: Path, tree, **kw) -> None:
    entries, spec, values = entries_from_tree(tree)
    write_all(sink(path, **kw), entries, spec, values)


def test_options_the_sink_cannot_use_are_refused_when_it_is_made(tmp_path: Path, s3_bucket: str) -> None:
    # Not after the file's skeleton is built and the source's reads have started.
    with pytest.raises(InvalidRequest, match="LZ4 mode"):
        sink(tmp_path / "a.mdl", lz4="fastest")
    with pytest.raises(InvalidRequest, match="part_size"):
        sink(f"s3://{s3_bucket}/a.mdl", part_size=1 << 20)
    sink(tmp_path / "b.mdl", part_size=1 << 20)  # a local file has no parts
    assert not list(tmp_path.iterdir())


def reload(path: Path):
    with source(path) as src:
        return load_tree(src)


# --- reading real cstorch files -------------------------------------------------------------------


@pytest.mark.parametrize("mdl", MDLS, ids=lambda p: p.stem)
def test_reader_reproduces_cstorch_load(mdl):
    expected = fixture(mdl)
    assert expected["save_ok"] and expected["load_matches_expected"] is not None
    with source(mdl) as src:
        tree = load_tree(src)
        info = src.info
    assert_same_tree(describe(tree), expected["loaded"])
    assert info == {"format_version": 0.5, "cstorch_version": "2.10.0", "release": "2.10", "complete": True}


def test_entries_match_the_raw_records():
    mdl = FIXTURES / "python_objects.mdl"
    h5 = fixture(mdl)["h5"]["file_attrs"]
    with source(mdl) as src:
        entries = src.entries()
    assert [e.key for e in entries] == src.spec.keys()
    for e in entries:
        md = h5[f"{e.key}.__metadata__"]["__json__"][f"{e.key}.__metadata__"]
        kind = {"LinkedObject": "link", "TorchTensorSerializer": "tensor"}.get(md["__TYPE__"], "value")
        assert e.kind == kind, e.key
        if kind == "link":
            assert e.target == md["key"]
        elif kind == "tensor":
            assert e.dtype == md["dtypes"][0].removeprefix("torch.") and list(e.shape) == md["shapes"][0]
        else:
            assert describe(e.value) == describe(md.get("scalar_value", md.get("string_value")))


def test_entries_read_no_tensor_data(tmp_path):
    # A damaged chunk only matters to the read of its own tensor: listing never touches data.
    path = tmp_path / "damaged.mdl"
    shutil.copy(FIXTURES / "dtypes.mdl", path)
    with h5py.File(path, "r") as f:
        where = f["bf16"].id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as fh:
        fh.seek(where)
        fh.write(b"\xff" * 8)
    with source(path) as src:
        assert len(src.entries()) == 11
        with pytest.raises(CorruptCheckpoint, match="bf16"):
            src.read("bf16")
        assert src.read("f16").dtype == torch.float16


# --- writing: our files against the real ones ---------------------------------------------------


@pytest.mark.parametrize("chunking", ["fast", "h5py"])
@pytest.mark.parametrize("mdl", MDLS, ids=lambda p: p.stem)
def test_writer_reproduces_real_files(mdl, chunking, tmp_path):
    expected = fixture(mdl)
    out = tmp_path / mdl.name
    with source(mdl) as src:
        copy_checkpoint(src, sink(out, chunking=chunking, fsync=False))
    assert_same_tree(describe(reload(out)), expected["loaded"])
    # The HDF5 view of the fixture JSON, including chunk shapes (small tensors use h5py's chunks).
    assert h5_view(str(out)) == expected["h5"]
    # Deeper: HDF5 type classes, string encodings, dataspaces, layouts, filters, fill/alloc settings.
    assert h5_layout(str(out)) == h5_layout(str(mdl))
    # JSON text of every root attribute, character for character.
    with h5py.File(mdl, "r") as real, h5py.File(out, "r") as ours:
        assert sorted(real.attrs) == sorted(ours.attrs)
        for name in real.attrs:
            assert ours.attrs[name] == real.attrs[name], name


@pytest.mark.parametrize("probe", sorted(FIXTURES.glob("dtype_probe_*.json")), ids=lambda p: p.stem)
def test_writer_refuses_what_cstorch_refuses(probe, tmp_path):
    data = json.loads(probe.read_text())
    (key, _, node) = data["expected"]["items"][0]
    t = torch.zeros(node["shape"], dtype=getattr(torch, node["dtype"]))
    out = tmp_path / "probe.mdl"
    if data["save_ok"]:
        save(out, {key: t})
        assert reload(out)[key].dtype == t.dtype
        return
    with pytest.raises(UnsupportedDtype, match=node["dtype"]):
        save(out, {key: t})
    with pytest.raises(UnsupportedDtype):
        CsH5Sink.check(entries_from_tree({key: t})[0])  # also without a sink (dry runs)
    assert list(tmp_path.iterdir()) == []


def test_existing_target_is_refused(tmp_path):
    out = tmp_path / "c.mdl"
    out.write_bytes(b"precious")
    with pytest.raises(TargetExists):
        save(out, {"w": torch.ones(2)})
    assert out.read_bytes() == b"precious"
    assert [p.name for p in tmp_path.iterdir()] == ["c.mdl"]


def test_temp_file_until_commit_and_abort_leaves_nothing(tmp_path):
    out = tmp_path / "c.mdl"
    entries, spec, values = entries_from_tree({"a": torch.ones(3), "b": 2})
    s = sink(out)
    s.begin(entries, spec)
    s.write("a", values["a"])
    names = [p.name for p in tmp_path.iterdir()]
    assert len(names) == 1 and names[0].startswith("c.mdl.") and names[0].endswith(".tmp")
    assert len(names[0]) == len("c.mdl.") + 8 + len(".tmp")
    assert not out.exists()
    s.abort()
    assert list(tmp_path.iterdir()) == []

    s = sink(out)
    s.begin(entries, spec)
    s.write("a", values["a"])
    s.write("b", 2)
    s.commit()
    assert [p.name for p in tmp_path.iterdir()] == ["c.mdl"]


def test_key_collisions_are_refused(tmp_path):
    out = tmp_path / "c.mdl"
    with pytest.raises(KeyCollision):
        flatten({"a.b": 1, "a": {"b": 2}})  # the tree layer refuses paths that join alike
    e = Entry("x", "value", value=1)
    with pytest.raises(KeyCollision):
        sink(out).begin([e, e], None)
    # "a" as a dataset and "a/b" would need "a" to be an HDF5 group
    with pytest.raises(KeyCollision):
        save(out, {"a": torch.ones(1), "a/b": torch.ones(1)})
    with pytest.raises(UnsupportedValue):
        save(out, {"a//b": torch.ones(1)})
    assert list(tmp_path.iterdir()) == []


def test_keys_with_slash_make_groups(tmp_path):
    out = tmp_path / "c.mdl"
    tree = {"slash/key": torch.arange(4), "x": {"y/z": torch.ones(2), "v/w": 1}}
    save(out, tree)
    with h5py.File(out, "r") as f:
        assert isinstance(f["slash"], h5py.Group) and "key" in f["slash"]
        assert "slash/key.__metadata__" in f.attrs and "x.v/w.__metadata__" in f.attrs
    assert_same_tree(describe(reload(out)), describe(tree))


# --- the test vectors of cs-checkpoint-format §7 -------------------------------------------------


def test_vector_1_dtypes_and_layout(tmp_path):
    out = tmp_path / "v1.mdl"
    g = torch.Generator().manual_seed(0)
    tree = {
        "model": {
            "w": torch.randn(2, 3, generator=g).to(torch.bfloat16),
            "b": torch.randn(3, generator=g).to(torch.float16),
            "m": torch.tensor([True, False]),
            "i": torch.arange(4),
            "s": torch.tensor(1.5),
            "e": torch.zeros(0),
        },
        "global_step": 10,
    }
    # The default layout: contiguous, no filter (§1.12: the loader reads any layout).
    save(tmp_path / "contiguous.mdl", tree)
    assert_same_tree(describe(reload(tmp_path / "contiguous.mdl")), describe(tree))
    contiguous = h5_layout(str(tmp_path / "contiguous.mdl"))
    for name in ("model.w", "model.b", "model.m", "model.i", "model.e"):
        assert contiguous[name]["filters"] == [] and contiguous[name]["chunks"] is None, name
    # With LZ4, as cstorch writes them: the filter on every dataset but the 0-d one.
    save(out, tree, compression="lz4")
    assert_same_tree(describe(reload(out)), describe(tree))
    layout = h5_layout(str(out))
    assert layout["model.w"]["type"].startswith("int2 ")
    assert layout["model.m"]["type"] == "enum1 base=int1 order=0 signed=1 [(b'FALSE', 0), (b'TRUE', 1)]"
    for name in ("model.w", "model.b", "model.m", "model.i", "model.e"):
        assert layout[name]["filters"] == [(32004, 1, (0,))], name
    assert layout["model.s"]["filters"] == [] and layout["model.s"]["space"] == "scalar"
    assert layout["model.s"]["attrs"]["shapes"] == ("float8 order=0", "simple(1, 0)")
    assert layout["model.i"]["attrs"]["shapes"] == ("int8 order=0 signed=1", "simple(1, 1)")
    assert "global_step" not in layout
    with h5py.File(out, "r") as f:
        rec = json.loads(f.attrs["global_step.__metadata__"])
        assert rec["global_step.__metadata__"] == {"scalar_value": 10, "__TYPE__": "ScalarSerializer", "__NONE__": True}
        rec = json.loads(f.attrs["model.w.__metadata__"])
        assert rec["__objects__"] == ["model.w"]
        assert rec["model.w.__metadata__"]["rtfx_dtypes"] == [15]
        assert f.attrs["__version__"] == 0.5 and f.attrs["__version__"].dtype == np.float64


def test_vector_2_tied_weights_restore_identity(tmp_path):
    out = tmp_path / "v2.mdl"
    emb = torch.randn(8, 4).to(torch.bfloat16)
    save(out, {"model": {"emb": {"weight": emb}, "lm_head": {"weight": emb}}})
    with h5py.File(out, "r") as f:
        assert "model.lm_head.weight" not in f
        rec = json.loads(f.attrs["model.lm_head.weight.__metadata__"])["model.lm_head.weight.__metadata__"]
        assert rec == {"key": "model.emb.weight", "__LINKED__": True, "__TYPE__": "LinkedObject", "__NONE__": True}
    tree = reload(out)
    assert tree["model"]["lm_head"]["weight"] is tree["model"]["emb"]["weight"]
    assert torch.equal(tree["model"]["emb"]["weight"], emb)


def test_vector_3_singletons_are_links(tmp_path):
    out = tmp_path / "v3.mdl"
    save(out, {"a": None, "b": None, "c": 1, "d": 1, "t": True})
    with source(out) as src:
        kinds = {e.key: (e.kind, e.target) for e in src.entries()}
    assert kinds == {
        "a": ("value", None),
        "b": ("link", "a"),
        "c": ("value", None),
        "d": ("link", "c"),
        "t": ("value", None),
    }
    assert reload(out) == {"a": None, "b": None, "c": 1, "d": 1, "t": True}


def test_vector_4_containers(tmp_path):
    out = tmp_path / "v4.mdl"
    tree = {
        "l": [],
        "d": {},
        "t": (1, "x"),
        "od": collections.OrderedDict(z=2),
        "n": [[], [3.5]],
        "s": {7, 8},
        "deep": {"e": (), "f": [{}]},
    }
    save(out, tree)
    got = reload(out)
    assert_same_tree(describe(got), describe(tree))
    assert type(got["od"]) is collections.OrderedDict and type(got["t"]) is tuple and got["s"] == {7, 8}
    with h5py.File(out, "r") as f:
        assert json.loads(f.attrs["__spec__"])[0] is None  # a set makes the skeleton unsayable in JSON


def test_vector_5_int_keys(tmp_path):
    out = tmp_path / "v5.mdl"
    tree = {"state": {0: {"step": torch.tensor(3.0)}, -3: {"x": 1}}, "param_groups": [{"params": [0, 1], "lr": 1e-3}]}
    save(out, tree)
    with source(out) as src:
        assert "state.0.step" in [e.key for e in src.entries()]
    got = reload(out)
    assert list(got["state"]) == [0, -3]
    assert_same_tree(describe(got), describe(tree))


@dataclasses.dataclass
class _Config:  # a user class: its pickle names this module, so it stays opaque
    lr: float = 0.1


def test_vector_6_values_and_objects(tmp_path):
    out = tmp_path / "v6.mdl"
    blob = bytes(range(256)) * 300  # > 64 KiB: needs dense attribute storage
    user_obj = OpaqueObject(pickle.dumps(_Config(), protocol=4))
    tree = {
        "str": "h\u00e9llo \u2713 \u4e16\u754c",
        "nan": float("nan"),
        "inf": float("-inf"),
        "big": 2**70,
        "np_float": np.float64(0.25),
        "dtype": OpaqueObject(pickle.dumps(torch.bfloat16, protocol=4)),
        "np_int": OpaqueObject(pickle.dumps(np.int64(7), protocol=4)),
        "blob": OpaqueObject(pickle.dumps(blob, protocol=4)),
        "user": user_obj,
        "raw_bytes": b"\x00\x01",
        "cplx": 1 + 2j,
        "np_value": np.int64(5),  # pickled by us: with numpy 1's module names, for cstorch's numpy 1.25
        "arr_bf16": NumpyArray(torch.tensor([1.0, -2.0, 3.5]).to(torch.bfloat16)),
        "arr_i8": NumpyArray(torch.tensor([[1, -2]], dtype=torch.int8)),
    }
    save(out, tree)
    with source(out) as src:
        kinds = {e.key: e.kind for e in src.entries()}
        got = {e.key: src.read(e.key) for e in src.entries()}
    assert kinds["arr_bf16"] == "array" and kinds["user"] == "object" and kinds["raw_bytes"] == "object"
    assert got["str"] == tree["str"] and math.isnan(got["nan"]) and got["inf"] == float("-inf")
    assert got["big"] == 2**70 and type(got["np_float"]) is float and got["np_float"] == 0.25
    assert got["dtype"].decoded and got["dtype"].value is torch.bfloat16
    assert got["np_int"].decoded and got["np_int"].value == 7 and isinstance(got["np_int"].value, np.int64)
    assert got["blob"].decoded and got["blob"].value == blob
    assert not got["user"].decoded and got["user"].payload == user_obj.payload
    assert got["raw_bytes"].value == b"\x00\x01" and got["cplx"].value == 1 + 2j
    assert got["np_value"].value == 5 and b"numpy.core.multiarray" in got["np_value"].payload
    assert b"numpy._core" not in got["np_value"].payload
    assert torch.equal(got["arr_bf16"], tree["arr_bf16"].tensor) and got["arr_bf16"].dtype == torch.bfloat16
    assert torch.equal(got["arr_i8"], tree["arr_i8"].tensor)
    layout = h5_layout(str(out))
    assert layout["blob"]["crt_order"] == 3 and layout["blob"]["space"] == "null"
    assert layout["blob"]["attrs"]["__BYTES__"] == ("opaque1 tag=b''", f"simple({len(tree['blob'].payload)},)")
    assert layout["arr_bf16"]["type"].startswith("int2 ")
    assert sorted(layout["arr_bf16"]["attrs"]) == ["__NUMPY__", "__TYPE__", "compressed", "is_bfloat16"]
    with h5py.File(out, "r") as f:
        assert '"string_value": "h\\u00e9llo \\u2713 \\u4e16\\u754c"' in f.attrs["str.__metadata__"]
        assert '"scalar_value": NaN' in f.attrs["nan.__metadata__"]
        assert f"{2**70}" in f.attrs["big.__metadata__"]
    # Opaque payloads travel unchanged through another write.
    again = tmp_path / "again.mdl"
    with source(out) as src:
        copy_checkpoint(src, sink(again))
    with source(again) as src:
        assert src.read("user").payload == user_obj.payload
        assert src.read("blob").payload == tree["blob"].payload


def _write_raw_record(path: Path, records: dict[str, dict], spec_keys: list[str]) -> None:
    """A 0.5 file built by hand from metadata records (for entry kinds no CPU save produces)."""
    from ckptconv.formats.cs_serializers import dumps_json, root_spec_text
    from ckptconv.formats.tree import flat_dict_spec

    with h5py.File(path, "w") as f:
        f.attrs["__spec__"] = root_spec_text(flat_dict_spec(spec_keys))
        f.attrs["__version__"] = 0.5
        f.attrs["__cstorch_version__"] = "2.10.0"
        for key, rec in records.items():
            f.attrs[f"{key}.__metadata__"] = dumps_json(rec)
        f.attrs["__SUCCESS__"] = np.bool_(True)


def _nested_record(key: str, inner: dict, outer: dict) -> dict:
    leaf = {"type": None, "context": None, "children_spec": []}
    node = {"type": "collections.namedtuple", "context": "NestedObject", "children_spec": [leaf, leaf]}
    spec = json.dumps([1, {"type": "builtins.dict", "context": json.dumps([key]), "children_spec": [node]}])
    return {
        "__spec__": [{key: ["*", "*"]}, spec],
        "__objects__": [f"{key}.0"],
        f"{key}.0.__metadata__": inner,
        f"{key}.1.__metadata__": outer,
    }


def test_vector_9_deferred_full_tensor(tmp_path):
    from ckptconv.formats.cs_serializers import key_record, tensor_metadata

    path = tmp_path / "csx.mdl"
    inner = {"shape": [2, 3], "dtype": "torch.bfloat16", "fill_value": 0.5, "__TYPE__": "DeferredFullTensor"}
    outer = {k: v for k, v in tensor_metadata("bfloat16", (2, 3)).items() if k not in ("__NUMPY__", "compressed")}
    plain = {"shape": [4], "dtype": "float32", "fill_value": None, "__TYPE__": "DeferredFullTensor", "__NONE__": True}
    records = {"K": _nested_record("K", {**inner, "__NONE__": True}, outer), "Z": key_record("Z", plain)}
    _write_raw_record(path, records, ["K", "Z"])
    with source(path) as src:
        e = {x.key: x for x in src.entries()}
        assert (e["K"].kind, e["K"].dtype, e["K"].shape) == ("tensor", "bfloat16", (2, 3))
        k = src.read("K")
        z = src.read("Z")
    assert k.dtype == torch.bfloat16 and torch.equal(k, torch.full((2, 3), 0.5, dtype=torch.bfloat16))
    assert z.dtype == torch.float32 and z.shape == (4,)
    # Written back as ordinary tensors (data, not a description).
    out = tmp_path / "materialized.mdl"
    with source(path) as src:
        copy_checkpoint(src, sink(out))
    assert torch.equal(reload(out)["K"], k)


@pytest.mark.parametrize("kind", ["DeferredSafeTensor", "DeferredGraphTensor", "DeferredObject", "FancySerializer"])
def test_references_and_unknown_serializers_are_refused(kind, tmp_path):
    from ckptconv.formats.cs_serializers import key_record

    path = tmp_path / "ref.mdl"
    _write_raw_record(path, {"K": key_record("K", {"path": "x.safetensors", "key": "w", "__TYPE__": kind})}, ["K"])
    with pytest.raises(UnsupportedFormat, match=kind):
        source(path)


# --- large tensors: our own chunking and LZ4 framing ---------------------------------------------


def test_lz4_framing_matches_the_hdf5_filter(tmp_path):
    rng = np.random.default_rng(0)
    noise = rng.integers(-(2**15), 2**15, size=(64, 100), dtype=np.int16)
    zeros = np.zeros((64, 100), np.int16)
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        for name, arr in (("noise", noise), ("zeros", zeros)):
            ds = f.create_dataset(name, shape=arr.shape, dtype=arr.dtype, chunks=(32, 100), **hdf5plugin.LZ4())
            for i in (0, 32):
                ds.id.write_direct_chunk((i, 0), lz4_encode(arr[i : i + 32].tobytes()))
        # and the other way: chunks framed by the filter itself, with several LZ4 blocks each
        f.create_dataset("blocks", data=noise, chunks=(64, 100), **hdf5plugin.LZ4(nbytes=1000))
        f.create_dataset("zblocks", data=zeros, chunks=(64, 100), **hdf5plugin.LZ4(nbytes=1000))
    with h5py.File(path, "r") as f:  # decoded by hdf5plugin
        assert np.array_equal(f["noise"][()], noise) and np.array_equal(f["zeros"][()], zeros)
        assert f["zeros"].id.get_chunk_info(0).size < 100  # compressible data is compressed
        assert f["noise"].id.get_chunk_info(0).size == 16 + 32 * 100 * 2  # incompressible stays raw
        for name, arr in (("blocks", noise), ("zblocks", zeros)):
            _, stored = f[name].id.read_direct_chunk((0, 0))
            assert struct.unpack(">QI", stored[:12]) == (arr.nbytes, 1000)
            out = bytearray(arr.nbytes)
            lz4_decode_into(memoryview(stored), memoryview(out), name)
            assert bytes(out) == arr.tobytes()


def test_large_tensors_use_slab_chunks(tmp_path):
    out = tmp_path / "big.mdl"
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1000, 700, generator=g).to(torch.bfloat16)  # 1.4 MB
    zeros = torch.zeros(3, 500, 500)  # 3 MB, compresses well
    odd = torch.randn(3_000_001, generator=g)  # 1-D, uneven split
    tree = {"big": big, "zeros": zeros, "odd": odd}
    save(out, tree, compression="lz4", chunk_bytes=256 << 10)
    with h5py.File(out, "r") as f:
        assert f["big"].chunks == slab_chunk_shape((1000, 700), 2, 256 << 10) == (125, 700)
        assert f["zeros"].chunks == (1, 125, 500)
        assert f["odd"].chunks == slab_chunk_shape((3_000_001,), 4, 256 << 10)
        # hdf5plugin decodes our chunks (edge chunks included)
        assert np.array_equal(f["big"][()], big.view(torch.int16).numpy())
        assert np.array_equal(f["odd"][()], odd.numpy())
        assert f["zeros"].id.get_storage_size() < zeros.numel() * 4 / 50
        assert f["big"].id.get_create_plist().get_filter(0)[:3] == (32004, 1, (0,))
    assert_same_tree(describe(reload(out)), describe(tree))
    # and the h5py layout for the same content reads identically
    exact = tmp_path / "exact.mdl"
    save(exact, tree, chunking="h5py")
    with h5py.File(exact, "r") as f:
        assert f["big"].chunks == h5py.filters.guess_chunk((1000, 700), None, 2)
    assert_same_tree(describe(reload(exact)), describe(tree))


def test_reader_handles_any_chunking(tmp_path):
    # small, uneven, unfiltered and missing chunks, other filters, contiguous storage
    path = tmp_path / "chunks.mdl"
    arr = np.arange(20 * 13, dtype=np.float32).reshape(20, 13)
    tree = {n: torch.zeros(20, 13) for n in ("small", "raw", "gzip", "contig", "sparse")}
    save(path, tree)
    with h5py.File(path, "r+") as f:
        for name in tree:
            attrs = dict(f[name].attrs)
            del f[name]
            if name == "small":
                ds = f.create_dataset(name, data=arr, chunks=(7, 5), **hdf5plugin.LZ4())
            elif name == "raw":  # chunks that skipped the optional filter
                ds = f.create_dataset(name, shape=arr.shape, dtype=arr.dtype, chunks=(10, 13), **hdf5plugin.LZ4())
                ds.id.write_direct_chunk((0, 0), arr[:10].tobytes(), filter_mask=1)
                ds.id.write_direct_chunk((10, 0), lz4_encode(arr[10:].tobytes()))
            elif name == "gzip":
                ds = f.create_dataset(name, data=arr, chunks=(4, 13), compression="gzip")
            elif name == "contig":
                ds = f.create_dataset(name, data=arr)
            else:  # one chunk never written: reads as zeros (the fill value)
                ds = f.create_dataset(name, shape=arr.shape, dtype=arr.dtype, chunks=(10, 13), **hdf5plugin.LZ4())
                ds.id.write_direct_chunk((0, 0), lz4_encode(arr[:10].tobytes()))
            for k, v in attrs.items():
                ds.attrs[k] = v
    expected = torch.from_numpy(arr)
    with source(path) as src:
        for name in ("small", "raw", "gzip", "contig"):
            assert torch.equal(src.read(name), expected), name
        sparse = src.read("sparse")
    assert torch.equal(sparse[:10], expected[:10]) and not sparse[10:].any()


def test_castable_on_disk_types_load_like_cstorch(tmp_path):
    # §1.7: the stored array is value-cast to the recorded dtype; bf16 comes from int16 bits.
    path = tmp_path / "cast.mdl"
    bf = torch.tensor([1.0, -2.5, 3.0]).to(torch.bfloat16)
    tree = {"f32": torch.zeros(3), "bf": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(3, dtype=torch.bool)}
    save(path, tree)
    with h5py.File(path, "r+") as f:
        for name, data in (
            ("f32", np.array([0.1, 2.0, -3.0], np.float64)),
            ("bf", bf.view(torch.int16).numpy().view(np.uint16)),
            ("b", np.array([0, 2, 1], np.uint8)),
        ):
            attrs = dict(f[name].attrs)
            del f[name]
            ds = f.create_dataset(name, data=data)
            for k, v in attrs.items():
                ds.attrs[k] = v
    with source(path) as src:
        assert torch.equal(src.read("f32"), torch.tensor([0.1, 2.0, -3.0], dtype=torch.float64).float())
        assert torch.equal(src.read("bf"), bf)
        assert src.read("b").tolist() == [False, True, True]


def test_a_type_h5py_names_after_a_plain_numpy_type_is_converted_by_hdf5(s3_bucket, tmp_path):
    """An integer using 16 of its 32 bits from bit 8: h5py calls it int32, but its bytes are not an
    int32's; HDF5 converts it, locally and on S3 (where a contiguous dataset of plain bits is read
    with its neighbours, past HDF5)."""
    path = tmp_path / "custom.mdl"
    ints = np.array([1, 2, -3, 1000], np.int32)
    save(path, {"a": torch.ones(4), "i": torch.zeros(4, dtype=torch.int32)})
    with h5py.File(path, "r+") as f:
        tid = h5py.h5t.STD_I32LE.copy()
        tid.set_precision(16)
        tid.set_offset(8)
        attrs = dict(f["i"].attrs)
        del f["i"]
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        ds = h5py.Dataset(h5py.h5d.create(f.id, b"i", tid, h5py.h5s.create_simple(ints.shape), dcpl=dcpl))
        ds[...] = ints
        assert ds.dtype == np.int32 and ds.chunks is None  # what h5py names it; one plain range
        for k, v in attrs.items():
            ds.attrs[k] = v
    uri = f"s3://{s3_bucket}/custom/custom.mdl"
    open_storage(uri).write_bytes(uri, path.read_bytes())
    for where in (str(path), uri):
        with source(where) as src:
            assert src.read("i").tolist() == ints.tolist()
            assert src.extent("i") is None
            assert src.read_neighbours(["i"])[0].tolist() == ints.tolist()
            with src.reading_raw(True):  # no raw bytes for it either: HDF5's conversion
                assert torch.equal(src.read("i"), torch.from_numpy(ints))


# --- refusals and attacks --------------------------------------------------------------------------


class TestCsH5(FormatTests):
    """The format contract (ckptconv.testing), the hostile corpus (tests/attacks/h5_*) included."""

    format = "cs-h5"
    mismatch_error = UnsupportedValue
    attack_dir, attack_prefix, attack_expected = ATTACKS, "h5_", make_h5_attacks.EXPECTED
    attack_marker = make_h5_attacks.MARKER


class TestCsH5OnS3(OnS3, TestCsH5):
    pass


def test_incomplete_file_reads_only_when_allowed():
    path = ATTACKS / "h5_no_success.mdl"
    with pytest.raises(IncompleteCheckpoint):
        source(path)
    with source(path, allow_incomplete=True) as src:
        assert src.info["complete"] is False
        assert torch.equal(src.read("model.b"), torch.ones(3))


def test_code_in_an_object_payload_never_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / make_h5_attacks.MARKER
    payload = make_h5_attacks.exec_pickle()
    pickle.loads(payload)  # the payload is live: an ordinary unpickler runs it
    assert marker.exists()
    marker.unlink()
    with source(ATTACKS / "h5_bytes_exec.mdl") as src:
        value = src.read("step")
        assert isinstance(value, OpaqueObject) and not value.decoded and value.value is None
        assert value.payload == payload
        copy_checkpoint(src, sink(tmp_path / "copy.mdl"))
    with source(tmp_path / "copy.mdl") as src:
        assert src.read("step").payload == payload  # carried along unchanged, still never run
    assert not marker.exists()


def test_attributes_are_checked_before_they_are_read():
    """What an attribute holds is refused by its HDF5 type and size, before h5py builds it."""
    cases = {
        "h5_reference_attr.mdl": "type class reference",
        "h5_nested_compound_attr.mdl": "type class compound",
        "h5_amplified_strings.mdl": "401 variable-length strings",
        "h5_huge_attr.mdl": "attribute 'shapes' is unreadable",
    }
    for name, message in cases.items():
        with pytest.raises(CorruptCheckpoint, match=message):
            source(ATTACKS / name)


def test_attack_generator_still_works(tmp_path):
    made = make_h5_attacks.make(tmp_path / "gen")
    assert sorted(p.name for p in made) == sorted(make_h5_attacks.EXPECTED)
    for p in made:
        assert hashlib.sha256(p.read_bytes()).digest()  # readable
        assert p.stat().st_size < 50_000


def test_not_hdf5_and_missing_files(tmp_path):
    bad = tmp_path / "bad.mdl"
    bad.write_bytes(b"not an hdf5 file at all" * 10)
    with pytest.raises(CorruptCheckpoint, match="not a readable HDF5 file"):
        source(bad)
    from ckptconv.core.errors import ObjectNotFound

    with pytest.raises(ObjectNotFound):
        source(tmp_path / "absent.mdl")


def test_string_version_and_bad_spec_are_corrupt(tmp_path):
    path = tmp_path / "v.mdl"
    save(path, {"a": 1})
    with h5py.File(path, "r+") as f:
        f.attrs["__version__"] = "0.5"
    with pytest.raises(CorruptCheckpoint, match="__version__"):
        source(path)
    with h5py.File(path, "r+") as f:
        f.attrs["__version__"] = 0.6  # any v >= 0.5 takes the 0.5 path, as in cstorch
        f.attrs["__spec__"] = "[1, 2"
    with pytest.raises(CorruptCheckpoint, match="JSON"):
        source(path)


def test_external_storage_is_refused(tmp_path):
    path = tmp_path / "ext.mdl"
    save(path, {"w": torch.zeros(4)})
    (tmp_path / "outside.bin").write_bytes(b"\x00" * 16)
    with h5py.File(path, "r+") as f:
        attrs = dict(f["w"].attrs)
        del f["w"]
        ds = f.create_dataset("w", shape=(4,), dtype="f4", external=[(str(tmp_path / "outside.bin"), 0, 16)])
        for k, v in attrs.items():
            ds.attrs[k] = v
    with pytest.raises(UnsafeCheckpoint, match="other files"):
        source(path)


# --- remote storage ------------------------------------------------------------------------------


def test_s3_read_and_write(s3_bucket, tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"  # where the sink stages remote targets
    monkeypatch.setenv("CKPTCONV_SCRATCH_DIR", str(scratch))
    mdl = FIXTURES / "model_optimizer.mdl"
    uri = f"s3://{s3_bucket}/ckpt/model_optimizer.mdl"
    storage = open_storage(uri)
    storage.write_bytes(uri, mdl.read_bytes())
    with CsH5Source(storage, uri) as src:
        assert storage.local_path(uri) is None
        assert_same_tree(describe(load_tree(src)), fixture(mdl)["loaded"])
        out = f"s3://{s3_bucket}/out/copy.mdl"
        copy_checkpoint(src, CsH5Sink(storage, out))
    with CsH5Source(storage, out) as src:
        assert_same_tree(describe(load_tree(src)), fixture(mdl)["loaded"])
    with pytest.raises(TargetExists), CsH5Source(storage, uri) as src:
        copy_checkpoint(src, CsH5Sink(storage, out))
    assert [i.uri for i in storage.list(f"s3://{s3_bucket}/out/")] == [out]
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("chunking", ["fast", "h5py"])
def test_s3_reads_multi_chunk_tensors(chunking, s3_bucket, tmp_path):
    # Remote chunk data is fetched in ranged reads that span neighbouring chunks.
    local = tmp_path / "big.mdl"
    g = torch.Generator().manual_seed(3)
    tree = {"w": torch.randn(1500, 700, generator=g).to(torch.bfloat16), "v": torch.randn(3, 333, 501, generator=g)}
    save(local, tree, chunking=chunking)
    uri = f"s3://{s3_bucket}/big-{chunking}.mdl"
    storage = open_storage(uri)
    storage.write_bytes(uri, local.read_bytes())
    with CsH5Source(storage, uri) as src:
        assert_same_tree(describe(load_tree(src)), describe(tree))


def _open_and_read_all(path: str) -> None:
    with source(path, allow_incomplete=True) as src:
        for e in src.entries():
            src.read(e.key)


@pytest.mark.parametrize("name", ["h5_heap_loop.mdl", "h5_heap_loop_far.mdl"])
def test_a_heap_collection_hdf5_would_walk_forever_is_refused_before_hdf5_reads_it(name):
    """A global heap object declaring 0 bytes made HDF5 loop forever, holding the GIL, on the
    first string attribute read (found by fuzzing), also past the 4 KiB HDF5 reads of a collection
    first: a forked child, so that a regression fails instead of hanging the suite."""
    outcome = outcome_in_child(_open_and_read_all, str(ATTACKS / name))
    assert outcome is not None, "HDF5 walked the damaged heap collection"
    assert outcome == "CorruptCheckpoint"
    with pytest.raises(CorruptCheckpoint, match="global heap object declares 0 bytes"):
        source(ATTACKS / name)


def test_damaged_files_fail_with_typed_errors(tmp_path):
    """Truncations and bit flips anywhere in a real file: every failure is a typed error.

    Each attempt runs in a forked child because HDF5 itself can loop forever on some damaged
    headers (a library limit, documented in cs_h5_io); such attempts are killed and not counted.
    """
    import random

    data = (FIXTURES / "python_objects.mdl").read_bytes()
    rng = random.Random(20240607)
    outcomes = []
    for i in range(24):
        b = bytearray(data)
        if i % 2:
            b = b[: rng.randrange(len(b))]
        else:
            for _ in range(rng.randint(1, 6)):
                pos = rng.randrange(len(b))
                b[pos] ^= 1 << rng.randrange(8)
        path = tmp_path / f"damaged{i}.mdl"
        path.write_bytes(b)
        outcome = outcome_in_child(_open_and_read_all, str(path), timeout=30)
        if outcome is not None:
            outcomes.append(outcome)
    untyped = [o for o in outcomes if o.startswith("UNTYPED")]
    assert not untyped, untyped
    assert outcomes.count("CorruptCheckpoint") >= 6


_HOLD_REMOTE_WRITE = """
import sys, torch
from ckptconv.formats.cs_h5 import CsH5Sink
from ckptconv.storage import open_storage
from ckptconv.formats.base import Entry
uri = sys.argv[1]
sink = CsH5Sink(open_storage(uri), uri)
sink.begin([Entry("a", "tensor", "float32", (1024, 1024))], None)
sink.write("a", torch.ones(1024, 1024))
print(sink._tmp_dir, flush=True)
sys.stdin.read()
"""


def test_scratch_of_killed_remote_writes_is_swept(s3_bucket, tmp_path, monkeypatch):
    """A writer killed with SIGKILL leaves its H5 scratch file; the next remote write on this host
    removes it, while a live writer's scratch stays."""
    import signal
    import subprocess

    monkeypatch.setenv("CKPTCONV_SCRATCH_DIR", str(tmp_path))
    writers = []
    for name in ("killed", "alive"):
        p = subprocess.Popen(
            [sys.executable, "-c", _HOLD_REMOTE_WRITE, f"s3://{s3_bucket}/{name}.mdl"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        writers.append((p, Path(p.stdout.readline().strip())))
    (killed, killed_dir), (alive, alive_dir) = writers
    try:
        assert (killed_dir / "checkpoint.mdl").stat().st_size > 0
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert killed_dir.exists()  # nobody cleaned up: the process had no chance
        uri = f"s3://{s3_bucket}/swept.mdl"
        entries, spec, values = entries_from_tree({"a": torch.ones(2)})
        write_all(CsH5Sink(open_storage(uri), uri), entries, spec, values)
        assert not killed_dir.exists()
        assert (alive_dir / "checkpoint.mdl").exists()
    finally:
        alive.kill()
        alive.wait()


def test_a_heap_collection_claiming_gigabytes_is_walked_in_constant_memory(tmp_path):
    """The collection HDF5 reads only the front of is checked whole, object header by object header:
    one that claims 3 GiB of a (sparse) file costs no more memory than a small one, and a walk that
    would take more steps than a collection can hold objects is refused."""
    import struct
    import tracemalloc

    from ckptconv.formats.cs_h5_heap import MAX_OBJECTS, HeapCheckingReader

    def reader(path, blob, size):
        with open(path, "wb") as f:
            f.write(blob)
            f.truncate(size)  # the rest is a hole: zeros, never on disk
        return HeapCheckingReader(open(path, "rb"), str(path), size)

    claimed = 3 << 30
    # One object that runs past the 4 KiB HDF5 reads first, then zeros: a 0-byte object, found only
    # by the whole-collection check.
    head = b"GCOL\x01\x00\x00\x00" + struct.pack("<Q", claimed) + struct.pack("<HHIQ", 1, 1, 0, 8192) + b"x" * 8192
    r = reader(tmp_path / "big.h5", head, claimed + 4096)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpoint, match="declares 0 bytes"):
            r.readinto(bytearray(4096))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        r.close()
    assert peak < 1 << 20, f"the check held {peak} bytes"

    # 70,000 objects of 8 bytes each: more than HDF5's 16-bit object index can number.
    count = MAX_OBJECTS + 4464
    objects = b"".join(struct.pack("<HHIQ", 1 + i % 65535, 1, 0, 8) + b"y" * 8 for i in range(count))
    size = 16 + len(objects)
    r = reader(tmp_path / "many.h5", b"GCOL\x01\x00\x00\x00" + struct.pack("<Q", size) + objects, size)
    try:
        with pytest.raises(CorruptCheckpoint, match="more objects than HDF5 allows"):
            r.readinto(bytearray(4096))
    finally:
        r.close()


def test_blocks_not_hashed_as_written_are_read_back_while_fsync_waits(tmp_path, monkeypatch) -> None:
    """A local file's commit hashes the blocks HDF5 wrote (read back from the page cache) while
    fsync waits for the disk, not after it; the block digest is the file's."""
    import threading

    from ckptconv.formats import cs_h5_write
    from ckptconv.storage.digests import DEFAULT_BLOCK_SIZE, WrittenBlocks, file_digests

    read_back = threading.Event()
    finish = WrittenBlocks.finish

    def finishing(self, fd, size):  # type: ignore[no-untyped-def]
        read_back.set()
        return finish(self, fd, size)

    seen: list[bool] = []

    def fsync(fd: int) -> None:
        seen.append(read_back.wait(timeout=5))  # the read-back started meanwhile

    monkeypatch.setattr(WrittenBlocks, "finish", finishing)
    monkeypatch.setattr(cs_h5_write.os, "fsync", fsync)
    out = tmp_path / "out.mdl"
    entries, spec, values = entries_from_tree({"w": torch.randn(512, 1024), "b": torch.randn(7)})
    (written,) = write_all(sink(out), entries, spec, values)
    monkeypatch.undo()
    assert seen[0] is True  # the file's own fsync (the directory's follows at publication)
    with open(out, "rb") as f:
        _, blocks = file_digests(f, DEFAULT_BLOCK_SIZE)
    assert written.blocks == {"block_size": DEFAULT_BLOCK_SIZE, "blake3": blocks}


def test_a_local_contiguous_value_is_written_and_hashed_in_pieces(tmp_path, monkeypatch) -> None:
    """A value of the contiguous layout goes to the file's writer in pieces of WRITE_PIECE_BYTES,
    each handed to the block digest right after the writer took it, while it is still in the
    caches (a whole value would be read from memory twice); the digest is still the file's."""
    from ckptconv.formats.sharding import WRITE_PIECE_BYTES
    from ckptconv.storage import local
    from ckptconv.storage.digests import DEFAULT_BLOCK_SIZE, WrittenBlocks, file_digests

    wrote, write_at = WrittenBlocks.wrote, local.LocalPatch.write_at
    hashed: list[int] = []
    writes: list[int] = []

    def hashing(self, offset, data):  # type: ignore[no-untyped-def]
        hashed.append(memoryview(data).nbytes)
        return wrote(self, offset, data)

    def writing(self, offset, data):  # type: ignore[no-untyped-def]
        writes.append(memoryview(data).nbytes)
        return write_at(self, offset, data)

    monkeypatch.setattr(WrittenBlocks, "wrote", hashing)
    monkeypatch.setattr(local.LocalPatch, "write_at", writing)
    out = tmp_path / "out.mdl"
    big = torch.randn(7 * WRITE_PIECE_BYTES // 16 + 3, 2)  # 3.5 MiB and 24 bytes
    entries, spec, values = entries_from_tree({"big": big, "b": torch.randn(7)})
    (written,) = write_all(sink(out), entries, spec, values)
    monkeypatch.undo()
    with h5py.File(out, "r") as f:
        assert f["big"].chunks is None  # the default layout
    rest = big.numel() * 4 - 3 * WRITE_PIECE_BYTES
    assert sorted(writes) == sorted(hashed) == sorted([WRITE_PIECE_BYTES] * 3 + [rest, 7 * 4])
    with open(out, "rb") as f:
        _, blocks = file_digests(f, DEFAULT_BLOCK_SIZE)
    assert written.blocks == {"block_size": DEFAULT_BLOCK_SIZE, "blake3": blocks}


def test_a_local_file_is_read_with_the_kernels_own_read_ahead(tmp_path, monkeypatch) -> None:
    """No access-pattern hint on a local H5 file, as for safetensors: POSIX_FADV_SEQUENTIAL
    doubled the kernel's read-ahead window, and the data read that far ahead cost about three
    times the CPU per byte to copy out of the page cache, for no gain in time."""
    import os

    out = tmp_path / "out.mdl"
    tree = {"w": torch.randn(1024, 1024), "b": torch.randn(7)}
    save(out, tree)
    hints: list[int] = []
    fadvise = os.posix_fadvise

    def advising(fd: int, offset: int, length: int, advice: int) -> None:
        hints.append(advice)
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advising)
    with source(out) as src:
        assert torch.equal(src.read("w"), tree["w"])
    assert hints == []
