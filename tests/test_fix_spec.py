"""fix-spec: repairing release <= 1.7 Cerebras H5 checkpoints (cs-checkpoint-format §2, §4).

Legacy files are built here with h5py the way the 1.7 saver laid them out: a root ``__spec__`` holding
the hex of a pickled torch ``TreeSpec`` whose nodes may be ``TensorScalarDict`` (a class later
releases deleted), no ``__version__``, one root dataset per key named ``quote(key, safe="")``,
scalars as 0-d datasets flagged ``is_scalar``. When the optional cstorch oracle venv exists
(``scripts/setup-cstorch-oracle.sh``), the real ``cstorch.load`` of release 2.10 loads the repaired
file and fails on the original.
"""

from __future__ import annotations

import copyreg
import io
import json
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path
from urllib.parse import quote

import h5py
import numpy as np
import pytest
import torch
from forked import outcome_in_child

from ckptconv.core.errors import InvalidRequest, SpecRepairError, TargetExists, UnsupportedFormat
from ckptconv.engine.legacy.fix_spec import default_fixed_path, fix_checkpoint_spec
from ckptconv.formats import restricted_pickle
from ckptconv.formats.cs_h5 import CsH5Source
from ckptconv.storage import open_storage

TSD_MODULE = "cerebras_pytorch.utils.tensor_scalar_dict"


class _Node:
    """A spec node as torch 2.0 pickled it: TreeSpec/LeafSpec with a __dict__ of four fields."""

    def __init__(self, type_: object = None, context: object = None, children: list | None = None) -> None:
        self.type = type_
        self.context = context
        self.children = children or []

    @property
    def leaves(self) -> int:
        return 1 if self.type is None else sum(c.leaves for c in self.children)

    @property
    def __class__(self):  # pickle checks that NEWOBJ's class is the object's class
        from torch.utils import _pytree

        return _pytree.LeafSpec if self.type is None else _pytree.TreeSpec


class _OldPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if type(obj) is _Node:
            state = {"type": obj.type, "context": obj.context, "children_specs": obj.children, "num_leaves": obj.leaves}
            return copyreg.__newobj__, (obj.__class__,), state
        return NotImplemented


def _spec_of(tree: object, tsd: type) -> _Node:
    if isinstance(tree, dict):
        kind = tsd if getattr(tree, "_tsd", False) else dict
        return _Node(kind, list(tree), [_spec_of(v, tsd) for v in tree.values()])
    if isinstance(tree, list):
        return _Node(list, None, [_spec_of(v, tsd) for v in tree])
    return _Node()


class _TsdMarker(dict):
    _tsd = True


def _leaves(tree: object, path: tuple = ()) -> list[tuple[str, object]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _leaves(v, (*path, str(k)))]
    if isinstance(tree, list):
        return [kv for i, v in enumerate(tree) for kv in _leaves(v, (*path, str(i)))]
    return [(".".join(path), tree)]


@pytest.fixture
def tsd_class(monkeypatch):
    """The 1.7 TensorScalarDict class, importable only inside the test (as in a 1.7 environment)."""
    for name in ("cerebras_pytorch", "cerebras_pytorch.utils", TSD_MODULE):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    cls = type("TensorScalarDict", (dict,), {"__module__": TSD_MODULE})
    sys.modules[TSD_MODULE].TensorScalarDict = cls
    return cls


MISSING = object()


def write_legacy(path: Path, tree: dict, tsd: type, *, version: float | None = None) -> None:
    """A legacy file; leaves equal to MISSING are listed in the spec but not stored.

    Without ``version`` it is laid out as 1.7 did (no ``__version__``, flag attributes); with one,
    as 1.9 did (``__H5_TYPE__`` on every dataset).
    """
    buf = io.BytesIO()
    _OldPickler(buf, protocol=4).dump(_spec_of(tree, tsd))
    with h5py.File(path, "w") as f:
        f.attrs["__spec__"] = buf.getvalue().hex()
        if version is not None:
            f.attrs["__version__"] = version
        for key, value in _leaves(tree):
            if value is MISSING:
                continue
            name = quote(key, safe="")
            if value is None:  # stored as a None entry (1.9 saved some tied members so)
                ds = f.create_dataset(name, shape=None, dtype="f4")
                if version is None:
                    ds.attrs["is_none"] = True
                else:
                    ds.attrs["__H5_TYPE__"] = "NoneH5Type"
            elif isinstance(value, torch.Tensor):
                ds = f.create_dataset(name, data=value.numpy())
                if version is not None:
                    ds.attrs["__H5_TYPE__"] = "TorchTensorH5Type"
                    ds.attrs["is_bfloat16"] = False
            else:
                ds = f.create_dataset(name, data=np.array(value))
                if version is None:
                    ds.attrs["is_scalar"] = True
                else:
                    ds.attrs["__H5_TYPE__"] = "ScalarH5Type"


