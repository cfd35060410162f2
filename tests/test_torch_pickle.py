"""PyTorch pickle source and sink.

Oracles: ``torch.save`` writes the inputs, ``torch.load(weights_only=True)`` reads our outputs,
``transformers.from_pretrained`` loads our shards, and the attack corpus never executes.
"""

from __future__ import annotations

import collections
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from cstorch_tree import assert_same_tree, copy_checkpoint, describe, entries_from_tree, load_tree, write_all
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from s3_area import OnS3

from ckptconv.core.dtypes import DTYPE_SIZES
from ckptconv.core.errors import CkptconvError, CorruptCheckpoint, UnsafeCheckpoint, UnsupportedFormat, UnsupportedValue
from ckptconv.formats.base import Entry
from ckptconv.formats.torch_archive import describe_pickle
from ckptconv.formats.torch_pickle import TorchSink, TorchSource
from ckptconv.formats.tree import TreeSpec, flatten
from ckptconv.storage import open_storage
from ckptconv.storage.s3 import S3Storage
from ckptconv.testing.format_tests import FormatTests

HERE = Path(__file__).resolve().parent
ATTACKS = HERE / "attacks"
sys.path.insert(0, str(ATTACKS))
import make_tensor_attacks  # noqa: E402


def local() -> object:
    return open_storage("/")


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def cerebras_style() -> dict:
    w = sample(torch.float32, (3, 4))
    return {
        "model": {"embed.weight": w, "lm_head.weight": w, "norm": sample(torch.bfloat16, (4,), 1)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": sample(torch.float32, (3, 4), 2)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "name": None}],
        },
        "global_step": 10,
        "empties": {"l": [], "d": {}},
    }


def write_tree(uri: str, tree: object, **options: object) -> list:
    entries, spec, values = entries_from_tree(tree)
    return write_all(TorchSink(open_storage(uri), uri, **options), entries, spec, values)


# --- reading what torch.save wrote ------------------------------------------------------------


def test_reads_nested_checkpoint_without_loading_it(tmp_path: Path) -> None:
    tree = cerebras_style()
    w = tree["model"]["embed.weight"]
    tree["views"] = {"row": w[1], "transposed": w.t(), "expanded": torch.ones(1, 3).expand(4, 3)}
    torch.save(tree, tmp_path / "ckpt.pt")
    src = TorchSource(local(), str(tmp_path / "ckpt.pt"))
    entries = {e.key: e for e in src.entries()}
    _, spec = flatten(tree)
    assert src.spec is not None and src.spec.to_json() == spec.to_json()
    assert entries["model.lm_head.weight"] == Entry(
        "model.lm_head.weight", "link", "float32", (3, 4), target="model.embed.weight"
    )
    assert entries["views.row"].kind == "tensor"  # another view of the same storage: its own tensor
    assert entries["global_step"] == Entry("global_step", "value", value=10)
    assert entries["optimizer.param_groups.0.betas.1"].value == 0.999
    assert same_tensor(src.read("views.transposed"), w.t().contiguous())
    assert same_tensor(src.read("views.row"), w[1])
    assert same_tensor(src.read("views.expanded"), torch.ones(4, 3))
    assert_same_tree(describe(load_tree(src)), describe(tree))


