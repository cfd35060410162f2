"""Legacy Cerebras H5 checkpoints (format 0.1-0.4): read through the restricted unpickler.

No real legacy files exist to test against, so these tests build them with h5py exactly as
cs-checkpoint-format §2 describes. The tree spec is pickled with the standard pickle module from
stand-in classes whose module and name are ``torch.utils._pytree.TreeSpec``/``LeafSpec`` (and
Cerebras' ``TensorScalarDict``), registered in ``sys.modules`` only while pickling, so the bytes
name exactly the globals a dill pickle of the real objects names. A variant also spells builtin
types the way dill does (``dill._dill._load_type("dict")``).
"""

from __future__ import annotations

import collections
import pickle
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import h5py
import hdf5plugin
import numpy as np
import pytest
import torch
from cstorch_tree import assert_same_tree, copy_checkpoint, describe, load_tree

from ckptconv.core.errors import CorruptCheckpoint, UnsafeCheckpoint, UnsupportedFormat
from ckptconv.formats.base import OpaqueObject
from ckptconv.formats.cs_h5 import CsH5Sink, CsH5Source
from ckptconv.storage import open_storage

# --- stand-ins for the classes a legacy spec pickle names ----------------------------------------


class _TreeSpec:
    def __init__(self, type: Any, context: Any, children_specs: list) -> None:
        self.type = type
        self.context = context
        self.children_specs = children_specs
        self.num_leaves = sum(c.num_leaves for c in children_specs)


class _LeafSpec(_TreeSpec):
    def __init__(self) -> None:
        super().__init__(None, None, [])
        self.num_leaves = 1


class _TensorScalarDict(dict):
    pass


def _load_type(name: str) -> type:  # what dill's helper does when unpickling
    return {"dict": dict, "list": list, "tuple": tuple}[name]


_PYTREE = types.ModuleType("torch.utils._pytree")
_TSD = types.ModuleType("cerebras_pytorch.utils.tensor_scalar_dict")
_DILL = types.ModuleType("dill._dill")
for cls, mod, name in (
    (_TreeSpec, _PYTREE, "TreeSpec"),
    (_LeafSpec, _PYTREE, "LeafSpec"),
    (_TensorScalarDict, _TSD, "TensorScalarDict"),
    (_load_type, _DILL, "_load_type"),
):
    cls.__module__ = mod.__name__
    cls.__qualname__ = cls.__name__ = name
    setattr(mod, name, cls)


@contextmanager
def _standins(monkeypatch):
    """The stand-in modules (and empty parents where none exist) in sys.modules, for pickling only."""
    import sys

    with monkeypatch.context() as m:
        for mod in (_PYTREE, _TSD, _DILL):
            parts = mod.__name__.split(".")
            for n in range(1, len(parts)):
                parent = ".".join(parts[:n])
                if parent not in sys.modules:
                    m.setitem(sys.modules, parent, types.ModuleType(parent))
            m.setitem(sys.modules, mod.__name__, mod)
        yield


class _DillLikePickler(pickle.Pickler):
    """Spells builtin container types as dill does: dill._dill._load_type('dict')."""

    def reducer_override(self, obj: Any) -> Any:
        if obj in (dict, list, tuple):
            return (_load_type, (obj.__name__,))
        return NotImplemented


def legacy_spec(tree: Any) -> _TreeSpec:
    if isinstance(tree, dict):
        t = type(tree) if type(tree) in (collections.OrderedDict, _TensorScalarDict) else dict
        return _TreeSpec(t, list(tree), [legacy_spec(v) for v in tree.values()])
    if isinstance(tree, list | tuple):
        return _TreeSpec(type(tree), None, [legacy_spec(v) for v in tree])
    return _LeafSpec()


def spec_hex(monkeypatch, tree: Any, *, dill_types: bool = False, counts: str = "right") -> str:
    spec = legacy_spec(tree)
    stack = [spec]
    while stack and counts != "right":
        node = stack.pop()
        if counts == "none":  # old pickles carry no num_leaves
            del node.num_leaves
        else:  # never trusted: recomputed from the children
            node.num_leaves = 999
        stack.extend(node.children_specs)
    import io

    buf = io.BytesIO()
    with _standins(monkeypatch):
        (_DillLikePickler if dill_types else pickle.Pickler)(buf, protocol=4).dump(spec)
    return buf.getvalue().hex()


# --- building legacy files ----------------------------------------------------------------------


def _null(f: h5py.File, entry_key: str, h5type: str | None, dtype: str = "f", /, **attrs: Any) -> h5py.Dataset:
    ds = f.create_dataset(quote(entry_key, safe=""), data=h5py.Empty(dtype))
    if h5type is not None:
        ds.attrs["__H5_TYPE__"] = h5type
    for k, v in attrs.items():
        ds.attrs[k] = v
    return ds


