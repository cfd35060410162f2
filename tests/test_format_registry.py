"""The format registry: one answer per file name, detection read from it, and the catalogs that list it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cstorch_tree import entries_from_tree, write_all

from ckptconv.cli.main import main
from ckptconv.formats import FORMATS, sink_class
from ckptconv.formats.detect import detect_source_format, format_from_name, target_format_from_name
from ckptconv.storage import open_storage


def _write(fmt: str, uri: str) -> None:
    entries, spec, values = entries_from_tree({"w": torch.arange(4, dtype=torch.float32)})
    write_all(sink_class(fmt)(open_storage(uri), uri), entries, spec, values)


def test_every_name_belongs_to_one_format() -> None:
    owners: dict[str, str] = {}
    for f in FORMATS.values():
        for suffix in f.names:
            assert suffix not in owners, f"{suffix} is claimed by {owners.get(suffix)} and {f.name}"
            owners[suffix] = f.name
            assert format_from_name(f"dir/x{suffix}") == f.name
            assert format_from_name(f"dir/X{suffix.upper()}") == f.name  # names compare case-blind
    assert format_from_name("dir/x.safetensors.index.json") == "safetensors"  # the longest ending wins
    assert format_from_name("dir/config.json") is None


def test_ckpt_is_torch_and_hdf5_is_cs_h5(tmp_path: Path) -> None:
    assert target_format_from_name("out/model.ckpt") == "torch"
    assert target_format_from_name("out/model.hdf5") == "cs-h5"
    assert target_format_from_name("out/model.h5") == "cs-h5"
    _write("torch", str(tmp_path / "lightning.ckpt"))
    assert detect_source_format(open_storage(str(tmp_path)), str(tmp_path / "lightning.ckpt")) == "torch"
    _write("cs-h5", str(tmp_path / "weights.hdf5"))
    assert detect_source_format(open_storage(str(tmp_path)), str(tmp_path / "weights.hdf5")) == "cs-h5"
    # A TensorFlow bundle called model.ckpt is no file: its model.ckpt.index names it.
    _write("tf", str(tmp_path / "tf" / "model.ckpt"))
    assert not (tmp_path / "tf" / "model.ckpt").exists()
    assert detect_source_format(open_storage(str(tmp_path)), str(tmp_path / "tf" / "model.ckpt")) == "tf"


def test_bytes_overrule_a_name_that_lies(tmp_path: Path) -> None:
    _write("safetensors", str(tmp_path / "real.safetensors"))
    (tmp_path / "lying.ckpt").write_bytes((tmp_path / "real.safetensors").read_bytes())
    (tmp_path / "unnamed").write_bytes((tmp_path / "real.safetensors").read_bytes())
    storage = open_storage(str(tmp_path))
    assert detect_source_format(storage, str(tmp_path / "lying.ckpt")) == "safetensors"
    assert detect_source_format(storage, str(tmp_path / "unnamed")) == "safetensors"


@pytest.mark.parametrize("fmt", [f.name for f in FORMATS.values() if f.markers and f.write])
def test_a_directory_is_known_by_its_marker(tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "ckpt"
    entries, spec, values = entries_from_tree({f"w{i}": torch.full((8,), float(i)) for i in range(3)})
    options = {"shard_size": 40} if FORMATS[fmt].capabilities.shard_size else {}  # 32-byte tensors: 3 shards
    sink = sink_class(fmt)(open_storage(str(out)), str(out), **options)
    write_all(sink, entries, spec, values)
    assert any((out / m).exists() for m in FORMATS[fmt].markers)
    assert detect_source_format(open_storage(str(out)), str(out)) == fmt


def test_cli_lists_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [f.describe() for f in FORMATS.values()]
    cs_h5 = FORMATS["cs-h5"].describe()
    assert ".hdf5" in cs_h5["suffixes"] and "int8" in cs_h5["cannot_hold"] and cs_h5["links"]
