"""The real Cerebras software as the oracle for ckptconv's Cerebras H5 reader and writer.

Runs ``cerebras-pytorch`` 2.10.0 (with its own torch 2.4) from a separate venv, created by
``scripts/setup-cstorch-oracle.sh`` at ``$CKPTCONV_CSTORCH_VENV`` (default
``~/.cache/ckptconv/venv-cstorch``). It is optional: without that venv these tests are skipped.

Directions proven:

1. files written by OUR sink (every dtype cstorch stores, 0-d and zero-size tensors, ties, bf16,
   optimizer state with int keys, strings/None/NaN/big ints, tuples/OrderedDict/sets/empty
   containers, numpy arrays, dill objects, our slab chunking and h5py chunking, a safetensors file
   converted by the engine) are loaded by the real ``cstorch.load`` into exactly what we wrote;
2. files written by the real ``cstorch.save`` (tests/cstorch_oracle/save_vectors.py) are read by
   OUR source into exactly the tree ``cstorch.load`` returns, and copied by our sink into files
   that ``cstorch.load`` reads back identically.

The oracle runs in two subprocesses per test run (importing cstorch takes seconds): one saves the
real vectors, one loads and describes every file we wrote. Values are compared as JSON nodes
(tests/cstorch_oracle/describe_tree.py): tensors by dtype, shape and sha256 of their raw bytes,
floats by exact hex, dict keys with their Python type, tied values by identity.
"""

from __future__ import annotations

import collections
import fractions
import hashlib
import json
import math
import os
import pickle
import subprocess
from pathlib import Path
from typing import Any

import h5py
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
    write_all,
)

from ckptconv.engine.convert import convert
from ckptconv.formats import sink_class, source_class
from ckptconv.formats.base import OpaqueObject, dtype_name
from ckptconv.formats.detect import open_source
from ckptconv.formats.tree import unflatten
from ckptconv.storage import open_storage

ORACLE_DIR = Path(__file__).resolve().parent / "cstorch_oracle"
VENV = Path(os.environ.get("CKPTCONV_CSTORCH_VENV") or Path.home() / ".cache" / "ckptconv" / "venv-cstorch")
PYTHON = VENV / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not PYTHON.exists(),
    reason=f"optional cstorch oracle venv not found at {VENV}; create it with scripts/setup-cstorch-oracle.sh",
)


def run_oracle(script: str, *args: str) -> None:
    # A clean environment: the oracle venv must not see this venv's packages or the repo.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [str(PYTHON), str(ORACLE_DIR / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(ORACLE_DIR),
    )
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


# --- JSON nodes of our values (the oracle's node format, tests/cstorch_oracle/describe_tree.py) ----

# Objects we store as pickles, by id of the OpaqueObject in the tree -> (that object, the original
# value). Holding the object keeps its id from being reused by another one.
_ORIGINALS: dict[int, tuple[OpaqueObject, Any]] = {}


def obj(value: Any) -> OpaqueObject:
    """An object entry holding ``value`` pickled (as a dill payload would be)."""
    o = OpaqueObject(pickle.dumps(value, protocol=4))
    _ORIGINALS[id(o)] = (o, value)
    return o


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _array_node(t: torch.Tensor) -> dict[str, Any]:
    node = describe(t)
    return {**node, "kind": "ndarray", "dtype": dtype_name(t.dtype)}


def node(v: Any, *, written: bool = False) -> dict[str, Any]:
    """The node of a value as cstorch.load should return it.

    ``written``: ``v`` is an input of our writer, whose non-scalar plain values (bytes, complex,
    numpy scalars) become pickled objects; otherwise ``v`` was read by our source.
    """
    if isinstance(v, dict):
        t = "OrderedDict" if isinstance(v, collections.OrderedDict) else "dict"
        return {
            "kind": "dict",
            "type": t,
            "items": [[k, type(k).__name__, node(x, written=written)] for k, x in v.items()],
        }
    if isinstance(v, list | tuple):
        return {"kind": type(v).__name__, "items": [node(x, written=written) for x in v]}
    if isinstance(v, set | frozenset):
        return {"kind": "set", "items": sorted((node(x, written=written) for x in v), key=json.dumps)}
    if isinstance(v, NumpyArray):
        return _array_node(v.tensor)
    if isinstance(v, OpaqueObject):
        out: dict[str, Any] = {"kind": "object", "sha256": _sha(v.payload)}
        if id(v) in _ORIGINALS:
            out["value"] = describe(_ORIGINALS[id(v)][1])
        elif v.decoded:
            out["value"] = describe(v.value)
        return out
    if written and not isinstance(v, torch.Tensor | bool | int | float | str) and v is not None:
        return {"kind": "object", "value": describe(v)}
    return describe(v)


