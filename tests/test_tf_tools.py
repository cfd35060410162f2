"""The TensorFlow tools: ``tensorflow-to-h5`` / ``h5-to-tensorflow`` as installed console scripts,
TF1 checkpoints with Adam slots, names a Cerebras checkpoint cannot hold as they are, snappy-compressed
indexes, sharding a TensorFlow output by weight names, and int8.

The oracle is the real ``tensorflow-cpu`` (``.venv-tf``, see ``tests/test_tf_bundle.py``), in two
processes: the first trains a TF1 graph one step with Adam and saves it with ``tf.compat.v1.train.Saver``
(and writes the other inputs); the second reads back what ckptconv wrote and restores the Adam graph
from it with the TF1 ``Saver``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tf_bundle import _oracle_python, _run_oracle

from ckptconv.core.errors import InvalidRequest
from ckptconv.engine.convert import convert
from ckptconv.formats.cs_h5 import CsH5Source
from ckptconv.formats.tf_bundle import TfSource
from ckptconv.formats.tf_names import VALUE_SEGMENT, cerebras_keys, tf_name
from ckptconv.formats.tf_table import build_table, read_table
from ckptconv.storage import open_storage

BIN = Path(sys.executable).parent

# The documented escaping, name by name (tests/tf_oracle/oracle.py ODD_NAMES are saved by TensorFlow).
ESCAPED = {
    "/lead": "%/lead",
    "trail/": "trail/%",
    "a//b": "a/%/b",
    "./x": "%2E/x",
    "a/./b": "a/%2E/b",
    "a/../b": "a/%2E%2E/b",
    "%/%value": "%25/%25value",
    "a": "a/%value",
    "a/b": "a/b/%value",
    "a/b/c": "a/b/c",
    "sp ace/\u00e9": "sp ace/\u00e9",
}


# --- the naming scheme, without TensorFlow ---------------------------------------------------------


def test_escaping_table() -> None:
    assert cerebras_keys(ESCAPED) == ESCAPED
    assert {tf_name(k) for k in ESCAPED.values()} == set(ESCAPED)
    slots = ["layer_0/dense/bias", "layer_0/dense/bias/Adam", "layer_0/dense/bias/Adam_1", "beta1_power"]
    assert cerebras_keys(slots) == {
        "layer_0/dense/bias": f"layer_0/dense/bias/{VALUE_SEGMENT}",
        "layer_0/dense/bias/Adam": "layer_0/dense/bias/Adam",
        "layer_0/dense/bias/Adam_1": "layer_0/dense/bias/Adam_1",
        "beta1_power": "beta1_power",
    }


def _storable(keys: list[str]) -> bool:
    """What a Cerebras H5 checkpoint needs of its keys: clean segments, no key a group of another."""
    groups = {k.rsplit("/", i)[0] for k in keys for i in range(1, k.count("/") + 1)}
    clean = all(seg not in ("", ".", "..") for k in keys for seg in k.split("/"))
    return clean and not groups & set(keys) and len(set(keys)) == len(keys)


@settings(max_examples=300, deadline=None)
@given(st.sets(st.text(alphabet="ab/.%v", min_size=1, max_size=9), min_size=1, max_size=12))
def test_any_names_escape_to_storable_keys_and_back(names: set[str]) -> None:
    keys = cerebras_keys(names)
    assert _storable(list(keys.values()))
    assert {tf_name(k): n for n, k in keys.items()} == {n: n for n in names}


# --- TensorFlow as the oracle ----------------------------------------------------------------------


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    """Run an installed console script the way a user types it."""
    return subprocess.run([str(BIN / name), *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tf1(tmp_path_factory) -> dict:
    python = _oracle_python()
    base = tmp_path_factory.mktemp("tf1")
    made = _run_oracle(python, base, "make", {"make_tf1": str(base / "made")})["made_tf1"]
    adam = made["adam"]["prefix"]

    # TF1 Adam checkpoint -> Cerebras H5 -> TF, through the console scripts, sharded by layer.
    h5 = base / "adam.mdl"
    to_h5 = _script("tensorflow-to-h5", adam, str(h5))
    assert to_h5.returncode == 0, to_h5.stderr
    back = str(base / "back" / "model.ckpt")
    to_tf = _script("h5-to-tensorflow", str(h5), back, "--shard-by", "layer_0/*", "--shard-by", "layer_1/*")
    assert to_tf.returncode == 0, to_tf.stderr

    # Odd names through the Python API, both ways.
    odd_h5 = str(base / "odd.mdl")
    convert(made["odd"]["prefix"], odd_h5, to="cs-h5")
    odd_back = str(base / "odd_back" / "ckpt")
    convert(odd_h5, odd_back, to="tf")

    # The Adam checkpoint with a snappy-compressed index, as TensorFlow <= 1.1 wrote them.
    snappy = base / "snappy" / "model.ckpt-1"
    snappy.parent.mkdir()
    for data in Path(adam).parent.glob(Path(adam).name + ".data-*"):
        shutil.copy(data, snappy.parent / data.name)
    Path(f"{snappy}.index").write_bytes(build_table(read_table(Path(adam + ".index").read_bytes()), snappy=True))

    job = {"read": [back, odd_back, str(snappy)], "restore_tf1": [back, str(snappy)]}
    read = _run_oracle(python, base, "read", job)
    return {
        "base": base,
        "made": made,
        "read": read,
        "h5": str(h5),
        "back": back,
        "odd": (odd_h5, odd_back),
        "snappy": str(snappy),
        "scripts": (to_h5, to_tf),
    }


@pytest.mark.tf
def test_console_scripts_convert_with_progress(tf1) -> None:
    for proc in tf1["scripts"]:
        assert "verified:" in proc.stdout
        assert "tensors" in proc.stderr  # the progress bar: "<done>/<total> tensors"
    help_text = _script("tensorflow-to-h5", "--help").stdout
    assert "saver_path" in help_text and "h5_path" in help_text


@pytest.mark.tf
def test_adam_slots_are_stored_and_tensorflow_reads_them_back(tf1) -> None:
    made = tf1["made"]["adam"]
    src = CsH5Source(open_storage(tf1["h5"]), tf1["h5"])
    try:
        keys = {e.key for e in src.entries()}
    finally:
        src.close()
    assert {"layer_0/dense/bias/%value", "layer_0/dense/bias/Adam", "layer_0/dense/bias/Adam_1"} <= keys
    assert keys == set(cerebras_keys(made["tensors"]).values())

    got = tf1["read"]["read"][tf1["back"]]
    assert "error" not in got, got
    assert got["tensors"] == made["tensors"]  # same names, dtypes, shapes and bytes
    restored = tf1["read"]["restored_tf1"][tf1["back"]]
    assert restored == made["variables"]  # the TF1 Saver restores every variable and slot


@pytest.mark.tf
def test_tensorflow_output_is_sharded_by_weight_names(tf1) -> None:
    src = TfSource(open_storage(tf1["back"]), tf1["back"])
    shards = {e.key: src._stored[e.key].shard_id for e in src.entries()}
    assert src.header.num_shards == 3
    assert {k for k, s in shards.items() if s == 0} == {k for k in shards if k.startswith("layer_0/")}
    assert {k for k, s in shards.items() if s == 1} == {k for k in shards if k.startswith("layer_1/")}
    assert {k for k, s in shards.items() if s == 2} == {"beta1_power", "beta2_power", "global_step"}


@pytest.mark.tf
def test_names_a_cerebras_checkpoint_cannot_hold_round_trip(tf1) -> None:
    odd_h5, odd_back = tf1["odd"]
    src = CsH5Source(open_storage(odd_h5), odd_h5)
    try:
        assert {e.key for e in src.entries()} == set(ESCAPED.values())
    finally:
        src.close()
    got = tf1["read"]["read"][odd_back]
    assert "error" not in got, got
    assert got["tensors"] == tf1["made"]["odd"]["tensors"]


@pytest.mark.tf
def test_snappy_compressed_index_is_read(tf1, tmp_path) -> None:
    made = tf1["made"]["adam"]
    snappy = tf1["snappy"]
    assert tf1["read"]["read"][snappy]["tensors"] == made["tensors"]  # TensorFlow reads the file ...
    assert tf1["read"]["restored_tf1"][snappy] == made["variables"]
    ours, theirs = TfSource(open_storage(snappy), snappy), TfSource(open_storage(made["prefix"]), made["prefix"])
    assert [e.key for e in ours.entries()] == [e.key for e in theirs.entries()]  # ... and so does ckptconv
    for e in ours.entries():
        assert ours.read(e.key).equal(theirs.read(e.key))
    proc = _script("tensorflow-to-h5", snappy, str(tmp_path / "snappy.mdl"), "--no-progress")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.tf
def test_int8_is_refused_with_a_hint(tf1, tmp_path) -> None:
    out = tmp_path / "q.mdl"
    proc = _script("tensorflow-to-h5", tf1["made"]["int8"]["prefix"], str(out), "--no-progress")
    assert proc.returncode == 2
    assert "[unsupported_dtype]" in proc.stderr and "int8" in proc.stderr
    assert "safetensors" in proc.stderr  # the hint: where int8 can go
    assert not out.exists()


@pytest.mark.tf
def test_shard_by_refusals(tf1, tmp_path) -> None:
    with pytest.raises(InvalidRequest, match="match no weight"):
        convert(tf1["h5"], str(tmp_path / "a" / "ckpt"), to="tf", shard_by=["layer_9/*"])
    with pytest.raises(InvalidRequest, match="TensorFlow outputs"):
        convert(tf1["h5"], str(tmp_path / "b.safetensors"), to="safetensors", shard_by=["layer_0/*"])
    with pytest.raises(InvalidRequest, match="not shard_size and shard_by"):
        convert(tf1["h5"], str(tmp_path / "c" / "ckpt"), to="tf", shard_by=["layer_0/*"], shard_size="1KB")
    assert not list(tmp_path.rglob("*.index"))