def test_plain_state_dict_has_no_spec(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    torch.save(model.state_dict(), tmp_path / "sd.bin")
    src = TorchSource(local(), str(tmp_path / "sd.bin"))
    assert src.spec is None
    assert [e.key for e in src.entries()] == list(model.state_dict())


def test_reads_every_dtype_torch_writes(tmp_path: Path) -> None:
    state = {name: sample(getattr(torch, name), (2, 3), i) for i, name in enumerate(DTYPE_SIZES)}
    state["zero_d"] = torch.tensor(5, dtype=torch.int16)
    state["zero_size"] = torch.zeros(0, 2, dtype=torch.float8_e4m3fn)
    torch.save(state, tmp_path / "all.pt")
    src = TorchSource(local(), str(tmp_path / "all.pt"))
    for k, v in state.items():
        assert same_tensor(src.read(k), v), k


def test_reads_big_endian_archives(tmp_path: Path) -> None:
    state = {
        "f": sample(torch.float32, (3,)),
        "bf": sample(torch.bfloat16, (2,), 1),
        "c": sample(torch.complex64, (2,), 2),
        "i": sample(torch.int64, (2,), 3),
        "u": sample(torch.uint8, (3,), 4),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(out, "w") as dst:
        storage_of = {str(i): t for i, t in enumerate(state.values())}  # numbered in pickling order
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename:
                t = storage_of[info.filename.rsplit("/", 1)[1]]
                width = t.element_size() // (2 if t.is_complex() else 1)
                data = t.reshape(-1).view(torch.uint8).view(-1, width).flip(1).numpy().tobytes()
            dst.writestr(info.filename, data)
    (tmp_path / "be.pt").write_bytes(out.getvalue())
    oracle = torch.load(tmp_path / "be.pt", weights_only=True)
    src = TorchSource(local(), str(tmp_path / "be.pt"))
    for k, v in state.items():
        assert same_tensor(oracle[k], v), k
        assert same_tensor(src.read(k), v), k


def test_reads_legacy_pickles_locally_only(tmp_path: Path, s3_bucket: str) -> None:
    tree = cerebras_style()
    path = tmp_path / "legacy.pt"
    torch.save(tree, path, _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(path)
    src = TorchSource(local(), str(path))
    assert src.info["legacy_pickle"] is True
    assert {e.key: e.kind for e in src.entries()}["model.lm_head.weight"] == "link"
    assert_same_tree(describe(load_tree(src)), describe(tree))
    uri = f"s3://{s3_bucket}/legacy.pt"
    open_storage(uri).write_bytes(uri, path.read_bytes())
    with pytest.raises(UnsupportedFormat):
        TorchSource(open_storage(uri), uri)


@pytest.mark.parametrize("protocol", range(0, 6))
def test_a_plain_pickle_gets_one_outcome_locally_and_on_s3(tmp_path: Path, s3_bucket: str, protocol: int) -> None:
    import pickle

    for name, payload, error in (
        ("list", pickle.dumps([1, 2, 3], protocol=protocol), UnsupportedFormat),
        ("exec", (ATTACKS / "torch_plain_exec_p4.pt").read_bytes(), UnsafeCheckpoint),
    ):
        path = tmp_path / f"{name}.pt"
        path.write_bytes(payload)
        uri = f"s3://{s3_bucket}/plain-{protocol}/{name}.pt"
        open_storage(uri).write_bytes(uri, payload)
        for storage, where in ((local(), str(path)), (open_storage(uri), uri)):
            with pytest.raises(error):
                TorchSource(storage, where)


def test_non_plain_leaves_become_pickle_objects(tmp_path: Path) -> None:
    tree = {
        "w": torch.ones(2),
        "dtype": torch.float16,
        "raw": b"\x00\x01",
        "z": complex(1, 2),
        "dev": torch.device("cuda", 1),
    }
    torch.save(tree, tmp_path / "o.pt")
    src = TorchSource(local(), str(tmp_path / "o.pt"))
    kinds = {e.key: (e.kind, e.meta.get("encoding")) for e in src.entries()}
    assert kinds == {
        "w": ("tensor", None),
        "dtype": ("object", "pickle"),
        "raw": ("object", "pickle"),
        "z": ("object", "pickle"),
        "dev": ("object", "pickle"),
    }
    obj = src.read("dtype")
    assert obj.value is torch.float16 and obj.decoded
    # and they go back into a torch pickle (data.pkl is then written last)
    out = tmp_path / "out.pt"
    copy_checkpoint(src, TorchSink(local(), str(out)))
    back = torch.load(out, weights_only=True)
    assert back["dtype"] is torch.float16 and back["raw"] == b"\x00\x01" and back["z"] == complex(1, 2)
    assert back["dev"] == torch.device("cuda", 1)
    assert TorchSource(local(), str(out)).read("raw").payload == src.read("raw").payload


# --- writing ----------------------------------------------------------------------------------


def test_round_trip_through_torch_load(tmp_path: Path) -> None:
    tree = cerebras_style()
    out = tmp_path / "out"
    files = write_tree(str(out), tree)
    path = out / "pytorch_model.bin"
    assert [f.uri for f in files] == [str(path)]
    for mmap in (False, True):
        back = torch.load(path, weights_only=True, mmap=mmap)
        assert_same_tree(describe(back), describe(tree))
        assert back["model"]["lm_head.weight"] is back["model"]["embed.weight"]  # the tie survives
        assert isinstance(back["optimizer"]["state"], dict) and 0 in back["optimizer"]["state"]
    src = TorchSource(local(), str(out))
    assert_same_tree(describe(load_tree(src)), describe(tree))


def test_archive_layout_matches_torch_save(tmp_path: Path) -> None:
    state = collections.OrderedDict(a=sample(torch.float32, (3,)), b=sample(torch.bfloat16, (5,), 1))
    torch.save(state, tmp_path / "ref.bin")
    write_tree(str(tmp_path / "ours.bin"), state)
    with zipfile.ZipFile(tmp_path / "ref.bin") as ref, zipfile.ZipFile(tmp_path / "ours.bin") as ours:
        assert [n.replace("ours/", "", 1) for n in ours.namelist()] == [
            n.replace("ref/", "", 1) for n in ref.namelist()
        ]
        assert ours.testzip() is None
        for name in ("version", "byteorder", ".format_version", ".storage_alignment", "data/0", "data/1"):
            assert ours.read(f"ours/{name}") == ref.read(f"ref/{name}"), name
        raw = (tmp_path / "ours.bin").read_bytes()
        for info in ours.infolist():
            start = (
                info.header_offset
                + 30
                + int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
            )
            start += int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
            assert start % 64 == 0, info.filename  # records are 64-byte aligned, as torch aligns them
    # data.pkl differs only in what torch.save does not promise (memo numbering): same tree.
    assert describe(torch.load(tmp_path / "ours.bin", weights_only=True)) == describe(state)


def test_zip64_records_load(tmp_path: Path) -> None:
    tree = {"a": sample(torch.float32, (10,)), "b": torch.arange(4)}
    entries, spec, values = entries_from_tree(tree)
    sink = TorchSink(local(), str(tmp_path / "z.pt"))
    sink.zip64_from = 0  # every record carries zip64 fields, as records over 4 GiB do
    write_all(sink, entries, spec, values)
    with zipfile.ZipFile(tmp_path / "z.pt") as z:
        assert z.testzip() is None
    assert_same_tree(describe(torch.load(tmp_path / "z.pt", weights_only=True)), describe(tree))
    assert_same_tree(describe(load_tree(TorchSource(local(), str(tmp_path / "z.pt")))), describe(tree))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(sorted(DTYPE_SIZES)),
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),
    seed=st.integers(0, 1000),
)
def test_every_dtype_and_shape_round_trips(tmp_path_factory: pytest.TempPathFactory, dtype, shape, seed) -> None:
    out = tmp_path_factory.mktemp("prop") / "x.pt"
    t = sample(getattr(torch, dtype), shape, seed)
    write_tree(str(out), {"t": t, "after": torch.arange(3)})
    back = torch.load(out, weights_only=True)
    assert same_tensor(back["t"], t) and same_tensor(back["after"], torch.arange(3))
    src = TorchSource(local(), str(out))
    assert src.entries()[0] == Entry("t", "tensor", dtype, shape)
    assert same_tensor(src.read("t"), t)


def test_sharded_output_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config).eval()
    state = model.state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin")
    src = TorchSource(local(), str(tmp_path / "pytorch_model.bin"))
    assert {e.key: e.target for e in src.entries()}["lm_head.weight"] == "transformer.wte.weight"
    out = tmp_path / "hf"
    files = copy_checkpoint(src, TorchSink(local(), str(out), shard_size="30KB"))
    shards = sorted(p.name for p in out.glob("pytorch_model-*.bin"))
    assert len(shards) > 2 and shards[0] == f"pytorch_model-00001-of-{len(shards):05d}.bin"
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    assert index["weight_map"]["lm_head.weight"] == index["weight_map"]["transformer.wte.weight"]  # tie, one shard
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for k, v in state.items() if k != "lm_head.weight"
    )
    assert [f.role for f in files][-1] == "index"
    config.save_pretrained(out)
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    x = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    src = TorchSource(local(), str(out))
    assert [e.key for e in src.entries()] == list(state)
    assert all(same_tensor(src.read(k), v) for k, v in state.items())


