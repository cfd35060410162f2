"""safetensors source and sink, and the sharding they share with PyTorch pickles.

Oracles: the real ``safetensors`` library (files it writes, ``safe_open`` on files we write),
``transformers`` (``from_pretrained`` of our shards, ``save_pretrained`` shards read by us), and the
Cerebras fixtures written by ``cstorch.save`` (their trees survive H5 -> safetensors -> H5).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cstorch_tree import assert_same_tree, copy_checkpoint, describe, entries_from_tree, load_tree, write_all
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from s3_area import OnS3
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckptconv.core.errors import (
    CorruptCheckpoint,
    InvalidRequest,
    PathEscape,
    UnsupportedValue,
)
from ckptconv.core.sizes import parse_size
from ckptconv.formats.base import Entry, OpaqueObject
from ckptconv.formats.safetensors_fmt import HEAD_READ, ST_DTYPES, SafetensorsSink, SafetensorsSource
from ckptconv.formats.sharding import (
    BESIDE_HASH_BYTES,
    SAFETENSORS,
    TORCH,
    WRITE_PIECE_BYTES,
    OutputSet,
    index_bytes,
    plan_shards,
    read_index,
    split_by_size,
)
from ckptconv.storage import open_storage
from ckptconv.storage.digests import hex_digest
from ckptconv.storage.s3 import S3Storage
from ckptconv.testing.format_tests import FormatTests

HERE = Path(__file__).resolve().parent
ATTACKS = HERE / "attacks"
CSTORCH = HERE / "fixtures" / "cstorch"
sys.path.insert(0, str(ATTACKS))
import make_tensor_attacks  # noqa: E402


def local() -> object:
    return open_storage("/")


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of ``dtype`` (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def flat_state(n: int = 4, size: int = 16) -> dict[str, torch.Tensor]:
    return {f"layer.{i}.weight": sample(torch.float32, (size,), seed=i) for i in range(n)}


# --- sharding -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5 * 10**9),
        ("5GiB", 5 * 2**30),
        ("500MiB", 500 * 2**20),
        ("10MB", 10**7),
        ("64KiB", 65536),
        ("3KB", 3000),
        ("1024", 1024),
        (4096, 4096),
        ("1.5GB", 1_500_000_000),
        ("2 gib", 2 * 2**30),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["5XB", "", "GB", "-1", "0", 0, -5, True, "5 G B", None])
def test_parse_size_refuses_nonsense(text: object) -> None:
    with pytest.raises(InvalidRequest):
        parse_size(text)  # type: ignore[arg-type]


def test_split_by_size_like_transformers() -> None:
    sizes = [3, 3, 3, 10, 2, 2, 5]
    shards = split_by_size(sizes, lambda n: n, 6)
    # a new shard when the next item would exceed 6; the 10 (over the limit) sits alone
    assert shards == [[3, 3], [3], [10], [2, 2], [5]]
    assert split_by_size(sizes, lambda n: n, None) == [sizes]
    assert split_by_size([], lambda n: n, 6) == [[]]
    assert split_by_size([7], lambda n: n, 6) == [[7]]


def test_plan_shards_names_and_links() -> None:
    entries = [
        Entry("a", "tensor", "float32", (4,)),  # 16 bytes
        Entry("b", "tensor", "float32", (4,)),
        Entry("tied", "link", target="a"),
        Entry("c", "tensor", "float32", (8,)),  # 32 bytes
    ]
    st_plan = plan_shards(entries, 32, "safetensors")
    # the link rides with its target and costs a copy in safetensors
    assert st_plan == [
        ("model-00001-of-00003.safetensors", ["a", "tied"], 32),
        ("model-00002-of-00003.safetensors", ["b"], 16),
        ("model-00003-of-00003.safetensors", ["c"], 32),
    ]
    pt_plan = plan_shards(entries, 32, "torch")
    assert pt_plan == [
        ("pytorch_model-00001-of-00002.bin", ["a", "tied", "b"], 32),
        ("pytorch_model-00002-of-00002.bin", ["c"], 32),
    ]
    assert plan_shards(entries, None, "safetensors") == [("model.safetensors", ["a", "tied", "b", "c"], 80)]
    one = plan_shards(entries, None, "safetensors", always_sharded=True)
    assert one == [("model-00001-of-00001.safetensors", ["a", "tied", "b", "c"], 80)]
    assert SAFETENSORS.index == "model.safetensors.index.json"
    assert TORCH.shard(2, 12) == "pytorch_model-00002-of-00012.bin"


def test_index_round_trip_and_confinement(tmp_path: Path) -> None:
    storage = local()
    uri = str(tmp_path / "model.safetensors.index.json")
    text = index_bytes({"a": "model-00001-of-00002.safetensors", "b": "sub/model-00002-of-00002.safetensors"}, 24)
    (tmp_path / "model.safetensors.index.json").write_bytes(text)
    index = read_index(storage, uri)
    assert index.metadata == {"total_size": 24}
    assert index.weight_map["a"] == str(tmp_path / "model-00001-of-00002.safetensors")
    assert index.shards == sorted(index.weight_map.values())
    for bad in ["../x.safetensors", "/etc/passwd", "a/../../x", "a//b", "..", "sub\\..\\x"]:
        (tmp_path / "model.safetensors.index.json").write_bytes(index_bytes({"a": bad}, 8))
        with pytest.raises(PathEscape):
            read_index(storage, uri)
    for bad_doc in [
        b"[]",
        b"{",
        b'{"weight_map": []}',
        b'{"weight_map": {"a": 3}}',
        b'{"weight_map": {}, "metadata": 1}',
    ]:
        (tmp_path / "model.safetensors.index.json").write_bytes(bad_doc)
        with pytest.raises(CorruptCheckpoint):
            read_index(storage, uri)


def test_sharding_helpers_do_not_import_torch() -> None:
    """The API process validates shard sizes with this module and must stay free of torch."""
    import subprocess

    code = "import sys, ckptconv.formats.sharding; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE.parent)


# --- single files ---------------------------------------------------------------------------


def _write_state(uri: str, state: dict[str, torch.Tensor], **options: object) -> list:
    entries, _, values = entries_from_tree(state)
    return write_all(SafetensorsSink(open_storage(uri), uri, **options), entries, None, values)


def test_single_file_is_what_safetensors_expects(tmp_path: Path) -> None:
    state = {
        "w": sample(torch.float32, (3, 5)),
        "b": sample(torch.bfloat16, (7,), 1),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.float16),
        "mask": sample(torch.bool, (4,), 2),
        "f8": sample(torch.float8_e5m2, (2, 2), 3),
    }
    out = tmp_path / "out"
    files = _write_state(str(out), state)
    path = out / "model.safetensors"
    assert [f.uri for f in files] == [str(path)] and files[0].size == path.stat().st_size
    assert files[0].digest == hex_digest(path.read_bytes())
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0  # the data area starts 8-byte aligned, as safetensors pads it
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # plain tensors: no ckptconv record
        assert list(f.keys()) == sorted(state)
        for k, v in state.items():
            assert same_tensor(f.get_tensor(k), v), k
    src = SafetensorsSource(open_storage(str(out)), str(out))
    assert [e.key for e in src.entries()] == list(state)  # written in order, read in data order
    assert src.spec is None
    for k, v in state.items():
        assert same_tensor(src.read(k), v)
    src.close()


def test_reads_files_written_by_safetensors(tmp_path: Path) -> None:
    state = {f"t_{name}": sample(getattr(torch, name), (2, 3), i) for i, name in enumerate(ST_DTYPES)}
    state["zero_d"] = torch.tensor(7, dtype=torch.int32)
    state["zero_size"] = torch.zeros(3, 0, dtype=torch.bfloat16)
    path = tmp_path / "lib.safetensors"
    save_file(state, str(path), metadata={"format": "pt", "note": "hi"})
    src = SafetensorsSource(local(), str(path))
    expected = load_file(str(path))
    assert {e.key for e in src.entries()} == set(expected)
    for e in src.entries():
        assert e.kind == "tensor"
        assert same_tensor(src.read(e.key), expected[e.key]), e.key
    assert src.info["metadata"] == {"format": "pt", "note": "hi"}


def test_reads_transformers_sharded_output(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    src = SafetensorsSource(local(), str(tmp_path / "hf"))
    assert len(src.files()) > 3
    state = model.state_dict()
    keys = {e.key for e in src.entries()}
    assert keys == set(state) - {"lm_head.weight"}  # transformers drops the tied duplicate
    for k in keys:
        assert same_tensor(src.read(k), state[k]), k


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(sorted(ST_DTYPES)),
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),
    seed=st.integers(0, 1000),
)
def test_every_dtype_and_shape_round_trips(tmp_path_factory: pytest.TempPathFactory, dtype, shape, seed) -> None:
    out = tmp_path_factory.mktemp("prop") / "x.safetensors"
    t = sample(getattr(torch, dtype), shape, seed)
    _write_state(str(out), {"t": t, "after": torch.arange(3)})
    with safe_open(str(out), "pt") as f:
        assert same_tensor(f.get_tensor("t"), t)
        assert same_tensor(f.get_tensor("after"), torch.arange(3))
    src = SafetensorsSource(local(), str(out))
    assert src.entries()[0] == Entry("t", "tensor", dtype, shape)
    assert same_tensor(src.read("t"), t)


def test_sharded_output(tmp_path: Path) -> None:
    state = flat_state(5, 16)  # 64 bytes each
    out = tmp_path / "out"
    files = _write_state(str(out), state, shard_size=130)
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    assert [f.role for f in files] == ["data"] * 3 + ["index"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 320}
    assert index["weight_map"]["layer.4.weight"] == "model-00003-of-00003.safetensors"
    loaded: dict[str, torch.Tensor] = {}
    for name in names[:3]:
        loaded.update(load_file(str(out / name)))
    assert loaded.keys() == state.keys() and all(same_tensor(loaded[k], v) for k, v in state.items())
    for uri in (out, out / "model.safetensors.index.json"):
        src = SafetensorsSource(local(), str(uri))
        assert [e.key for e in src.entries()] == list(state)
        assert all(same_tensor(src.read(k), v) for k, v in state.items())
        assert len(src.files()) == 4


def test_file_hashes_match_the_bytes_written_when_large_writes_are_hashed_beside_them(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    # Tensors above BESIDE_HASH_BYTES (hashed on another thread as written) between small ones.
    state = {
        "a": torch.randn(8, generator=g),
        "big.0": torch.randn(3 << 18, generator=g),
        "b": torch.randn(8, generator=g),
        "big.1": torch.randn(1 << 19, generator=g),
    }
    assert state["big.0"].nbytes > BESIDE_HASH_BYTES
    files = _write_state(str(tmp_path / "out"), state, shard_size=4 << 20)
    assert [f.role for f in files] == ["data", "data", "index"]
    for f in files:
        assert f.digest == hex_digest(Path(f.uri).read_bytes()), f.uri


class _WriteSizes:
    """A storage writer's writes, recorded on their way to it."""

    def __init__(self, writer) -> None:
        self.writer = writer
        self.sizes: list[int] = []

    def write(self, data) -> int:
        self.sizes.append(memoryview(data).nbytes)
        return self.writer.write(data)