def ties_of(tree: Any) -> list[list[str]]:
    groups: dict[int, list[str]] = {}

    def walk(v: Any, path: tuple[str, ...]) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, (*path, str(k)))
        elif isinstance(v, list | tuple | set | frozenset):
            for i, x in enumerate(v):
                walk(x, (*path, str(i)))
        elif isinstance(v, torch.Tensor | NumpyArray | OpaqueObject):
            groups.setdefault(id(v), []).append(".".join(path))

    walk(tree, ())
    return [g for g in groups.values() if len(g) > 1]


def read_ours(path: Path) -> Any:
    """Our source's tree: array entries marked as NumpyArray, links the very same object."""
    src = source_class("cs-h5")(open_storage(str(path)), str(path))
    with src:
        entries = src.entries()
        by_key = {e.key: e for e in entries}
        values: dict[str, Any] = {}
        for e in entries:
            if e.kind == "link":
                continue
            v = src.read(e.key)
            values[e.key] = NumpyArray(v) if e.kind == "array" else v
        for e in entries:
            if e.kind == "link":
                target = e.target
                while by_key[target].kind == "link":
                    target = by_key[target].target
                values[e.key] = values[target]
        return unflatten([values[e.key] for e in entries], src.spec)


def _align(ours: Any, ref: Any) -> Any:
    """``ref`` with object nodes trimmed to what ``ours`` can say about them.

    - no ``value`` in ours: our reader keeps the payload as bytes by design. cstorch unpickles every
      object (running whatever code the payload names); our reader decodes plain data only, so the
      reference may then only be an arbitrary object (``other``) or a pickle it could not load;
    - no ``sha256`` in ours: a plain value our sink pickled itself; the payload bytes are its
      choice, what counts is the value cstorch unpickles.
    """
    if isinstance(ours, dict) and isinstance(ref, dict):
        if ours.get("kind") == "object" == ref.get("kind"):
            out = dict(ref)
            if "value" not in ours and "value" in ref:
                assert ref["value"]["kind"] in ("other", "error"), f"plain data left undecoded: {ref['value']}"
                del out["value"]
            if "sha256" not in ours:
                out.pop("sha256", None)
            return out
        return {k: _align(ours.get(k), v) for k, v in ref.items()}
    if isinstance(ours, list) and isinstance(ref, list) and len(ours) == len(ref):
        return [_align(a, b) for a, b in zip(ours, ref, strict=True)]
    return ref


# --- what our writer writes -------------------------------------------------------------------------


def _special(dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, 3e38, -2.5]).to(dtype)
    if dtype == torch.bool:
        return torch.tensor([True, False, True])
    info = np.iinfo(dtype_name(dtype))
    return torch.from_numpy(np.array([info.min, 0, 1, info.max], dtype=dtype_name(dtype)))


STORABLE = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.bool,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


def w_dtypes() -> dict:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 5, generator=g) * 100
    out: dict = {}
    for dt in STORABLE:
        name = dtype_name(dt)
        if dt.is_floating_point:
            t = base.to(dt)
        elif dt == torch.bool:
            t = base > 0
        else:
            t = torch.from_numpy(np.abs(base.numpy()).astype(name))
        out[name] = t
        out[f"{name}_special"] = _special(dt)
        out[f"{name}_0d"] = t.reshape(-1)[4].clone()
        out[f"{name}_empty"] = torch.zeros(0, dtype=dt)
        out[f"{name}_empty_2x0"] = torch.zeros(2, 0, dtype=dt)
    out["f32_transposed"] = base.t()  # non-contiguous input
    out["f32_4d"] = torch.randn(2, 3, 1, 4, generator=g)
    return out