def test_sharded_output_keeps_values_and_spec(tmp_path: Path) -> None:
    tree = cerebras_style()
    write_tree(str(tmp_path / "s"), tree, shard_size=60)
    assert len(list((tmp_path / "s").glob("*.bin"))) > 1
    src = TorchSource(local(), str(tmp_path / "s"))
    assert_same_tree(describe(load_tree(src)), describe(tree))


def test_refusals(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(UnsupportedValue):
        TorchSink.check([Entry("o", "object", meta={"nbytes": 3, "encoding": "dill"})])
    # a deque would not load with weights_only=True: refused before any data
    spec = TreeSpec("collections.deque", None, [TreeSpec()])
    sink = TorchSink(local(), str(out))
    with pytest.raises(UnsupportedValue):
        sink.begin([Entry("0", "tensor", "float32", (1,))], spec)
    sink.abort()
    # objects cannot go into shards (no record of them there)
    sink = TorchSink(local(), str(out), shard_size=10)
    with pytest.raises(UnsupportedValue):
        sink.begin(
            [
                Entry("a", "tensor", "float32", (4,)),
                Entry("b", "tensor", "float32", (4,)),
                Entry("o", "object", meta={"nbytes": 3, "encoding": "pickle"}),
            ],
            None,
        )
    sink.abort()
    assert not out.exists() or not any(out.iterdir())
    # A value unlike its announcement: FormatTests.


# --- S3 ---------------------------------------------------------------------------------------


class CountingS3(S3Storage):
    """The real S3 backend, recording every ranged read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[int, int]] = []

    def read_into(self, uri: str, offset: int, buf: bytearray | memoryview, **version: str) -> None:
        # Every read ends here: read_range fills a fresh buffer through it, tensors their own.
        self.reads.append((offset, len(buf)))
        super().read_into(uri, offset, buf, **version)


@pytest.mark.parametrize("shard_size", [None, 100])
def test_s3_round_trip(s3_bucket: str, shard_size: int | None) -> None:
    tree = cerebras_style()
    uri = f"s3://{s3_bucket}/ckpt"
    files = write_tree(uri, tree, shard_size=shard_size)
    assert all(f.uri.startswith(uri + "/") and f.digest for f in files)
    assert_same_tree(describe(load_tree(TorchSource(open_storage(uri), uri))), describe(tree))


def test_s3_lists_and_reads_without_downloading(s3_bucket: str, tmp_path: Path) -> None:
    state = {f"t{i}": sample(torch.float32, (16384,), i) for i in range(4)}  # 64 KiB each
    torch.save(state, tmp_path / "big.pt")
    uri = f"s3://{s3_bucket}/big.pt"
    open_storage(uri).write_bytes(uri, (tmp_path / "big.pt").read_bytes())
    storage = CountingS3()
    size = storage.stat(uri).size
    src = TorchSource(storage, uri)
    assert len(src.entries()) == 4
    assert sum(n for _, n in storage.reads) < 8192  # central directory and data.pkl only
    storage.reads.clear()
    assert same_tensor(src.read("t2"), state["t2"])
    assert [n for _, n in storage.reads] == [30, 65536]  # the record's local header, then its bytes
    assert size > 4 * 65536


# --- attacks ----------------------------------------------------------------------------------


TORCH_ATTACKS = sorted(k for k in make_tensor_attacks.EXPECTED if k.startswith("torch_"))


class TestTorch(FormatTests):
    """The format contract (ckptconv.testing), the hostile corpus (tests/attacks/torch_*) included."""

    format = "torch"
    mismatch_error = CorruptCheckpoint
    attack_dir, attack_prefix, attack_expected = ATTACKS, "torch_", make_tensor_attacks.EXPECTED
    attack_marker = make_tensor_attacks.MARKER


class TestTorchOnS3(OnS3, TestTorch):
    pass


def _run_unsafely(code: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-c", code], cwd=cwd, check=False, capture_output=True, timeout=60)


def test_the_exec_payloads_are_armed(tmp_path: Path) -> None:
    """A plain unpickler does run them: the refusals above are what keeps the marker away."""
    marker = tmp_path / make_tensor_attacks.MARKER
    for name in ("torch_exec.pt", "torch_exec_stack_global.pt"):
        code = (
            f"import pickle, zipfile; pickle.loads(zipfile.ZipFile({str(ATTACKS / name)!r}).read('archive/data.pkl'))"
        )
        _run_unsafely(code, tmp_path)
        assert marker.exists(), name
        marker.unlink()
    code = (
        f"import pickle\nf = open({str(ATTACKS / 'torch_exec_legacy.pt')!r}, 'rb')\nfor _ in range(4): pickle.load(f)"
    )
    _run_unsafely(code, tmp_path)
    assert marker.exists()


def test_describing_unpickler_refuses_what_weights_only_refuses() -> None:
    import pickle

    for obj in (collections.deque([1]), os.getcwd, Path):
        payload = pickle.dumps(obj, protocol=2)
        with pytest.raises(UnsafeCheckpoint):
            describe_pickle(payload, "test")
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(_as_torch_zip(payload)), weights_only=True)
    # torch knows quantized tensors; ckptconv refuses them as unsupported rather than unsafe
    with pytest.raises(UnsupportedValue):
        describe_pickle(b"\x80\x02ctorch._utils\n_rebuild_qtensor\nq\x00.", "test")


def _as_torch_zip(pkl: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


def test_failure_mid_conversion_leaves_the_sink_empty(tmp_path: Path) -> None:
    src = TorchSource(local(), str(ATTACKS / "torch_bad_local_header.pt"))
    assert len(src.entries()) == 2  # the damage only shows when the second tensor is read
    out = tmp_path / "out"
    with pytest.raises(CorruptCheckpoint):
        copy_checkpoint(src, TorchSink(local(), str(out), shard_size=8))
    assert not any(out.iterdir())


def test_attack_generator_still_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    make_tensor_attacks.main(tmp_path / "gen")
    for name in TORCH_ATTACKS:
        error = make_tensor_attacks.EXPECTED[name][0]
        with pytest.raises(CkptconvError) as info:
            src = TorchSource(local(), str(tmp_path / "gen" / name))
            for e in src.entries():
                src.read(e.key)
        assert type(info.value).__name__ == error, name
    assert not (tmp_path / make_tensor_attacks.MARKER).exists()


def test_a_member_crc_is_computed_piece_by_piece_beside_the_digest(tmp_path: Path, monkeypatch) -> None:
    """A large tensor's CRC-32 is computed on each piece as it is written (while the other thread
    hashes that piece for the file's digest), not in a pass over the whole tensor first; the
    archive's CRCs still hold and torch loads the tensors."""
    from isal import isal_zlib

    from ckptconv.engine.convert import convert
    from ckptconv.formats import sharding
    from ckptconv.storage.digests import hex_digest

    monkeypatch.setattr(sharding, "WRITE_PIECE_BYTES", 1 << 20)
    tensors = {"big": torch.randn(1024, 1280), "small": torch.arange(10)}  # 5 MiB: five pieces
    torch.save(tensors, tmp_path / "src.bin")
    sizes: list[int] = []
    crc32 = isal_zlib.crc32

    def recorded(data, value=0):  # type: ignore[no-untyped-def]
        sizes.append(memoryview(data).nbytes)
        return crc32(data, value)

    monkeypatch.setattr(isal_zlib, "crc32", recorded)
    result = convert(str(tmp_path / "src.bin"), str(tmp_path / "out.bin"), to="torch")
    monkeypatch.setattr(isal_zlib, "crc32", crc32)
    assert max(sizes) == 1 << 20 and sum(s for s in sizes if s == 1 << 20) == 5 << 20
    with zipfile.ZipFile(tmp_path / "out.bin") as z:
        assert z.testzip() is None  # every member's CRC-32, as zlib computes it
    loaded = torch.load(tmp_path / "out.bin", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert result.outputs[0].digest == hex_digest((tmp_path / "out.bin").read_bytes())


def test_a_checkpoint_written_from_tensors_bytes_never_imports_torch(tmp_path: Path) -> None:
    # A conversion that only moves bytes hands the sink RawTensors (formats.base.RawTensor); data.pkl
    # still names torch's rebuild functions, storage classes and dtypes, and torch.load reads it.
    sizes = {"float32": 4, "bfloat16": 2, "int64": 8, "bool": 1, "uint16": 2, "float8_e4m3fn": 1}
    payloads = {
        dt: bytes((b * (i + 3)) % (2 if dt == "bool" else 251) for b in range(6 * n))
        for i, (dt, n) in enumerate(sizes.items())
    }
    code = f"""
import sys
import numpy as np
from ckptconv.formats.base import Entry, RawTensor
from ckptconv.formats.torch_pickle import TorchSink
from ckptconv.storage import open_storage

entries = [Entry("w." + dt, "tensor", dt, (2, 3)) for dt in {list(payloads)!r}]
entries.append(Entry("tied", "link", target="w.float32"))
for name, options in [("one.bin", {{}}), ("sharded", {{"shard_size": 100, "always_sharded": True}})]:
    uri = sys.argv[1] + "/" + name
    sink = TorchSink(open_storage(uri), uri, **options)
    sink.begin(entries, None)
    for dt, data in {payloads!r}.items():
        sink.write("w." + dt, RawTensor(np.frombuffer(data, dtype=np.uint8).copy(), dt, (2, 3)))
    sink.commit()
assert "torch" not in sys.modules, "writing a torch checkpoint from bytes imported torch"
"""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert out.returncode == 0, out.stderr
    one = torch.load(tmp_path / "one.bin", weights_only=True)
    shards = sorted((tmp_path / "sharded").glob("*.bin"))
    assert len(shards) > 1
    for state in (one, {k: v for f in shards for k, v in torch.load(f, weights_only=True).items()}):
        assert sorted(state) == sorted([*(f"w.{dt}" for dt in sizes), "tied"])
        for dt, data in payloads.items():
            t = state[f"w.{dt}"]
            assert t.dtype == getattr(torch, dt) and t.shape == (2, 3) and bits(t) == data, dt
    assert one["tied"] is one["w.float32"]