def test_a_large_write_to_a_local_file_goes_out_in_pieces_each_hashed_as_written(tmp_path: Path) -> None:
    data = bytes(range(256)) * ((2 * WRITE_PIECE_BYTES + 12345) // 256)
    uri = str(tmp_path / "f.bin")
    outputs = OutputSet(open_storage(uri))
    w = outputs.create(uri)
    seen = w.writer = _WriteSizes(w.writer)
    w.write(b"head")
    w.write(memoryview(data))
    w.writer = seen.writer
    [done] = outputs.commit()
    assert Path(uri).read_bytes() == b"head" + data
    assert done.size == 4 + len(data) and done.digest == hex_digest(b"head" + data)
    # Not one write of the whole: pieces that the page cache takes cheaply and the hash reads from cache.
    assert seen.sizes[0] == 4 and sum(seen.sizes[1:]) == len(data)
    assert len(seen.sizes) == 4 and max(seen.sizes) == WRITE_PIECE_BYTES


def test_target_file_uri_and_shard_size_conflict(tmp_path: Path) -> None:
    uri = str(tmp_path / "one.safetensors")
    with pytest.raises(InvalidRequest):
        _write_state(uri, flat_state(), shard_size="1KB")
    _write_state(uri, flat_state())
    assert [p.name for p in tmp_path.iterdir()] == ["one.safetensors"]


def test_transformers_loads_our_shards(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from ckptconv.engine.convert import convert

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config).eval()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    target = tmp_path / "converted"
    result = convert(str(tmp_path / "pytorch_model.bin"), str(target), to="safetensors", shard_size="40KB")
    assert result.verify["ok"] and (target / "model.safetensors.index.json").exists()
    config.save_pretrained(target)
    loaded = GPT2LMHeadModel.from_pretrained(target).eval()
    x = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


# --- what plain safetensors cannot say ------------------------------------------------------


def _special_tree() -> dict:
    w = sample(torch.float32, (2, 3))
    blob = OpaqueObject(b"\x80\x04K\x01.", encoding="dill")
    return {
        "model": {"w": w, "tied": w, "b": sample(torch.bfloat16, (4,), 1)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3, "nan": float("nan")}]},
        "global_step": 10,
        "big": 2**70,
        "name": "héllo ✓",
        "nothing": None,
        "flag": True,
        "empties": {"l": [], "d": {}, "t": ()},
        "blob": blob,
        "blob_again": blob,
    }