def w_ties() -> dict:
    emb = torch.randn(16, 4).to(torch.bfloat16)
    shared = torch.arange(6, dtype=torch.int32)
    arr = NumpyArray(torch.ones(3))
    o = obj(fractions.Fraction(1, 3))
    return {
        "model": {"emb": {"weight": emb}, "mid": torch.zeros(2), "lm_head": {"weight": emb}},
        "lists": [shared, {"again": shared}, (shared, emb)],
        "arrays": [arr, arr],
        "objects": {"a": o, "b": o},
    }


def w_optimizer() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=4)
    for _ in range(2):
        opt.zero_grad()
        model(torch.tensor([[1, 2, 3]])).pow(2).mean().backward()
        opt.step()
        sched.step()
    return {
        "model": collections.OrderedDict((f"model.{k}", v) for k, v in model.state_dict().items()),
        "optimizer": opt.state_dict(),
        "schedulers": [sched.state_dict()],
        "global_step": 2,
        "__metadata__": [{"version": "2.10.0", "model_name": "Tiny", "params": {"model": {"hidden": 4, "act": None}}}],
    }


def w_values() -> dict:
    return {
        "strings": {
            "ascii": "hello",
            "unicode": "h\u00e9llo \u2713 \u4e16\u754c \U0001f600",
            "empty": "",
            "nul": "a\x00b",
        },
        "none": None,
        "none_again": None,
        "floats": [math.nan, math.inf, -math.inf, -0.0, 0.1, 5e-324, np.float64(0.25)],
        "ints": [0, -1, 2**63 - 1, 2**63, 2**70, -(2**65)],
        "bools": (True, False),
        "tuple": (1, "x", (2.5, None)),
        "od": collections.OrderedDict([("z", 1), ("a", 2)]),
        "empties": {"l": [], "d": {}, "t": (), "od": collections.OrderedDict(), "nested": [[], {"x": ()}]},
        "set": {7, 8, 9},
        "objects": {
            "dtype": obj(torch.bfloat16),
            "blob": obj(bytes(range(256)) * 300),  # > 64 KiB attribute
            "fraction": obj(fractions.Fraction(2, 3)),  # not plain data: stays opaque for us
            "raw_bytes": b"\x00\x01\xff",
            "complex": 1 - 2j,
            "np_dtype": np.dtype("float32"),
        },
        "arrays": {
            "f32": NumpyArray(torch.arange(12, dtype=torch.float32).reshape(3, 4)),
            "bf16": NumpyArray(torch.tensor([1.0, -2.0, 3.5]).to(torch.bfloat16)),
            "i8": NumpyArray(torch.tensor([[-128, 127]], dtype=torch.int8)),
            "u16": NumpyArray(torch.from_numpy(np.array([0, 65535], np.uint16))),
            "bool": NumpyArray(torch.tensor([True, False])),
            "zero_d": NumpyArray(torch.tensor(2.5, dtype=torch.float64)),
            "empty": NumpyArray(torch.zeros(0, 3, dtype=torch.int32)),
        },
    }


def w_keys() -> dict:
    return {
        "key.with.dots": torch.ones(1),
        "slash/key": torch.zeros(2),
        "x": {"v/w": 1, "deeper/still": {"t": torch.ones(3, dtype=torch.int32)}},
        "neg": {-1: "minus one", 0: torch.ones(2), 10: [1, {3: "three"}]},
        "space key": "spaces",
        "unicode_k\u00e9y": torch.arange(3),
    }


def w_numpy_scalars() -> dict:
    # Plain values our sink itself pickles (e.g. numpy scalars from a source's optimizer state).
    return {"np_int32": np.int32(5), "np_float32": np.float32(1.5), "np_bool": np.bool_(True)}