def _numeric(f: h5py.File, entry_key: str, arr: np.ndarray, h5type: str | None, /, **attrs: Any) -> h5py.Dataset:
    extra = hdf5plugin.LZ4() if arr.ndim else {}
    ds = f.create_dataset(quote(entry_key, safe=""), data=arr, **extra)
    if h5type is not None:
        ds.attrs["__H5_TYPE__"] = h5type
    for k, v in attrs.items():
        ds.attrs[k] = v
    return ds


def open_src(path: Path, **kw) -> CsH5Source:
    return CsH5Source(open_storage(str(path)), str(path), **kw)


BF = torch.tensor([[1.0, -2.0], [0.5, 3.0]]).to(torch.bfloat16)
F32 = torch.arange(6, dtype=torch.float32).reshape(2, 3)


def make_v04(path: Path, monkeypatch, **spec_kw) -> dict:
    """Test vector 8 (0.4): every __H5_TYPE__, quoted names, a hard-linked duplicate, a missing key."""
    expected = {
        "model": {"w": BF, "b": F32, "a/b key": torch.ones(2, dtype=torch.int64), "tied": BF},
        "arr": torch.tensor([1.5, 2.5], dtype=torch.float64),
        "step": 7,
        "lr": 0.25,
        "flag": True,
        "name": "h\u00e9llo",
        "nothing": None,
        "obj": OpaqueObject(pickle.dumps({"k": [1, 2]}, protocol=4), "dill", {"k": [1, 2]}, True),
        "deferred": F32,
        "full": torch.full((2, 2), 3.0),
        "missing": None,
    }
    with h5py.File(path, "w") as f:
        f.attrs["__spec__"] = spec_hex(monkeypatch, expected, **spec_kw)
        f.attrs["__version__"] = 0.4
        f.attrs["__cstorch_version__"] = "2.3.0"
        w = _numeric(f, "model.w", BF.view(torch.int16).numpy(), "TorchTensorH5Type", is_bfloat16=True)
        _numeric(f, "model.b", F32.numpy(), "TorchTensorH5Type", is_bfloat16=False)
        _numeric(f, "model.a/b key", np.ones(2, np.int64), "TorchTensorH5Type", is_bfloat16=False)
        f[quote("model.tied", safe="")] = w  # HDF5 hard link: a tied weight
        _numeric(f, "arr", np.array([1.5, 2.5]), "NumpyArrayH5Type", is_bfloat16=False)
        _numeric(f, "step", np.array(7), "ScalarH5Type")
        _numeric(f, "lr", np.array(0.25), "ScalarH5Type")
        _numeric(f, "flag", np.array(True), "ScalarH5Type")
        _null(f, "name", "StringH5Type", string_value="h\u00e9llo")
        _null(f, "nothing", "NoneH5Type")
        _null(f, "obj", "ObjectH5Type", object_value=expected["obj"].payload.hex())
        _null(f, "deferred", "DeferredH5Tensor", key="model.b", link_to_self=True)
        _null(f, "full", "FullTensorH5Type", "f4", shape=np.array([2, 2]), fill_value=3.0, is_bfloat16=False)
    return expected


def test_vector_8_format_04(tmp_path, monkeypatch):
    path = tmp_path / "v04.mdl"
    expected = make_v04(path, monkeypatch)
    with open_src(path) as src:
        entries = {e.key: e for e in src.entries()}
        tree = load_tree(src)
        info = src.info
    assert [e for e in entries] == src.spec.keys()
    assert entries["model.tied"].kind == "link" and entries["model.tied"].target == "model.w"
    assert entries["arr"].kind == "array" and entries["model.w"].dtype == "bfloat16"
    assert tree["model"]["tied"] is tree["model"]["w"]
    assert_same_tree(describe(tree), describe(expected))
    assert info["release"] == "2.3" and info["cstorch_version"] == "2.3.0" and info["format_version"] == 0.4
    assert info["warnings"] == ["'missing' is in the tree spec but not in the file; it reads as None"]


@pytest.mark.parametrize(
    "kw", [{"dill_types": True}, {"counts": "none"}, {"counts": "wrong"}], ids=["dill_types", "no_counts", "bad_counts"]
)
def test_spec_pickle_variants(kw, tmp_path, monkeypatch):
    path = tmp_path / "v.mdl"
    expected = make_v04(path, monkeypatch, **kw)
    with open_src(path) as src:
        assert src.spec.num_leaves() == 14
        assert_same_tree(describe(load_tree(src)), describe(expected))


