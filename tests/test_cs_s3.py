"""Cerebras object-per-key checkpoints (cs-checkpoint-format §3) on a real S3 server (moto) and locally."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import boto3
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
from s3_area import OnS3

from ckptconv.core.errors import (
    CorruptCheckpoint,
    IncompleteCheckpoint,
    PathEscape,
    TargetExists,
    UnsafeCheckpoint,
    UnsupportedValue,
)
from ckptconv.formats.base import OpaqueObject
from ckptconv.formats.cs_h5 import CsH5Sink, CsH5Source
from ckptconv.formats.cs_s3 import CsS3Sink, CsS3Source
from ckptconv.storage import open_storage
from ckptconv.testing.format_tests import FormatTests

FIXTURES = Path(__file__).parent / "fixtures" / "cstorch"
MDLS = sorted(FIXTURES.glob("*.mdl"))
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def fixture(mdl: Path) -> dict:
    return json.loads(mdl.with_suffix(".json").read_text())


def h5_source(path) -> CsH5Source:
    return CsH5Source(open_storage(str(path)), str(path))


def s3(uri: str) -> tuple:
    return open_storage(uri), uri


class TestCsS3(OnS3, FormatTests):
    """The format contract (ckptconv.testing) under an S3 prefix."""

    format = "cs-s3"
    mismatch_error = UnsupportedValue


class TestCsS3InADirectory(FormatTests):
    format = "cs-s3"
    mismatch_error = UnsupportedValue


CASES = [(m, False) for m in MDLS] + [(FIXTURES / n, True) for n in ("model_optimizer.mdl", "zero_dim.mdl")]


@pytest.mark.parametrize(("mdl", "compress"), CASES, ids=[f"{m.stem}-{'zstd' if c else 'raw'}" for m, c in CASES])
def test_h5_to_s3_to_h5_is_identical(mdl, compress, s3_bucket, tmp_path):
    expected = fixture(mdl)
    prefix = f"s3://{s3_bucket}/ckpt/{mdl.stem}"
    storage = open_storage(prefix)
    with h5_source(mdl) as src:
        outputs = copy_checkpoint(src, CsS3Sink(storage, prefix, compress=compress))
    assert outputs[-1].uri == prefix + "/__METADATA__"  # published last by the engine
    with CsS3Source(storage, prefix) as src:
        assert src.info == {"format_version": 0.5, "cstorch_version": "2.10.0", "release": "2.10", "complete": True}
        assert_same_tree(describe(load_tree(src)), expected["loaded"])
        back = tmp_path / mdl.name
        # With LZ4, as cstorch writes them: the layout compared below is the real file's.
        copy_checkpoint(src, CsH5Sink(open_storage(str(back)), str(back), compression="lz4"))
    assert_same_tree(describe(load_tree(h5_source(back))), expected["loaded"])
    assert h5_view(str(back)) == expected["h5"]
    assert h5_layout(str(back)) == h5_layout(str(mdl))


def test_objects_metadata_and_compression(s3_bucket):
    prefix = f"s3://{s3_bucket}/ck"
    storage = open_storage(prefix)
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    tree = {
        "model": {"w": w, "z": torch.zeros(1000)},
        "step": 3,
        "obj": OpaqueObject(pickle.dumps({"a": 1}, protocol=4)),
        "arr": NumpyArray(torch.ones(2, 2, dtype=torch.float64)),
    }
    entries, spec, values = entries_from_tree(tree)
    write_all(CsS3Sink(storage, prefix, compress=True), entries, spec, values)

    client = boto3.client("s3")
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="ck/")["Contents"])
    assert keys == ["ck/__METADATA__", "ck/arr", "ck/model.w", "ck/model.z", "ck/obj"]
    head = client.head_object(Bucket=s3_bucket, Key="ck/model.w")
    user = json.loads(head["Metadata"]["metadata"])
    assert user["__NUMPY__"] == {"shape": [3, 4], "dtype": "int16"}
    assert user["data_sizes"] == [24] and user["boundaries"] == [head["ContentLength"]]
    assert user["compressed"] is True and user["dtypes"] == ["torch.bfloat16"]
    body = client.get_object(Bucket=s3_bucket, Key="ck/model.z")["Body"].read()
    assert body.startswith(ZSTD_MAGIC) and len(body) < 4000 / 10

    raw = client.get_object(Bucket=s3_bucket, Key="ck/__METADATA__")["Body"].read()
    assert raw[:2] == b"\x80\x04"
    root = pickle.loads(raw)  # plain data: safe here, and what dill.loads returns too
    assert list(root)[:3] == ["__spec__", "__version__", "__cstorch_version__"] and list(root)[-1] == "__SUCCESS__"
    assert root["__SUCCESS__"] is True and root["__version__"] == 0.5
    record = json.loads(root["model.w.__metadata__"])["model.w.__metadata__"]
    assert record == user  # the same extended dict in both places
    assert pickle.dumps(root, protocol=4) == raw

    with CsS3Source(storage, prefix) as src:
        got = {e.key: src.read(e.key) for e in src.entries()}
        kinds = {e.key: e.kind for e in src.entries()}
    assert torch.equal(got["model.w"], w) and got["model.w"].dtype == torch.bfloat16
    assert torch.equal(got["model.z"], torch.zeros(1000)) and got["step"] == 3
    assert got["obj"].decoded and got["obj"].value == {"a": 1}
    assert kinds["arr"] == "array" and torch.equal(got["arr"], tree["arr"].tensor)


def test_local_directory_layout(tmp_path):
    prefix = str(tmp_path / "ckpt")
    tree = {"a": torch.randn(5, 3), "b": {"c": torch.tensor(True), "d": "x"}, "t": None}
    tree["tied"] = tree["a"]
    entries, spec, values = entries_from_tree(tree)
    write_all(CsS3Sink(open_storage(prefix), prefix), entries, spec, values)
    assert sorted(p.name for p in Path(prefix).iterdir()) == ["__METADATA__", "a", "b.c"]
    with CsS3Source(open_storage(prefix), prefix) as src:
        got = load_tree(src)
    assert got["tied"] is got["a"]
    assert_same_tree(describe(got), describe(tree))


def test_existing_prefix_refused_and_abort_cleans(s3_bucket):
    storage = open_storage(f"s3://{s3_bucket}/x")
    entries, spec, values = entries_from_tree({"a": torch.ones(3), "b": torch.zeros(2)})
    sink = CsS3Sink(storage, f"s3://{s3_bucket}/x")
    sink.begin(entries, spec)
    sink.write("a", values["a"])
    # a crash here leaves a prefix that readers refuse: no __SUCCESS__ yet
    with pytest.raises(IncompleteCheckpoint):
        CsS3Source(storage, f"s3://{s3_bucket}/x")
    with pytest.raises(TargetExists):
        CsS3Sink(storage, f"s3://{s3_bucket}/x").begin(entries, spec)
    sink.abort()
    assert list(storage.list(f"s3://{s3_bucket}/x/")) == []


def _put_metadata(storage, prefix: str, root: dict) -> None:
    storage.write_bytes(storage.join(prefix, "__METADATA__"), pickle.dumps(root, protocol=4), overwrite=True)


def _valid(storage, prefix: str) -> dict:
    entries, spec, values = entries_from_tree({"w": torch.arange(6, dtype=torch.int32), "s": 1})
    write_all(CsS3Sink(storage, prefix), entries, spec, values)
    return pickle.loads(storage.read_all(storage.join(prefix, "__METADATA__")))


def test_damaged_and_malicious_checkpoints(tmp_path):
    prefix = str(tmp_path / "ck")
    storage = open_storage(prefix)
    root = _valid(storage, prefix)

    class Evil:
        def __reduce__(self):
            return (print, ("never",))

    storage.write_bytes(storage.join(prefix, "__METADATA__"), pickle.dumps(Evil()), overwrite=True)
    with pytest.raises(UnsafeCheckpoint):
        CsS3Source(storage, prefix)

    rec = json.loads(root["w.__metadata__"])
    escaping = {**rec, "__objects__": ["../outside"], "../outside.__metadata__": rec["w.__metadata__"]}
    escaping["__spec__"] = [
        {"../outside": "*"},
        rec["__spec__"][1].replace('\\"w\\"', '\\"../outside\\"'),
    ]
    _put_metadata(storage, prefix, {**root, "w.__metadata__": json.dumps(escaping)})
    with pytest.raises((PathEscape, CorruptCheckpoint)):
        CsS3Source(storage, prefix)

    bad_size = json.loads(root["w.__metadata__"])
    bad_size["w.__metadata__"]["data_sizes"] = [999]
    _put_metadata(storage, prefix, {**root, "w.__metadata__": json.dumps(bad_size)})
    with pytest.raises(CorruptCheckpoint, match="data_sizes"):
        CsS3Source(storage, prefix)

    _put_metadata(storage, prefix, root)
    storage.write_bytes(storage.join(prefix, "w"), b"\x00" * 10, overwrite=True)  # truncated payload
    with CsS3Source(storage, prefix) as src, pytest.raises(CorruptCheckpoint, match="10 bytes"):
        src.read("w")

    flagged = json.loads(root["w.__metadata__"])
    flagged["w.__metadata__"]["compressed"] = True
    flagged["w.__metadata__"]["boundaries"] = [10]
    _put_metadata(storage, prefix, {**root, "w.__metadata__": json.dumps(flagged)})
    with CsS3Source(storage, prefix) as src, pytest.raises(CorruptCheckpoint, match="zstd"):
        src.read("w")

    _put_metadata(storage, prefix, {k: v for k, v in root.items() if k != "__SUCCESS__"})
    with pytest.raises(IncompleteCheckpoint):
        CsS3Source(storage, prefix)


def test_array_shape_from_user_metadata(s3_bucket):
    # A record that says only "__NUMPY__": true (as in H5) takes shape and dtype from the object's
    # user metadata, which cstorch always writes.
    prefix = f"s3://{s3_bucket}/um"
    storage = open_storage(prefix)
    entries, spec, values = entries_from_tree({"arr": NumpyArray(torch.arange(4, dtype=torch.int64).reshape(2, 2))})
    write_all(CsS3Sink(storage, prefix), entries, spec, values)
    root = pickle.loads(storage.read_all(prefix + "/__METADATA__"))
    rec = json.loads(root["arr.__metadata__"])
    rec["arr.__metadata__"]["__NUMPY__"] = True
    _put_metadata(storage, prefix, {**root, "arr.__metadata__": json.dumps(rec)})
    with CsS3Source(storage, prefix) as src:
        assert src.entries()[0].shape == (2, 2)
        assert torch.equal(src.read("arr"), values["arr"])