def w_large() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "f32_2d": torch.randn(300, 700, generator=g),
        "bf16_big": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),  # 2 MiB: our slab path by default
        "i16_odd": torch.randint(-30000, 30000, (7, 13, 5), generator=g).to(torch.int16),
        "bool_big": torch.rand(513, 257, generator=g) > 0.5,
        "u64": torch.from_numpy(np.arange(5000, dtype=np.uint64) * (2**50)),
        "f64_vec": torch.randn(40000, generator=g, dtype=torch.float64),
        "zero_d": torch.tensor(3.0),
        "empty": torch.zeros(0, 5),
    }


# Written by the real cstorch.save (tests/cstorch_oracle/save_vectors.py VECTORS).
REAL_VECTORS = [
    "v1_dtypes_layout",
    "v2_tied",
    "v3_singletons",
    "v4_containers",
    "v5_int_keys",
    "v6_values_objects",
    "all_dtypes",
    "awkward_keys",
    "model_like",
]

# name -> (tree factory, sink options)
WRITTEN = {
    "dtypes": (w_dtypes, {}),
    "dtypes_h5py_chunks": (w_dtypes, {"chunking": "h5py"}),
    "ties": (w_ties, {}),
    "optimizer": (w_optimizer, {}),
    "values": (w_values, {}),
    "keys": (w_keys, {}),
    "large_default": (w_large, {}),
    "large_lz4": (w_large, {"compression": "lz4"}),
    # every non-empty tensor through our own LZ4 slab chunker, many small chunks each
    "large_small_slabs": (w_large, {"compression": "lz4", "small_tensor_bytes": 0, "chunk_bytes": 4096}),
    "large_h5py_chunks": (w_large, {"chunking": "h5py"}),
    "numpy_scalars": (w_numpy_scalars, {}),
}


def write_ours(path: Path, tree: Any, **options: Any) -> None:
    entries, spec, values = entries_from_tree(tree)
    write_all(sink_class("cs-h5")(open_storage(str(path)), str(path), **options), entries, spec, values)


def make_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(11)
    tensors = {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).to(torch.float16),
        "model.layers.0.input_layernorm.weight": torch.ones(8),
        "model.norm.weight": torch.randn(8, generator=g, dtype=torch.float64),
        "lm_head.weight": torch.randn(32, 8, generator=g),
        "position_ids": torch.arange(16).reshape(1, 16),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.5),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


# --- the oracle runs (once per module) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run both oracle scripts once; returns every expectation and description."""
    root = tmp_path_factory.mktemp("cstorch-oracle")
    real_dir, ours_dir = root / "real", root / "ours"
    ours_dir.mkdir()

    # Real cstorch.save files first: they are also copied through our reader and writer below.
    run_oracle("save_vectors.py", str(real_dir))
    saved = json.loads((real_dir / "vectors.json").read_text())
    assert saved["writer"]["cstorch"] == "2.10.0", saved["writer"]
    real = saved["vectors"]

    expected: dict[str, dict[str, Any]] = {}
    for name, (make, options) in WRITTEN.items():
        tree = make()
        write_ours(ours_dir / f"{name}.mdl", tree, **options)
        expected[name] = {"loaded": node(tree, written=True), "ties": ties_of(tree)}
    tensors = make_safetensors(root / "model.safetensors")
    result = convert(str(root / "model.safetensors"), str(ours_dir / "converted.mdl"), to="cs-h5")
    with open_source(str(root / "model.safetensors")) as st:
        order = [e.key for e in st.entries()]
    assert sorted(order) == sorted(tensors)
    expected["converted"] = {"loaded": node({k: tensors[k] for k in order}), "ties": []}
    for name in real:
        with source_class("cs-h5")(open_storage(str(real_dir / f"{name}.mdl")), str(real_dir / f"{name}.mdl")) as src:
            dst = ours_dir / f"copy_{name}.mdl"
            copy_checkpoint(src, sink_class("cs-h5")(open_storage(str(dst)), str(dst)))
        expected[f"copy_{name}"] = {"loaded": real[name]["loaded"], "ties": real[name]["ties_after_load"]}

    paths = sorted(ours_dir.glob("*.mdl"))
    out = root / "loaded.json"
    run_oracle("load_and_describe.py", "--out", str(out), *map(str, paths))
    loaded = {Path(p).stem: v for p, v in json.loads(out.read_text()).items()}
    return {"real_dir": real_dir, "real": real, "expected": expected, "loaded": loaded, "convert": result}