def test_format_03_numpy_arrays_are_tensors(tmp_path, monkeypatch):
    path = tmp_path / "v03.mdl"
    tree = {"w": F32, "od": collections.OrderedDict(x=torch.ones(1))}
    with h5py.File(path, "w") as f:
        f.attrs["__spec__"] = spec_hex(monkeypatch, tree)
        f.attrs["__version__"] = 0.3
        _numeric(f, "w", F32.numpy(), "NumpyArrayH5Type", is_bfloat16=False)
        _numeric(f, "od.x", np.ones(1, np.float32), "NumpyArrayH5Type", is_bfloat16=False)
    with open_src(path) as src:
        assert [e.kind for e in src.entries()] == ["tensor", "tensor"]
        got = load_tree(src)
        assert src.info["release"] == "1.9" and src.info["cstorch_version"] is None
    assert type(got["od"]) is collections.OrderedDict
    assert_same_tree(describe(got), describe(tree))


def test_release_18_flag_style_datasets(tmp_path, monkeypatch):
    path = tmp_path / "v02.mdl"
    tree = {"t": F32, "s": 3, "n": None, "str": "abc", "full": torch.zeros(3, dtype=torch.int32), "f": 2.5}
    with h5py.File(path, "w") as f:
        f.attrs["__spec__"] = spec_hex(monkeypatch, tree)
        f.attrs["__version__"] = 0.2
        _numeric(f, "t", F32.numpy(), None)
        _numeric(f, "s", np.array(3), None, is_scalar=True)
        _numeric(f, "f", np.array(2.5), None, is_scalar=True)
        _null(f, "n", None, is_none=True)
        _null(f, "str", None, is_string=True, string_val="abc")
        _null(f, "full", None, "i4", is_constructible=True, shape=np.array([3]), fill_value=0)
    with open_src(path) as src:
        got = load_tree(src)
        assert src.info["release"] == "1.8"
    assert_same_tree(describe(got), describe(tree))


def test_release_17_tensor_scalar_dict(tmp_path, monkeypatch):
    path = tmp_path / "v01.mdl"
    tree = _TensorScalarDict(loss=torch.tensor(1.0), acc=torch.tensor(0.5))
    with h5py.File(path, "w") as f:  # 1.7: no __version__ at all
        f.attrs["__spec__"] = spec_hex(monkeypatch, {"model": {"w": F32}, "metrics": tree})
        _numeric(f, "model.w", F32.numpy(), None)
        _numeric(f, "metrics.loss", np.array(1.0, np.float32), None)
        _numeric(f, "metrics.acc", np.array(0.5, np.float32), None)
    with open_src(path) as src:
        got = load_tree(src)
        assert src.info == {"format_version": 0.1, "cstorch_version": None, "release": "1.7", "complete": None}
    assert type(got["metrics"]) is dict
    assert_same_tree(describe(got), describe({"model": {"w": F32}, "metrics": dict(tree)}))


def test_legacy_converts_to_format_05(tmp_path, monkeypatch):
    path = tmp_path / "v04.mdl"
    expected = make_v04(path, monkeypatch)
    out = tmp_path / "new.mdl"
    with open_src(path) as src:
        copy_checkpoint(src, CsH5Sink(open_storage(str(out)), str(out)))
    with open_src(out) as src:
        assert src.info["format_version"] == 0.5
        got = load_tree(src)
    assert got["model"]["tied"] is got["model"]["w"]
    assert_same_tree(describe(got), describe(expected))


@pytest.mark.parametrize(
    ("h5type", "attrs"),
    [
        ("DeferredGraphTensor", {"jit_graph": "g", "shape": np.array([2])}),
        ("StoredApplianceTensorH5Type", {"filepath": "/elsewhere/raw.bin", "shape": np.array([2])}),
        ("DeferredH5Tensor", {"key": "w", "filepath": "other.mdl"}),
        ("SomethingNew", {}),
    ],
)
def test_external_and_unknown_entries_are_refused(h5type, attrs, tmp_path, monkeypatch):
    path = tmp_path / "x.mdl"
    with h5py.File(path, "w") as f:
        f.attrs["__spec__"] = spec_hex(monkeypatch, {"x": None})
        f.attrs["__version__"] = 0.4
        _null(f, "x", h5type, **attrs)
    with pytest.raises(UnsupportedFormat):
        open_src(path)


def test_malicious_spec_pickle_is_refused(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "attacks"))
    import make_h5_attacks

    path = tmp_path / "evil.mdl"
    with h5py.File(path, "w") as f:
        f.attrs["__spec__"] = make_h5_attacks.exec_pickle().hex()
        f.attrs["__version__"] = 0.4
    with pytest.raises(UnsafeCheckpoint, match=r"posix\.system"):
        open_src(path)
    with h5py.File(path, "r+") as f:
        f.attrs["__spec__"] = "zz-not-hex"
    with pytest.raises(CorruptCheckpoint, match="hex"):
        open_src(path)
    with h5py.File(path, "r+") as f:
        f.attrs["__spec__"] = pickle.dumps({"not": "a spec"}, protocol=4).hex()
    with pytest.raises(CorruptCheckpoint, match="tree spec"):
        open_src(path)