@pytest.mark.parametrize("shard_size", [None, 40])
def test_values_spec_links_and_objects_survive(tmp_path: Path, shard_size: int | None) -> None:
    tree = _special_tree()
    entries, spec, values = entries_from_tree(tree)
    entries = [
        Entry(e.key, "array", e.dtype, e.shape) if e.key == "model.b" else e for e in entries
    ]  # one numpy-array entry
    out = tmp_path / "out"
    write_all(SafetensorsSink(local(), str(out), shard_size=shard_size), entries, spec, values)
    src = SafetensorsSource(local(), str(out))
    got = {e.key: e for e in src.entries()}
    assert [e.key for e in src.entries()] == [e.key for e in entries]
    assert src.spec is not None and src.spec.to_json() == spec.to_json()
    assert got["model.tied"].kind == "link" and got["model.tied"].target == "model.w"
    assert got["model.tied"].shape == (2, 3)
    assert got["model.b"].kind == "array"
    assert got["blob"].kind == "object" and got["blob"].meta["encoding"] == "dill"
    assert src.read("blob") == OpaqueObject(b"\x80\x04K\x01.", encoding="dill")
    assert got["blob_again"].kind == "link" and src.read("blob_again") == src.read("blob")
    assert got["big"].value == 2**70 and got["flag"].value is True and got["name"].value == "héllo ✓"
    # the whole tree comes back, links to the same object, NaN bit-exact
    assert_same_tree(describe(load_tree(src)), describe(tree))
    # plain readers see every tensor, links as copies, objects as bytes
    files = sorted(out.glob("*.safetensors"))
    plain: dict[str, torch.Tensor] = {}
    for f in files:
        plain.update(load_file(str(f)))
    assert set(plain) == {"model.w", "model.tied", "model.b", "optimizer.state.0.step", "blob", "blob_again"}
    assert same_tensor(plain["model.tied"], tree["model"]["w"])
    assert bytes(plain["blob"].numpy()) == b"\x80\x04K\x01."
    where = (out / "model.safetensors.index.json") if shard_size else None
    if where is not None:
        assert "ckptconv" in json.loads(where.read_text())["metadata"]
    else:
        with safe_open(str(files[0]), "pt") as f:
            assert set(f.metadata()) == {"format", "ckptconv"}


