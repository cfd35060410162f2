"""H5 outputs to S3 streamed as multipart uploads of a preallocated (contiguous) layout.

Real conversions to a moto server: the streamed object must hold exactly the bytes the same
layout gets on local disk, read back with h5py and with our reader tensor by tensor, and a failed
or cancelled conversion must leave no multipart upload behind.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import boto3
import h5py
import numpy as np
import pytest
import torch
from cstorch_tree import copy_checkpoint, entries_from_tree, write_all
from safetensors.torch import save_file

import ckptconv.formats.cs_h5_write as cs_h5_write
import ckptconv.storage.part_upload as part_upload
from bench.faultproxy import FaultProxy
from ckptconv.core.errors import Cancelled
from ckptconv.engine.convert import convert
from ckptconv.formats import sink_class
from ckptconv.formats.cs_h5 import CsH5Sink, CsH5Source
from ckptconv.formats.safetensors_fmt import SafetensorsSource
from ckptconv.storage import open_storage
from ckptconv.storage.digests import file_digests, hex_digest

MiB = 1 << 20


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "embed.weight": torch.randn(2048, 1536, generator=g).to(torch.bfloat16),  # 6 MiB
        "layers.0.norm": torch.randn(1536, generator=g),
        "layers.0.attn.q": torch.randn(1536, 1536, generator=g),  # 9 MiB
        "layers.0.step": torch.tensor(7, dtype=torch.int64),
        "layers.0.mask": torch.rand(333, generator=g) > 0.5,
        "layers.0.empty": torch.zeros(0, 4),
        "layers.1.attn.q": torch.randn(1536, 1536, generator=g).to(torch.float16),
        "head.bias": torch.randn(7, generator=g).to(torch.float64),
    }


@pytest.fixture
def small_parts(monkeypatch):
    # S3's smallest part, so that a checkpoint of a few tens of MiB spans many parts.
    monkeypatch.setattr(cs_h5_write, "DEFAULT_PART_SIZE", 5 * MiB)


def _uploads(bucket: str) -> list[dict]:
    return boto3.client("s3").list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _assert_reads_back(path_or_uri: str, expected: dict[str, torch.Tensor]) -> None:
    storage = open_storage(path_or_uri)
    with CsH5Source(storage, path_or_uri) as src:
        keys = [e.key for e in src.entries()]
        assert sorted(keys) == sorted(expected)
        for k, t in expected.items():
            got = src.read(k)
            assert got.dtype == t.dtype and torch.equal(got, t), k


def test_streamed_h5_is_the_local_layout_byte_for_byte(s3_bucket, tmp_path, small_parts):
    tensors = _tensors()
    st = tmp_path / "model.safetensors"
    save_file(tensors, str(st))
    uri = f"s3://{s3_bucket}/out/model.mdl"
    result = convert(str(st), uri)
    assert result.verify["ok"] is True
    assert _uploads(s3_bucket) == []

    local = tmp_path / "local.mdl"
    convert(str(st), str(local))  # the local default: the same layout
    streamed = open_storage(uri).read_all(uri)
    assert len(streamed) > 15 * MiB  # several parts of 5 MiB
    assert streamed == local.read_bytes()

    fetched = tmp_path / "fetched.mdl"
    fetched.write_bytes(streamed)
    with h5py.File(fetched, "r") as f:
        for k, t in tensors.items():
            ds = f[k]
            assert ds.chunks is None and ds.compression is None
            want = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
            assert np.array_equal(ds[()], want), k
    _assert_reads_back(uri, tensors)
    _assert_reads_back(str(local), tensors)


def test_streamed_h5_gets_its_block_digest_without_being_read_back(s3_bucket, s3_server, tmp_path, small_parts):
    st = tmp_path / "model.safetensors"
    save_file(_tensors(), str(st))
    uri = f"s3://{s3_bucket}/digest/model.mdl"
    with FaultProxy(s3_server) as proxy:
        gets: list[str] = []
        proxy.on_request = lambda method, path, headers: gets.append(path) if method == "GET" else None
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AWS_ENDPOINT_URL", proxy.url)
            result = convert(str(st), uri)
    data = result.outputs[0]
    assert data.uri == uri and data.digest is None
    assert not [p for p in gets if "/digest/model.mdl" in p and "uploads" not in p]  # no read-back
    stored = open_storage(uri).read_all(uri)
    assert data.blocks == {"block_size": 5 * MiB, "blake3": file_digests(io.BytesIO(stored), 5 * MiB)[1]}
    manifest = json.loads(open_storage(uri).read_all(result.manifest))
    assert manifest["files"][0]["blake3_blocks"] == data.blocks and manifest["files"][0]["blake3"] is None

    # verify: full reads it back once: the whole-file digest too, and the block digest checked against the bytes stored.
    full = convert(str(st), f"s3://{s3_bucket}/digest-full/model.mdl", verify="full")
    assert full.outputs[0].digest == hex_digest(stored)
    assert full.outputs[0].blocks == data.blocks


def test_objects_and_values_land_in_the_metadata_parts(s3_bucket, tmp_path, small_parts):
    g = torch.Generator().manual_seed(9)
    tree = {
        "model": {"w": torch.randn(1024, 2048, generator=g), "b": torch.randn(5, generator=g)},
        "optimizer": {"state": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adam"}},
        "extra": {"blob": {"x": [1, 2, 3]}, "none": None},
    }
    entries, spec, values = entries_from_tree(tree)
    uri = f"s3://{s3_bucket}/tree.mdl"
    local = tmp_path / "tree.mdl"
    write_all(CsH5Sink(open_storage(uri), uri), entries, spec, values)
    write_all(CsH5Sink(open_storage(str(local)), str(local)), entries, spec, values)
    assert open_storage(uri).read_all(uri) == local.read_bytes()
    with CsH5Source(open_storage(uri), uri) as src:
        assert torch.equal(src.read("model.w"), tree["model"]["w"])


def test_cancelled_conversion_leaves_no_upload(s3_bucket, tmp_path, small_parts):
    tensors = _tensors()
    st = tmp_path / "model.safetensors"
    save_file(tensors, str(st))
    uri = f"s3://{s3_bucket}/out/model.mdl"
    calls = {"n": 0}

    def cancelled() -> bool:
        calls["n"] += 1
        return calls["n"] > 4  # after the first big tensors went out as parts

    with pytest.raises(Cancelled):
        convert(str(st), uri, cancelled=cancelled)
    assert _uploads(s3_bucket) == []
    assert list(open_storage(uri).list(f"s3://{s3_bucket}/")) == []


def test_aborted_sink_aborts_its_upload(s3_bucket, small_parts):
    tensors = _tensors()
    entries, spec, values = entries_from_tree(tensors)
    uri = f"s3://{s3_bucket}/aborted.mdl"
    sink = CsH5Sink(open_storage(uri), uri)
    sink.begin(entries, spec)
    for e in entries[:3]:
        sink.write(e.key, values[e.key])
    (upload,) = _uploads(s3_bucket)
    while sink._placement.upload._futures and not all(f.done() for f in sink._placement.upload._futures):
        sink._placement.upload._futures[-1].result()
    parts = boto3.client("s3").list_parts(Bucket=s3_bucket, Key="aborted.mdl", UploadId=upload["UploadId"])
    assert parts["Parts"]  # the first tensors went out as parts before commit
    # Only the parts with the file's head and with the end of the data wait for commit: no
    # metadata sits between datasets.
    assert sink._placement.deferred_parts == 2
    sink.abort()
    sink.abort()
    assert _uploads(s3_bucket) == []
    assert list(open_storage(uri).list(f"s3://{s3_bucket}/")) == []


def test_one_layout_local_or_s3_and_lz4_chunks_only_when_asked(s3_bucket, tmp_path: Path):
    """The default layout is contiguous for a local target too; h5_compression lz4 gives LZ4
    chunks, on S3 as well (built whole in scratch, uploaded at commit)."""
    st = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(600, 600), "z": torch.zeros(512, 1024)}, str(st))
    convert(str(st), str(tmp_path / "x.mdl"))
    with h5py.File(tmp_path / "x.mdl", "r") as f:
        for name in ("w", "z"):
            assert f[name].chunks is None and f[name].id.get_create_plist().get_nfilters() == 0, name
    uri = f"s3://{s3_bucket}/lz4.mdl"
    for out in (str(tmp_path / "lz4.mdl"), uri):
        assert convert(str(st), out, h5_compression="lz4").verify["ok"] is True
    fetched = tmp_path / "fetched.mdl"
    fetched.write_bytes(open_storage(uri).read_all(uri))
    assert _uploads(s3_bucket) == []
    for path in (tmp_path / "lz4.mdl", fetched):
        with h5py.File(path, "r") as f:
            for name in ("w", "z"):
                assert f[name].chunks is not None and f[name].id.get_create_plist().get_filter(0)[0] == 32004
            assert f["z"].id.get_storage_size() < f["z"].nbytes / 100  # zeros compress
            assert np.array_equal(f["z"][()], np.zeros((512, 1024), np.float32))


# --- sequential outputs (safetensors, torch zip): the same part uploads, several in flight ---------


@pytest.mark.parametrize(("to", "name", "extra"), [("safetensors", "st", {"shard_size": "12MB"}), ("torch", "pt", {})])
def test_sequential_outputs_stream_as_concurrent_parts(to, name, extra, s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(part_upload, "DEFAULT_PART_SIZE", 5 * MiB)
    tensors = _tensors()
    st = tmp_path / "model.safetensors"
    save_file(tensors, str(st))
    local = tmp_path / name
    convert(str(st), str(local), to=to, **extra)
    uri = f"s3://{s3_bucket}/out/{name}"
    convert(str(st), uri, to=to, **extra)
    assert _uploads(s3_bucket) == []
    storage = open_storage(uri)
    files = sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert files
    for rel in files:
        got, want = storage.read_all(f"{uri}/{rel}"), (local / rel).read_bytes()
        if to == "torch":  # torch archives carry a random serialization id: compare every other member
            got, want = _members(got), _members(want)
        assert got == want, rel
    # Publication copies objects server-side; the sink's own objects show how they were uploaded.
    direct = f"s3://{s3_bucket}/direct/{name}"
    with SafetensorsSource(open_storage(str(st)), str(st)) as src:
        written = copy_checkpoint(src, sink_class(to)(storage, direct, **extra))
    etags = [storage.stat(f.uri).etag or "" for f in written]
    assert any(e.endswith(tuple(f"-{n}" for n in range(2, 10))) for e in etags), etags  # several parts


def _members(archive: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return {n: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}


def test_cancelled_safetensors_output_leaves_no_upload(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(part_upload, "DEFAULT_PART_SIZE", 5 * MiB)
    st = tmp_path / "model.safetensors"
    save_file(_tensors(), str(st))
    calls = {"n": 0}

    def cancelled() -> bool:
        calls["n"] += 1
        return calls["n"] > 4

    with pytest.raises(Cancelled):
        convert(str(st), f"s3://{s3_bucket}/out/st", to="safetensors", cancelled=cancelled)
    assert _uploads(s3_bucket) == []
    assert list(open_storage(f"s3://{s3_bucket}/").list(f"s3://{s3_bucket}/")) == []
