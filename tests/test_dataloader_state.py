"""Dataloader state of release 1.9 -> the 2.0 ``dataloader`` checkpoint entry (cs-checkpoint-format §5)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from urllib.parse import quote

import h5py
import numpy as np
import pytest
import torch

from ckptconv.core.errors import DataloaderStateError
from ckptconv.engine.legacy.dataloader_state import (
    add_dataloader_state,
    convert_dataloader_state,
    read_dataloader_state,
    state_from_config,
)
from ckptconv.engine.legacy.fix_spec import spec_pickle_hex
from ckptconv.engine.plan import identity_plan
from ckptconv.formats.base import Entry, dtype_name
from ckptconv.formats.cs_h5 import CsH5Sink, CsH5Source
from ckptconv.formats.tree import flatten
from ckptconv.storage import open_storage

WEIGHT = torch.arange(6, dtype=torch.float32).reshape(2, 3)


def iter_dir(tmp_path: Path, step: int = 300, workers: dict[int, str] | None = None, extra: dict | None = None) -> Path:
    d = tmp_path / "iter_state"
    d.mkdir()
    (d / "data_iter_checkpoint_state_file_global").write_text(f"{step}\n")
    for wrk, text in (workers if workers is not None else {0: "1000\n", 1: "1024\n", 2: "998"}).items():
        (d / f"data_iter_state_file_worker_{wrk}_step_{step}.txt").write_text(text)
    # An older data checkpoint and unrelated files must be ignored.
    (d / "data_iter_state_file_worker_0_step_200.txt").write_text("777\n")
    (d / "notes.md").write_text("not a state file")
    for name, text in (extra or {}).items():
        (d / name).write_text(text)
    return d


def old_checkpoint(path: Path) -> str:
    """A 2.0-style Cerebras H5 checkpoint without a dataloader state."""
    tree = {"model": {"w": WEIGHT, "b": torch.ones(3, dtype=torch.bfloat16)}, "global_step": 300}
    leaves, spec = flatten(tree)
    entries = [
        Entry(k, "tensor", dtype_name(v.dtype), tuple(v.shape))
        if isinstance(v, torch.Tensor)
        else Entry(k, "value", value=v)
        for k, v in leaves
    ]
    uri = str(path)
    sink = CsH5Sink(open_storage(uri), uri)
    sink.begin(entries, spec)
    for (k, v), e in zip(leaves, entries, strict=True):
        sink.write(k, v if e.kind == "tensor" else e.value)
    sink.commit()
    return uri


def legacy_checkpoint(path: Path) -> str:
    """A 1.9 legacy H5 (format 0.3) checkpoint."""
    tree = {"model": {"w": WEIGHT}, "global_step": 300}
    _, spec = flatten(tree)
    with h5py.File(path, "w") as f:
        f.attrs["__spec__"] = spec_pickle_hex(spec)
        f.attrs["__version__"] = 0.3
        ds = f.create_dataset(quote("model.w", safe=""), data=WEIGHT.numpy())
        ds.attrs["__H5_TYPE__"] = "TorchTensorH5Type"
        ds.attrs["is_bfloat16"] = False
        ds = f.create_dataset("global_step", data=np.array(300))
        ds.attrs["__H5_TYPE__"] = "ScalarH5Type"
    return str(path)


def test_map_and_iterable_states(tmp_path):
    d = str(iter_dir(tmp_path))
    assert read_dataloader_state(d, "map", 7) == {"samples_streamed": 3022, "seed": 7}
    assert read_dataloader_state(d, "iterable") == {
        "all_worker_states": [
            {"samples_streamed": 1000, "shard_index": 0},
            {"samples_streamed": 1024, "shard_index": 1},
            {"samples_streamed": 998, "shard_index": 2},
        ]
    }


def test_worker_order_is_by_id_not_by_name(tmp_path):
    d = str(iter_dir(tmp_path, workers={10: "5", 2: "6", 1: "7"}))
    states = read_dataloader_state(d, "iterable")["all_worker_states"]
    assert [s["shard_index"] for s in states] == [1, 2, 10]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ({"workers": {0: "12\n", 1: "many\n"}}, "not an integer"),
        ({"workers": {0: "\n"}}, "not an integer"),
        ({"workers": {0: "-4"}}, "negative"),
        ({"workers": {}}, "no worker state files for data step 300"),
        ({"extra": {"data_iter_state_file_worker_x_step_300.txt": "1"}}, "does not end in"),
    ],
)
def test_bad_state_files_are_refused(tmp_path, setup, message):
    d = str(iter_dir(tmp_path, **setup))
    with pytest.raises(DataloaderStateError, match=message):
        read_dataloader_state(d, "map")


def test_missing_global_file_and_wrong_type(tmp_path):
    d = iter_dir(tmp_path)
    with pytest.raises(DataloaderStateError, match="unknown dataloader type 'random'"):
        read_dataloader_state(str(d), "random")
    (d / "data_iter_checkpoint_state_file_global").write_text("step three hundred\n")
    with pytest.raises(DataloaderStateError, match="not an integer"):
        read_dataloader_state(str(d), "map")
    (d / "data_iter_checkpoint_state_file_global").unlink()
    with pytest.raises(DataloaderStateError, match="does not exist"):
        read_dataloader_state(str(d), "map")


def test_convert_writes_the_checkpoint_with_its_dataloader_state(tmp_path):
    old = old_checkpoint(tmp_path / "old.mdl")
    out = str(tmp_path / "new.mdl")
    result = convert_dataloader_state(old, str(iter_dir(tmp_path)), out, dataloader_type="iterable")
    assert result.verify["ok"]
    src = CsH5Source(open_storage(out), out)
    assert src.version == pytest.approx(0.5)
    values = {e.key: (e.value if e.kind == "value" else src.read(e.key)) for e in src.entries()}
    assert torch.equal(values["model.w"], WEIGHT)
    assert values["global_step"] == 300
    assert values["dataloader.all_worker_states.2.samples_streamed"] == 998
    assert values["dataloader.all_worker_states.1.shard_index"] == 1
    assert src.spec.context == ["model", "global_step", "dataloader"]
    with pytest.raises(DataloaderStateError, match="already has a dataloader state"):
        convert_dataloader_state(out, str(tmp_path / "iter_state"), str(tmp_path / "again.mdl"))


def test_a_legacy_checkpoint_becomes_format_0_5(tmp_path):
    old = legacy_checkpoint(tmp_path / "legacy.mdl")
    out = str(tmp_path / "new.mdl")
    convert_dataloader_state(old, str(iter_dir(tmp_path)), out, shuffle_seed=3)
    src = CsH5Source(open_storage(out), out)
    assert src.version == pytest.approx(0.5)
    got = {e.key: e for e in src.entries()}
    assert got["dataloader.samples_streamed"].value == 3022 and got["dataloader.seed"].value == 3
    assert torch.equal(src.read("model.w"), WEIGHT)


def test_state_from_config_and_plans(tmp_path):
    d = str(iter_dir(tmp_path))
    assert state_from_config({"cerebras": {}}) is None
    cfg = {"cerebras": {"save_iter_state_path": d}, "train_input": {"data_processor": "GptHDF5MapDataProcessor"}}
    assert state_from_config(cfg) == {"samples_streamed": 3022, "seed": 0}
    cfg["train_input"]["data_processor"] = "GptHDF5DataProcessor"
    assert len(state_from_config(cfg)["all_worker_states"]) == 3
    cfg["train_input"]["data_processor"] = "BertCSVDataProcessor"
    with pytest.raises(DataloaderStateError, match="BertCSVDataProcessor"):
        state_from_config(cfg)

    plan = identity_plan([Entry("w", "tensor", "float32", (2,))], None)
    added = add_dataloader_state(plan, {"samples_streamed": 5, "seed": 0})
    assert [s.out.key for s in added.steps] == ["w", "dataloader.samples_streamed", "dataloader.seed"]
    assert added.spec.keys() == ["w", "dataloader.samples_streamed", "dataloader.seed"]
    again = add_dataloader_state(added, {"samples_streamed": 9, "seed": 0})
    assert again.steps == added.steps and "already has a dataloader state" in again.warnings[-1]


def test_cli(tmp_path, capsys):
    from ckptconv.cli import main

    old = old_checkpoint(tmp_path / "old.mdl")
    d = str(iter_dir(tmp_path))
    argv = ["convert-dataloader-state", "--old_checkpoint", old, "--worker_data_iter_files_dir", d]
    assert main([*argv, "--output_file", str(tmp_path / "o.mdl"), "--shuffle_seed", "11"]) == 0
    assert '"seed": 11' in capsys.readouterr().out
    assert main([*argv, "--output_file", str(tmp_path / "p.mdl"), "--dataloader_type", "shuffled"]) == 2
    assert "dataloader_state_error" in capsys.readouterr().err
    assert not (tmp_path / "p.mdl").exists()


CSTORCH = Path(os.environ.get("CKPTCONV_CSTORCH_VENV", Path.home() / ".cache/ckptconv/venv-cstorch")) / "bin/python"


@pytest.mark.skipif(not CSTORCH.exists(), reason="optional cstorch oracle venv not installed (setup-cstorch-oracle.sh)")
def test_real_cstorch_loads_the_dataloader_state(tmp_path):
    old = legacy_checkpoint(tmp_path / "legacy.mdl")
    out = str(tmp_path / "new.mdl")
    convert_dataloader_state(old, str(iter_dir(tmp_path)), out, dataloader_type="iterable")
    script = "import json, sys, cerebras.pytorch as c; print(json.dumps(c.load(sys.argv[1])['dataloader']))"
    proc = subprocess.run([str(CSTORCH), "-c", script, out], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == read_dataloader_state(
        str(tmp_path / "iter_state"), "iterable"
    )


# --- the original flow: dataloader state, then the release upgrade read as cs-auto ----------------


def test_original_flow_dataloader_state_then_cs_auto_upgrade(tmp_path, capsys):
    """1.9 checkpoint + iterator files -> convert-dataloader-state -> convert-model cs-auto -> cs-2.9."""
    import yaml
    from test_fix_spec import write_legacy
    from test_layouts_upgrades import LEGACY_GPT2, _gpt2_cs_state

    from ckptconv.cli import main
    from ckptconv.formats.detect import open_source

    state = _gpt2_cs_state("")
    old = str(tmp_path / "checkpoint_10.mdl")
    write_legacy(Path(old), state, dict, version=0.3)
    d = str(iter_dir(tmp_path, step=10))
    mid = tmp_path / "checkpoint_10_2.0.mdl"
    argv = ["convert-dataloader-state", "-c", old, "-w", d, "-o", str(mid), "-d", "map"]
    assert main(argv) == 0
    assert "reads it as cs-1.9" in capsys.readouterr().out
    out = CsH5Source(open_storage(str(mid)), str(mid))
    assert out.info["cstorch_version"] == "1.9.0" and out.version == pytest.approx(0.5)
    out.close()

    cfg = tmp_path / "params.yaml"
    cfg.write_text(yaml.safe_dump(LEGACY_GPT2))
    argv = ["convert-model", str(mid), str(tmp_path / "up"), "--model", "gpt2", "--src-fmt", "cs-auto"]
    assert main([*argv, "--tgt-fmt", "cs-2.9", "--config", str(cfg), "--json", "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    conv = result["extras"]["model_conversion"]
    assert conv["source_format"] == "cs-1.9" and conv["path"][0] == "cs-1.9"
    up = open_source(result["target"])
    try:
        entries = {e.key: e for e in up.entries()}
        values = {k: e.value for k, e in entries.items() if e.kind == "value"}
        emb = up.read("model.embedding_layer.word_embeddings.weight")
        assert torch.equal(up.read("model.lm_head.weight"), emb)  # the 1.9 None tie, repaired going up
        assert "model.embedding_layer.position_embeddings.embed.weight" in entries  # the 2.0 -> 2.1 rename ran
        assert "model.embedding_layer.position_embeddings.weight" not in entries
    finally:
        up.close()
    assert torch.equal(emb, state["model"]["embedding_layer.word_embeddings.weight"])
    assert values["dataloader.samples_streamed"] == 3022 and values["dataloader.seed"] == 0
    assert values["lr_scheduler.last_epoch"] == 10  # below 2.0 the scheduler step becomes the global step
    assert values["__metadata__.0.version"] == "2.9.0"


def test_an_unfixed_1_7_checkpoint_is_refused_until_fix_spec(tmp_path, capsys):
    from test_fix_spec import MISSING, write_legacy

    from ckptconv.cli import main
    from ckptconv.engine.legacy.fix_spec import fix_checkpoint_spec

    emb = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    tree = {"model": {"embedding_layer.word_embeddings.weight": emb, "lm_head.weight": MISSING}, "global_step": 300}
    old = str(tmp_path / "c17.mdl")
    write_legacy(Path(old), tree, dict)  # as 1.7 left it: the tied lm_head listed in the spec, not stored
    d = str(iter_dir(tmp_path))
    out = tmp_path / "c17_2.0.mdl"
    with pytest.raises(DataloaderStateError, match=r"model\.lm_head\.weight.*written as None") as err:
        convert_dataloader_state(old, d, str(out))
    assert f"ckptconv fix-spec {old}" in err.value.hint
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["c17.mdl", "iter_state"]
    assert main(["convert-dataloader-state", "-c", old, "-w", d, "-o", str(out)]) == 2
    assert "dataloader_state_error" in capsys.readouterr().err

    fixed = fix_checkpoint_spec(old).output
    result = convert_dataloader_state(fixed, d, str(out))
    assert result.extras["release"] == "1.7"
    src = CsH5Source(open_storage(str(out)), str(out))
    try:
        assert torch.equal(src.read("model.lm_head.weight"), emb)
        assert src.info["cstorch_version"] == "1.7.0"
    finally:
        src.close()