def gpt_tree() -> dict:
    sched = _TsdMarker(
        {
            "_schedulers": [{"last_epoch": 0, "base_lrs": [0.1]}, {"last_epoch": 0, "base_lrs": [0.1]}],
            "_milestones": [100],
            "last_epoch": 0,
        }
    )
    return {
        "model": _TsdMarker(
            {
                "embedding_layer.word_embeddings.weight": torch.arange(12, dtype=torch.float32).reshape(4, 3),
                "lm_head.weight": MISSING,
                "ln_f.weight": torch.ones(3),
                "ln_f.bias": torch.zeros(3),
                "transformer_decoder.norm.bias": MISSING,
            }
        ),
        "lr_scheduler": sched,
        "global_step": 250,
    }


def test_repairs_spec_ties_and_scheduler_steps(tmp_path, tsd_class):
    path = tmp_path / "model.mdl"
    write_legacy(path, gpt_tree(), tsd_class)
    original = path.read_bytes()
    report = fix_checkpoint_spec(str(path))
    assert report.output == str(tmp_path / "model_fixed.mdl") == default_fixed_path(str(path))
    assert path.read_bytes() == original  # the original is untouched
    assert report.tensor_scalar_dict
    assert "__version__ 0.1" in report.notes[0]
    assert sorted(report.links) == [
        ("model.lm_head.weight", "model.embedding_layer.word_embeddings.weight"),
        ("model.transformer_decoder.norm.bias", "model.ln_f.bias"),
    ]
    assert report.last_epoch == {
        "lr_scheduler._schedulers.0.last_epoch": 250,
        "lr_scheduler._schedulers.1.last_epoch": 150,  # 250 - milestone 100
        "lr_scheduler.last_epoch": 250,
    }

    with h5py.File(report.output, "r") as f:
        assert f.attrs["__version__"] == pytest.approx(0.1)
        payload = bytes.fromhex(f.attrs["__spec__"])
        assert b"TensorScalarDict" not in payload
        emb = f[quote("model.embedding_layer.word_embeddings.weight", safe="")]
        assert f[quote("model.lm_head.weight", safe="")] == emb  # the same HDF5 object: a hard link
    spec = restricted_pickle.loads(payload).to_tree_spec()
    assert spec.keys() == [k for k, _ in _leaves(gpt_tree())]

    src = CsH5Source(open_storage(report.output), report.output)
    got = {e.key: e for e in src.entries()}
    assert got["model.lm_head.weight"].kind == "link"
    assert torch.equal(src.read("model.lm_head.weight"), torch.arange(12, dtype=torch.float32).reshape(4, 3))
    assert src.read("lr_scheduler._schedulers.1.last_epoch") == 150
    assert src.read("lr_scheduler.last_epoch") == 250
    assert src.read("global_step") == 250


