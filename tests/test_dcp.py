"""PyTorch Distributed Checkpoint (DCP) as a source: files written by torch.distributed.checkpoint."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from dcp_writer import grid, save_dcp
from safetensors.torch import load_file
from tiny_models import tiny_llama

from ckptconv.cli import main
from ckptconv.core.errors import CorruptCheckpoint, PathEscape, UnsafeCheckpoint, UnsupportedFormat
from ckptconv.engine.convert import convert
from ckptconv.engine.diff import diff_checkpoints
from ckptconv.formats.detect import open_source
from ckptconv.testing.format_tests import FormatTests

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(10, 6, generator=g),
        "model.proj.weight": torch.randn(7, 5, 3, generator=g).to(torch.bfloat16),
        "model.proj.bias": torch.randn(7, generator=g),
        "model.count": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "optim.step": 42,
        "optim.lr": 3e-4,
        "optim.name": "adamw",
    }


# Uneven splits on several dims, as FSDP (dim 0) and tensor parallelism (dim 1) shard.
CHUNKS = {
    "model.embed.weight": grid((10, 6), (3, 2)),
    "model.proj.weight": grid((7, 5, 3), (2, 2, 1)),
    "model.proj.bias": grid((7,), (4,)),
}


class TestDcp(FormatTests):
    """The format contract (ckptconv.testing): read only, so its registry entry against its class."""

    format = "dcp"


@pytest.fixture
def dcp_dir(tmp_path: Path) -> Path:
    return save_dcp(_state(), tmp_path / "dcp", CHUNKS, thread_count=3)


def test_chunked_tensors_read_back_whole(dcp_dir: Path) -> None:
    assert sorted(p.name for p in dcp_dir.iterdir()) == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    want = _state()
    src = open_source(str(dcp_dir))
    try:
        assert src.format == "dcp" and src.info["chunks"] == 6 + 4 + 4 + 1
        assert [e.key for e in src.entries()] == list(want)
        for e in src.entries():
            got = src.read(e.key)
            if isinstance(want[e.key], torch.Tensor):
                assert e.kind == "tensor" and got.dtype == want[e.key].dtype and torch.equal(got, want[e.key])
            else:
                assert e.kind == "value" and got == want[e.key]
    finally:
        src.close()
    # The .metadata file itself names the checkpoint too.
    assert open_source(str(dcp_dir / ".metadata")).read("model.proj.bias").shape == (7,)


def test_safetensors_serialization(tmp_path: Path) -> None:
    """DCP's other record format: each .distcp ends with safetensors data (one chunk per key per file)."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    want = {"w": torch.randn(64, 8), "b": torch.ones(3, dtype=torch.bfloat16), "step": 5}
    # Two equal chunks of w land in the two files (the writer fills the emptier file first).
    d = save_dcp(
        want, tmp_path / "st", {"w": grid((64, 8), (2, 1))}, serialization_format=SerializationFormat.SAFETENSORS
    )
    src = open_source(str(d))
    try:
        assert torch.equal(src.read("w"), want["w"]) and torch.equal(src.read("b"), want["b"])
        assert src.read("step") == 5 and src.info["chunks"] == 3
    finally:
        src.close()


def test_same_tensors_as_torchs_own_reader(dcp_dir: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(dcp_dir), str(tmp_path / "torch.pt"))
    result = diff_checkpoints(str(dcp_dir), str(tmp_path / "torch.pt"))
    assert result.identical and result.compared == len(_state()), result.to_dict()


@pytest.mark.parametrize(
    "fmt,name", [("cs-h5", "out.mdl"), ("safetensors", "out"), ("torch", "out.pt"), ("tf", "tf/ckpt")]
)
def test_to_every_local_format(dcp_dir: Path, tmp_path: Path, fmt: str, name: str) -> None:
    result = convert(str(dcp_dir), str(tmp_path / name), to=fmt)
    assert result.verify["ok"] and result.tensors == 4
    assert diff_checkpoints(str(dcp_dir), result.target).identical