# --- 1. real cstorch.load reads what we write ------------------------------------------------------


def _check_loaded(oracle: dict[str, Any], name: str) -> None:
    got = oracle["loaded"][name]
    assert got["error"] is None, f"cstorch.load failed on our {name}.mdl ({got['phase']}): {got['error']}\n" + got.get(
        "traceback", ""
    )
    exp = oracle["expected"][name]
    assert_same_tree(_align(exp["loaded"], got["loaded"]), exp["loaded"])
    assert got["ties"] == exp["ties"]


@pytest.mark.parametrize("name", [n for n in WRITTEN if n != "numpy_scalars"])
def test_cstorch_loads_what_we_write(oracle, name):
    _check_loaded(oracle, name)


def test_cstorch_unpickles_numpy_scalars_we_store(oracle):
    # Our sink names numpy 1's module paths (numpy.core) in the pickles it writes: cstorch 2.10
    # runs numpy 1.25, which cannot import numpy 2's numpy._core.
    _check_loaded(oracle, "numpy_scalars")


def test_cstorch_restores_our_ties(oracle):
    assert oracle["loaded"]["ties"]["ties"] == [
        ["model.emb.weight", "model.lm_head.weight", "lists.2.1"],
        ["lists.0", "lists.1.again", "lists.2.0"],
        ["arrays.0", "arrays.1"],
        ["objects.a", "objects.b"],
    ]
    assert oracle["loaded"]["optimizer"]["ties"] == []


def test_cstorch_loads_an_engine_conversion_from_safetensors(oracle):
    _check_loaded(oracle, "converted")
    assert oracle["convert"].format == "cs-h5"


@pytest.mark.parametrize("name", REAL_VECTORS)
def test_cstorch_loads_our_copies_of_its_files(oracle, name):
    # real file -> our reader -> our writer -> real loader: dill payloads travel unchanged.
    assert oracle["real"][name]["error"] is None
    _check_loaded(oracle, f"copy_{name}")


# --- 2. our reader reads what real cstorch.save writes --------------------------------------------


def test_real_vectors_were_saved(oracle):
    failed = {n: r["error"] for n, r in oracle["real"].items() if r["error"]}
    assert not failed
    assert sorted(oracle["real"]) == sorted(REAL_VECTORS)


@pytest.mark.parametrize("name", REAL_VECTORS)
def test_our_reader_reproduces_cstorch_load(oracle, name):
    ref = oracle["real"][name]
    tree = read_ours(oracle["real_dir"] / f"{name}.mdl")
    ours = node(tree)
    assert_same_tree(ours, _align(ours, ref["loaded"]))
    assert ties_of(tree) == ref["ties_after_load"]


@pytest.mark.parametrize("name", REAL_VECTORS)
def test_our_h5py_chunked_copy_has_the_real_layout(oracle, name, tmp_path):
    # With h5py chunking our writer reproduces the real file's HDF5 layout (types, dataspaces,
    # filters, chunk shapes, creation-order flags) and every JSON record, for vectors beyond the
    # committed fixtures.
    real = oracle["real_dir"] / f"{name}.mdl"
    copy = tmp_path / f"{name}.mdl"
    with source_class("cs-h5")(open_storage(str(real)), str(real)) as src:
        copy_checkpoint(src, sink_class("cs-h5")(open_storage(str(copy)), str(copy), chunking="h5py"))
    assert h5_layout(str(copy)) == h5_layout(str(real))
    with h5py.File(real, "r") as a, h5py.File(copy, "r") as b:
        assert sorted(a.attrs) == sorted(b.attrs)
        for attr in a.attrs:
            va, vb = a.attrs[attr], b.attrs[attr]
            if attr.endswith("__metadata__") or attr == "__spec__":
                # same JSON (json's NaN constant is one object, so NaN compares equal here)
                assert json.loads(va) == json.loads(vb), attr
            elif isinstance(va, str):
                assert va == vb, attr
            else:
                assert va == vb and va.dtype == vb.dtype, attr