def test_inplace_output_path_and_refusals(tmp_path, tsd_class):
    path = tmp_path / "a.mdl"
    write_legacy(path, gpt_tree(), tsd_class)
    out = tmp_path / "elsewhere.h5"
    fix_checkpoint_spec(str(path), str(out))
    assert out.exists()
    with pytest.raises(TargetExists):
        fix_checkpoint_spec(str(path), str(out))
    with pytest.raises(InvalidRequest):
        fix_checkpoint_spec(str(path), str(out), inplace=True)
    report = fix_checkpoint_spec(str(path), inplace=True)
    assert report.output == str(path)
    with h5py.File(path, "r") as f:
        assert b"TensorScalarDict" not in bytes.fromhex(f.attrs["__spec__"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.mdl", "elsewhere.h5"]  # no temporary left


def test_a_missing_key_without_partner_writes_nothing(tmp_path, tsd_class):
    tree = gpt_tree()
    tree["model"]["attn.weight"] = MISSING
    path = tmp_path / "b.mdl"
    write_legacy(path, tree, tsd_class)
    with pytest.raises(SpecRepairError, match=r"model\.attn\.weight"):
        fix_checkpoint_spec(str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["b.mdl"]


def test_without_global_step_scheduler_steps_stay(tmp_path, tsd_class):
    tree = gpt_tree()
    del tree["global_step"]
    path = tmp_path / "c.mdl"
    write_legacy(path, tree, tsd_class, version=0.3)
    report = fix_checkpoint_spec(str(path))
    assert report.last_epoch == {} and "global_step" in report.notes[0]
    assert report.format_version == pytest.approx(0.3)


def test_current_format_is_refused(tmp_path):
    path = tmp_path / "new.mdl"
    with h5py.File(path, "w") as f:
        f.attrs["__version__"] = 0.5
    with pytest.raises(UnsupportedFormat, match="legacy"):
        fix_checkpoint_spec(str(path))


def test_cli(tmp_path, tsd_class, capsys):
    from ckptconv.cli import main

    path = tmp_path / "d.mdl"
    write_legacy(path, gpt_tree(), tsd_class)
    assert main(["fix-spec", str(path), "--fixed_checkpoint_path", str(tmp_path / "e.mdl"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["output"] == str(tmp_path / "e.mdl")
    # In place needs a confirmation; without a terminal it must be given as --yes.
    assert main(["fix-spec", str(path), "--fix_inplace"]) == 2
    assert "--yes" in capsys.readouterr().err
    assert main(["fix-spec", str(path), "--fix_inplace", "--yes"]) == 0


CSTORCH = Path(os.environ.get("CKPTCONV_CSTORCH_VENV", Path.home() / ".cache/ckptconv/venv-cstorch")) / "bin/python"


@pytest.mark.skipif(not CSTORCH.exists(), reason="optional cstorch oracle venv not installed (setup-cstorch-oracle.sh)")
def test_real_cstorch_loads_the_repaired_file(tmp_path, tsd_class):
    # Release 2.10 reads legacy datasets only with __H5_TYPE__ (1.9 layout): its code path for the
    # older flag attributes fails on an import of its own. The spec repair is the same for both.
    path = tmp_path / "g.mdl"
    write_legacy(path, gpt_tree(), tsd_class, version=0.3)
    fixed = fix_checkpoint_spec(str(path)).output
    script = """
import json, sys
import cerebras.pytorch as cstorch
out = {}
for p in sys.argv[1:]:
    try:
        sd = cstorch.load(p)
        m = sd["model"]
        out[p] = {
            "tied": bool((m["lm_head.weight"] == m["embedding_layer.word_embeddings.weight"]).all()),
            "last_epoch": [s["last_epoch"] for s in sd["lr_scheduler"]["_schedulers"]],
            "top": sd["lr_scheduler"]["last_epoch"],
            "type": type(sd["lr_scheduler"]).__name__,
        }
    except Exception as e:
        out[p] = {"error": type(e).__name__}
print(json.dumps(out))
"""
    proc = subprocess.run([str(CSTORCH), "-c", script, str(path), fixed], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" in result[str(path)]  # the unrepaired file names a class 2.x no longer has
    assert result[fixed] == {"tied": True, "last_epoch": [250, 150], "top": 250, "type": "dict"}


def _damage_heap(path: Path) -> None:
    """Zero the header of the object after the first one in the file's first global heap collection:
    an object of 0 bytes, on which HDF5 loops forever."""
    import struct

    data = bytearray(path.read_bytes())
    at = data.index(b"GCOL")
    index, _, _, length = struct.unpack_from("<HHIQ", data, at + 16)
    assert index != 0
    second = at + 16 + 16 + ((length + 7) & ~7)
    data[second : second + 16] = bytes(16)
    path.write_bytes(bytes(data))


def test_a_file_whose_heap_would_hang_hdf5_is_refused_as_corrupt_not_walked(tmp_path, tsd_class):
    """fix-spec reads the user's file through the checkpoint reader's checked opening: a global heap
    object declaring 0 bytes (HDF5 loops on it forever) in a legacy file is refused, and nothing is
    written. A forked child, so that a regression fails instead of hanging the suite."""
    src = tmp_path / "src" / "legacy.mdl"
    src.parent.mkdir()
    write_legacy(src, gpt_tree(), tsd_class)
    _damage_heap(src)
    out = tmp_path / "out" / "fixed.mdl"
    out.parent.mkdir()
    outcome = outcome_in_child(fix_checkpoint_spec, str(src), str(out))
    assert outcome is not None, "HDF5 walked the damaged heap collection"
    assert outcome == "CorruptCheckpoint"
    assert list(out.parent.iterdir()) == []