def test_on_s3_both_ways(dcp_dir: Path, tmp_path: Path, s3_server: str, s3_bucket: str) -> None:
    target = f"s3://{s3_bucket}/from-dcp/"
    result = convert(str(dcp_dir), target, to="cs-s3")
    assert result.verify["ok"] and diff_checkpoints(str(dcp_dir), target, format_b="cs-s3").identical
    # A DCP saved under an S3 prefix is found by its .metadata and read with ranged requests.
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_server)
    for f in dcp_dir.iterdir():
        s3.upload_file(str(f), s3_bucket, f"run/step-10/{f.name}")
    result = convert(f"s3://{s3_bucket}/run/step-10", str(tmp_path / "from_s3.mdl"), to="cs-h5")
    assert result.source["format"] == "dcp" and diff_checkpoints(str(dcp_dir), result.target).identical


def test_dcp_of_a_llama_through_the_model_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The conversion DCP users ask for most: DCP -> Hugging Face safetensors, then on to cs-2.9."""
    model = tiny_llama()
    model.save_pretrained(tmp_path / "hf")  # the reference: what transformers itself writes
    chunks = {
        "model.embed_tokens.weight": grid((256, 64), (2, 2)),
        "model.layers.0.self_attn.q_proj.weight": grid((64, 64), (4, 1)),
        "model.layers.1.mlp.down_proj.weight": grid((64, 128), (1, 3)),
    }
    save_dcp(dict(model.state_dict()), tmp_path / "dcp", chunks)

    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "hf_from_dcp"), "--to", "safetensors"]) == 0
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "hf_from_dcp" / "config.json")
    got = load_file(tmp_path / "hf_from_dcp" / "model.safetensors")
    for key, value in model.state_dict().items():
        assert torch.equal(got[key], value), key

    cs = ["--model", "llama", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9", "--no-progress", "--json"]
    capsys.readouterr()
    assert main(["convert-model", str(tmp_path / "hf_from_dcp"), str(tmp_path / "cs"), *cs]) == 0
    from_dcp = json.loads(capsys.readouterr().out)["target"]
    assert main(["convert-model", str(tmp_path / "hf"), str(tmp_path / "cs_ref"), *cs]) == 0
    reference = json.loads(capsys.readouterr().out)["target"]
    # transformers' own file omits nothing here (untied head), so both paths give the same checkpoint.
    assert diff_checkpoints(from_dcp, reference).identical
    # The model conversion also reads the DCP directly (config named explicitly).
    direct = ["--config", str(tmp_path / "hf" / "config.json")]
    assert main(["convert-model", str(tmp_path / "dcp"), str(tmp_path / "cs_direct"), *cs, *direct]) == 0
    target = json.loads(capsys.readouterr().out)["target"]
    assert target == str(tmp_path / "cs_direct" / "dcp_to_cs-2.9.mdl")  # named after the checkpoint directory
    assert diff_checkpoints(target, reference).identical


class _Exec:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("touch pwned",))


def _rewrite_metadata(dcp_dir: Path, edit) -> None:
    path = dcp_dir / ".metadata"
    with path.open("rb") as f:
        meta = pickle.load(f)  # the test's own file, written by torch above
    edit(meta)
    path.write_bytes(pickle.dumps(meta))


def test_hostile_metadata_is_refused_typed(
    dcp_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(_Exec()))
    with pytest.raises(UnsafeCheckpoint, match=r"(posix|os)\.system"):
        open_source(str(dcp_dir))
    assert main(["inspect", str(dcp_dir)]) == 2
    assert "unsafe_checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "pwned").exists()

    # A code-running object hidden inside otherwise real metadata (the planner data is free-form).
    fresh = save_dcp(_state(), tmp_path / "d2", CHUNKS)
    _rewrite_metadata(fresh, lambda m: setattr(m, "planner_data", {"x": _Exec()}))
    with pytest.raises(UnsafeCheckpoint):
        open_source(str(fresh))
    assert not (tmp_path / "pwned").exists()


def test_inconsistent_metadata_is_refused_typed(tmp_path: Path) -> None:
    def bad(name: str, edit) -> Path:
        d = save_dcp(_state(), tmp_path / name, CHUNKS)
        _rewrite_metadata(d, edit)
        return d

    def drop_chunk(m) -> None:
        m.state_dict_metadata["model.proj.bias"].chunks.pop()

    def escape(m) -> None:
        next(iter(m.storage_data.values())).relative_path = "../../etc/passwd"

    def past_end(m) -> None:
        next(iter(m.storage_data.values())).length = 10**9

    def outside(m) -> None:
        m.state_dict_metadata["model.proj.bias"].chunks[0].offsets = torch.Size([6])

    with pytest.raises(CorruptCheckpoint, match="hold 6 elements, its size \\[7\\] has 7"):
        open_source(str(bad("hole", drop_chunk)))
    with pytest.raises(PathEscape):
        open_source(str(bad("escape", escape)))
    with pytest.raises(CorruptCheckpoint, match="past the end"):
        open_source(str(bad("past", past_end)))
    with pytest.raises(CorruptCheckpoint, match="outside"):
        open_source(str(bad("outside", outside)))
    # A record whose bytes are not what the metadata says: refused when read, nothing written.
    d = save_dcp(_state(), tmp_path / "swap", CHUNKS)
    raw = bytearray((d / "__0_0.distcp").read_bytes())
    raw[:4] = b"XXXX"
    (d / "__0_0.distcp").write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint):
        convert(str(d), str(tmp_path / "x.mdl"), to="cs-h5")
    assert not (tmp_path / "x.mdl").exists()


def test_records_saved_through_stream_extensions_are_refused_with_a_hint(tmp_path: Path) -> None:
    # DCP's stream extensions (compression) transform a record's bytes: read as they are, they
    # would be garbage with the right size.
    d = save_dcp(_state(), tmp_path / "zstd", CHUNKS)

    def compressed(m) -> None:
        next(iter(m.storage_data.values())).transform_descriptors = ["stream.zstd"]

    _rewrite_metadata(d, compressed)
    with pytest.raises(UnsupportedFormat, match=r"stream extensions \(stream\.zstd\)") as refused:
        convert(str(d), str(tmp_path / "out.safetensors"), to="safetensors")
    assert "without extensions" in refused.value.hint
    assert not (tmp_path / "out.safetensors").exists()


def test_metadata_that_lies_about_chunks_or_types_is_refused_typed(tmp_path: Path) -> None:
    base = save_dcp(_state(), tmp_path / "base", CHUNKS)

    def bad(name: str, edit) -> Path:
        d = tmp_path / name
        shutil.copytree(base, d)
        _rewrite_metadata(d, edit)
        return d

    def bias(m):
        return m.state_dict_metadata["model.proj.bias"]

    def overlap(m) -> None:  # chunks [0:2] [2:4] [2:4] [6:7]: volumes add up to 7, [4:6] never saved
        bias(m).chunks[2].offsets = torch.Size([2])

    def index_key(m, **fields) -> None:
        index = next(iter(m.storage_data))
        info = m.storage_data.pop(index)
        for name, value in fields.items():
            object.__setattr__(index, name, value)  # frozen dataclass
        m.storage_data[index] = info

    def huge(m) -> None:  # one chunk claiming 2**62 elements: refused before any allocation
        bias(m).size = torch.Size([2**62])
        bias(m).chunks = bias(m).chunks[:1]
        bias(m).chunks[0].sizes = torch.Size([2**62])

    def shadow(m) -> None:  # a field named like the record's own method
        m.__dict__["get"] = "x"

    edits = {
        "overlap": (overlap, "overlap"),
        "size_text": (lambda m: setattr(bias(m), "size", ("a",)), "size of 'model.proj.bias'"),
        "sizes_float": (lambda m: setattr(bias(m).chunks[0], "sizes", (2.0,)), "chunk sizes"),
        "offsets_text": (lambda m: setattr(bias(m).chunks[0], "offsets", ("a",)), "chunk offsets"),
        "chunks_int": (lambda m: setattr(bias(m), "chunks", 5), "no list of chunks"),
        "index_offset_int": (lambda m: index_key(m, offset=5), "record offsets"),
        "index_fqn_list": (lambda m: index_key(m, fqn=("x",)), "not a string"),
        "huge": (huge, "more than the checkpoint's files hold"),
        "shadow": (shadow, "unexpected state"),
    }
    for name, (edit, message) in edits.items():
        with pytest.raises(CorruptCheckpoint, match=re.escape(message)):
            open_source(str(bad(name, edit)))