@pytest.mark.parametrize("name", ["model_optimizer", "python_objects", "empty_containers", "zero_dim", "dtypes"])
def test_cerebras_trees_survive_h5_safetensors_h5(tmp_path: Path, name: str) -> None:
    from ckptconv.formats.cs_h5 import CsH5Sink, CsH5Source

    expected = json.loads((CSTORCH / f"{name}.json").read_text())["loaded"]
    h5 = CsH5Source(local(), str(CSTORCH / f"{name}.mdl"))
    st_dir = str(tmp_path / "st")
    copy_checkpoint(h5, SafetensorsSink(local(), st_dir))
    st_src = SafetensorsSource(local(), st_dir)
    assert [(e.key, e.kind, e.target) for e in st_src.entries()] == [(e.key, e.kind, e.target) for e in h5.entries()]
    assert_same_tree(describe(load_tree(st_src)), expected)
    back = str(tmp_path / "back.mdl")
    copy_checkpoint(st_src, CsH5Sink(local(), back))
    assert_same_tree(describe(load_tree(CsH5Source(local(), back))), expected)


# --- refusals and aborts --------------------------------------------------------------------


def test_refusals_happen_before_any_data(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cases = [  # dtypes: FormatTests
        ([Entry("v", "value", value=b"raw bytes")], UnsupportedValue),
        ([Entry("o", "object")], UnsupportedValue),  # size unknown: the header cannot be computed
    ]
    for entries, error in cases:
        with pytest.raises(error):
            SafetensorsSink.check(entries)
        sink = SafetensorsSink(local(), str(out))
        with pytest.raises(error):
            sink.begin(entries, None)
        sink.abort()
        assert not out.exists() or not any(out.iterdir())


# --- S3 ---------------------------------------------------------------------------------------


class CountingS3(S3Storage):
    """The real S3 backend, recording every ranged read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[int, int]] = []

    def read_into(self, uri: str, offset: int, buf, **version: str) -> None:  # read_range reads through it too
        self.reads.append((offset, len(memoryview(buf).cast("B"))))
        super().read_into(uri, offset, buf, **version)

    def read_head(self, uri: str, length: int, *, offset: int = 0, **version: str):  # one GET of its own
        self.reads.append((offset, length))
        return super().read_head(uri, length, offset=offset, **version)


@pytest.mark.parametrize("shard_size", [None, 100])
def test_s3_round_trip(s3_bucket: str, shard_size: int | None) -> None:
    tree = _special_tree()
    entries, spec, values = entries_from_tree(tree)
    uri = f"s3://{s3_bucket}/ckpt"
    files = write_all(SafetensorsSink(open_storage(uri), uri, shard_size=shard_size), entries, spec, values)
    assert all(f.uri.startswith(uri + "/") and f.digest for f in files)
    src = SafetensorsSource(open_storage(uri), uri)
    assert_same_tree(describe(load_tree(src)), describe(tree))


def test_s3_reads_one_tensor_with_one_ranged_read(s3_bucket: str) -> None:
    state = {f"t{i}": sample(torch.float32, (16384,), i) for i in range(4)}  # 64 KiB each
    uri = f"s3://{s3_bucket}/big.safetensors"
    _write_state(uri, state)
    storage = CountingS3()
    size = storage.stat(uri).size
    src = SafetensorsSource(storage, uri)
    # The header in one read of at most HEAD_READ bytes: no tensor is read to open a file.
    assert len(storage.reads) == 1 and storage.reads[0][1] <= HEAD_READ
    storage.reads.clear()
    assert same_tensor(src.read("t2"), state["t2"])
    assert len(storage.reads) == 1 and storage.reads[0][1] == 65536  # exactly that tensor's bytes
    assert size > 4 * 65536


# --- attacks ----------------------------------------------------------------------------------


ST_ATTACKS = sorted(k for k in make_tensor_attacks.EXPECTED if k.startswith("st_"))


class TestSafetensors(FormatTests):
    """The format contract (ckptconv.testing), the hostile corpus (tests/attacks/st_*) included."""

    format = "safetensors"
    mismatch_error = CorruptCheckpoint
    attack_dir, attack_prefix, attack_expected = ATTACKS, "st_", make_tensor_attacks.EXPECTED


class TestSafetensorsOnS3(OnS3, TestSafetensors):
    pass


def test_attack_generator_reproduces_the_corpus(tmp_path: Path) -> None:
    make_tensor_attacks.main(tmp_path)
    for name in ST_ATTACKS:
        committed, fresh = ATTACKS / name, tmp_path / name
        if committed.is_dir():
            for f in committed.iterdir():
                assert (fresh / f.name).read_bytes() == f.read_bytes(), f
        else:
            assert fresh.read_bytes() == committed.read_bytes(), name


TRUNCATED_MID_RUN = """
import os, sys
from ckptconv.core.errors import CorruptCheckpoint
from ckptconv.engine.convert import convert

source, target = sys.argv[1], sys.argv[2]
asked = []

def cancelled():
    # The source is rewritten in place while the conversion runs (cp over it, torch.save to the
    # same path): shortened after the first values were read.
    asked.append(1)
    if len(asked) == 2:
        os.truncate(source, 4096)
    return False

try:
    convert(source, target, to="cs-h5", cancelled=cancelled)
except CorruptCheckpoint as e:
    print("corrupt_checkpoint", e)
    sys.exit(3)
"""


def test_a_source_shortened_during_a_conversion_is_corrupt_checkpoint_and_leaves_nothing(tmp_path: Path) -> None:
    # In its own process: reading a shortened file through a memory mapping kills the process
    # (SIGBUS) before any cleanup runs; a read must see the short file and fail typed instead.
    g = torch.Generator().manual_seed(3)
    source = tmp_path / "src" / "model.safetensors"
    source.parent.mkdir()
    save_file({f"w{i}": torch.randn(2048, 1024, generator=g) for i in range(12)}, str(source))  # 8 MiB each
    target = tmp_path / "out" / "model.mdl"
    target.parent.mkdir()
    run = subprocess.run(
        [sys.executable, "-c", TRUNCATED_MID_RUN, str(source), str(target)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 3, (run.returncode, run.stderr[-2000:])
    assert "corrupt_checkpoint" in run.stdout
    assert sorted(p.name for p in target.parent.iterdir()) == []  # no output, no staging left


def test_a_large_tensor_reaches_a_local_file_in_pieces_that_stay_cached(tmp_path: Path, monkeypatch) -> None:
    """A large tensor goes to a local file in 1 MiB writes, each hashed for the file's digest while
    it is written: larger pieces leave the caches between the write's copy and the hash (4 MiB
    ones tripled the system time of a 3 GB conversion). The file and its digest are unchanged."""
    from ckptconv.engine.convert import convert
    from ckptconv.storage.local import LocalWriter

    tensors = {"big": torch.randn(1024, 1280), "small": torch.arange(10)}  # 5 MiB
    save_file(tensors, tmp_path / "src.safetensors")
    sizes: list[int] = []
    write = LocalWriter.write

    def recorded(self: LocalWriter, data) -> int:  # type: ignore[no-untyped-def]
        sizes.append(memoryview(data).nbytes)
        return write(self, data)

    monkeypatch.setattr(LocalWriter, "write", recorded)
    result = convert(str(tmp_path / "src.safetensors"), str(tmp_path / "out.safetensors"), to="safetensors")
    assert max(sizes) == 1 << 20 and sum(sizes) > 5 << 20
    out = tmp_path / "out.safetensors"
    assert result.outputs[0].digest == hex_digest(out.read_bytes())
    assert all(torch.equal(load_file(out)[k], v) for k, v in tensors.items())
