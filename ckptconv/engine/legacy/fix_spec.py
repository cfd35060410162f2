"""Repair pre-2.0 Cerebras H5 checkpoints so release 2.0 and later load them (cs-checkpoint-format §4).

Checkpoints of releases up to 1.7 (legacy H5, format < 0.5) can fail to load in 2.0+ for three
reasons, each repaired here the way Model Zoo 2.0's ``fix_checkpoint_spec.py`` did:

1. **Spec**: the root ``__spec__`` (hex of a pickled torch ``TreeSpec``) may name
   ``TensorScalarDict``, a class later releases deleted. The spec is decoded with the restricted
   unpickler (that class read as ``dict``, nothing executed) and pickled again with plain dict
   nodes, in the attribute layout every torch release unpickles (``type``, ``context``,
   ``children_specs`` and the derived counts).
2. **Tied weights**: a key the spec lists but the file lacks is hard-linked to its known tied
   partner with the same prefix (word embeddings and LM head, final norm weight and bias); a
   missing key without a partner in the file is an error and nothing is written.
3. **Scheduler step**: with a ``global_step`` dataset, every ``lr_scheduler ... last_epoch`` value
   becomes the global step; when the scheduler has milestones (a sequential scheduler), sub-scheduler
   ``i > 0`` gets ``max(global_step - milestones[i - 1], 0)``.

A file without ``__version__`` (1.7) also gets ``__version__ = 0.1``, the version its absence
means, because loaders of 2.5 and later require the attribute.

The output is a copy (``<stem>_fixed<suffix>`` by default) or, with ``inplace``, the original
replaced atomically: the repair happens on a temporary copy beside it that is renamed over the
original only when every fix succeeded, so a failure never leaves a half-repaired checkpoint.
Everything is checked before anything is written. Local files only (HDF5 repairs edit in place).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ckptconv.core.errors import (
    CorruptCheckpoint,
    InvalidRequest,
    ObjectNotFound,
    SpecRepairError,
    TargetExists,
    UnsupportedFormat,
)
from ckptconv.formats import restricted_pickle
from ckptconv.formats.tree import DICT, LIST, ODICT, TUPLE, TreeSpec
from ckptconv.storage import open_storage

TIED_SUFFIXES: tuple[tuple[str, str], ...] = (
    ("embedding_layer.word_embeddings.weight", "lm_head.weight"),
    ("ln_f.weight", "transformer_decoder.norm.weight"),
    ("ln_f.bias", "transformer_decoder.norm.bias"),
)

_SUB_SCHEDULER = re.compile(r"(\d+)\.last_epoch$")
_TRAILING_INDEX = re.compile(r"\.(\d+)$")


@dataclass
class FixReport:
    """What a repair changed."""

    source: str
    output: str
    format_version: float
    tensor_scalar_dict: bool  # the old spec named TensorScalarDict
    links: list[tuple[str, str]] = field(default_factory=list)  # (missing key, partner it now links to)
    last_epoch: dict[str, int] = field(default_factory=dict)  # key -> value written
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "output": self.output,
            "format_version": self.format_version,
            "spec_rewritten": True,
            "tensor_scalar_dict": self.tensor_scalar_dict,
            "links": [{"key": k, "target": t} for k, t in self.links],
            "last_epoch": dict(self.last_epoch),
            "notes": list(self.notes),
        }


def default_fixed_path(path: str) -> str:
    """``dir/ckpt_fixed.mdl`` for ``dir/ckpt.mdl``."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}_fixed{p.suffix}"))


# --- the spec pickle ---------------------------------------------------------------------------


# Pickle opcodes used to write the spec (protocol 4; see Lib/pickletools.py for their definitions).
_PROTO4, _STOP, _MARK = b"\x80\x04", b".", b"("
_NONE, _TRUE, _FALSE = b"N", b"\x88", b"\x89"
_EMPTY_LIST, _APPENDS, _EMPTY_DICT, _SETITEMS = b"]", b"e", b"}", b"u"
_EMPTY_TUPLE, _NEWOBJ, _BUILD, _STACK_GLOBAL = b")", b"\x81", b"b", b"\x93"

_NODE_TYPES = {DICT: ("builtins", "dict"), ODICT: ("collections", "OrderedDict"), LIST: ("builtins", "list")}
_NODE_TYPES[TUPLE] = ("builtins", "tuple")


def _p_str(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) < 256:
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _p_int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])  # BININT1
    if -(1 << 31) <= n < 1 << 31:
        return b"J" + struct.pack("<i", n)  # BININT
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def _p_key(key: Any) -> bytes:
    if isinstance(key, bool):
        return _TRUE if key else _FALSE
    if isinstance(key, int):
        return _p_int(key)
    if isinstance(key, str):
        return _p_str(key)
    if key is None:
        return _NONE
    raise SpecRepairError(f"the tree spec has a dict key of type {type(key).__name__}, which cannot be rewritten")


def _p_list(items: list[bytes]) -> bytes:
    return _EMPTY_LIST + (_MARK + b"".join(items) + _APPENDS if items else b"")


def _p_node(spec: TreeSpec, depth: int = 0) -> bytes:
    if depth > 1000:
        raise SpecRepairError("the tree spec is nested too deeply")
    if spec.is_leaf:
        cls, node_type, context, children = "LeafSpec", _NONE, _NONE, b""
    else:
        if spec.type not in _NODE_TYPES:
            raise SpecRepairError(
                f"the tree spec holds a {spec.type} node, which the legacy spec format cannot express",
                hint="load the checkpoint with the release that wrote it and save it again",
            )
        cls = "TreeSpec"
        node_type = _p_str(_NODE_TYPES[spec.type][0]) + _p_str(_NODE_TYPES[spec.type][1]) + _STACK_GLOBAL
        context = _p_list([_p_key(k) for k in spec.context]) if spec.type in (DICT, ODICT) else _NONE
        children = b"".join(_p_node(c, depth + 1) for c in spec.children)
    state = {
        "type": node_type,
        "context": context,
        "children_specs": _EMPTY_LIST + (_MARK + children + _APPENDS if children else b""),
        "num_nodes": _p_int(_count_nodes(spec)),
        "num_leaves": _p_int(spec.num_leaves()),
        "num_children": _p_int(len(spec.children)),
    }
    # cls.__new__(cls) then BUILD with a state dict: every torch release restores that by updating
    # the instance __dict__ (2.0's plain class, 2.1-2.4's dataclass), with no __init__ run.
    body = b"".join(_p_str(k) + v for k, v in state.items())
    return (
        _p_str("torch.utils._pytree")
        + _p_str(cls)
        + _STACK_GLOBAL
        + _EMPTY_TUPLE
        + _NEWOBJ
        + _EMPTY_DICT
        + _MARK
        + body
        + _SETITEMS
        + _BUILD
    )


def _count_nodes(spec: TreeSpec) -> int:
    return 1 + sum(_count_nodes(c) for c in spec.children)


def spec_pickle_hex(spec: TreeSpec) -> str:
    """The legacy ``__spec__`` text: hex of a protocol-4 pickle of the spec as torch TreeSpec objects."""
    return (_PROTO4 + _p_node(spec) + _STOP).hex()


def _read_spec(raw: Any, path: str) -> tuple[TreeSpec, bool]:
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    if not isinstance(raw, str):
        raise CorruptCheckpoint(f"{path}: __spec__ is not text")
    try:
        payload = bytes.fromhex(raw)
    except ValueError:
        raise CorruptCheckpoint(f"{path}: __spec__ is not hex-encoded") from None
    node = restricted_pickle.loads(payload, what=f"tree spec of {path}")
    if not isinstance(node, restricted_pickle.PickledTreeSpec):
        raise CorruptCheckpoint(f"{path}: __spec__ does not hold a tree spec")
    return node.to_tree_spec(), b"TensorScalarDict" in payload


# --- the repair --------------------------------------------------------------------------------


def _local(path: str) -> str:
    local = open_storage(path).local_path(path)
    if local is None:
        raise InvalidRequest(
            f"fix-spec edits HDF5 files in place and needs a local path, not {path}",
            hint="download the checkpoint, repair it, and upload the result",
        )
    return str(local)


def _scalar(ds: Any, key: str) -> Any:
    if ds.shape != () or ds.dtype.kind not in "iuf":
        raise CorruptCheckpoint(f"{key!r} should hold one number but is {ds.dtype}{list(ds.shape or [])}")
    return ds[()].item()


@dataclass
class _Planned:
    version: float
    add_version: bool
    spec_hex: str
    tensor_scalar_dict: bool
    links: list[tuple[str, str]]
    last_epoch: dict[str, int]
    notes: list[str]


def _plan(f: Any, path: str) -> _Planned:
    """Decide every change from the original file, before anything is written."""
    import numpy as np

    raw_version = f.attrs.get("__version__")
    version = 0.1 if raw_version is None else float(np.asarray(raw_version).reshape(()))
    if version >= 0.5:
        raise UnsupportedFormat(
            f"{path} is Cerebras H5 format {version}; fix-spec repairs legacy checkpoints (format < 0.5)",
            hint="this checkpoint loads in release 2.0 and later as it is",
        )
    if "__spec__" not in f.attrs:
        raise CorruptCheckpoint(f"{path}: legacy checkpoint without a __spec__ attribute")
    spec, had_tsd = _read_spec(f.attrs["__spec__"], path)
    keys = spec.keys()
    present = {k for k in keys if quote(k, safe="") in f}

    links: list[tuple[str, str]] = []
    unresolved: list[str] = []
    for key in keys:
        if key in present:
            continue
        partner = tied_partner(key, present)
        if partner is None:
            unresolved.append(key)
        else:
            links.append((key, partner))
    if unresolved:
        raise SpecRepairError(
            f"{len(unresolved)} keys of the tree spec are missing from {path} and have no tied partner "
            f"in it: {', '.join(unresolved[:5])}",
            missing=unresolved[:50],
        )

    notes: list[str] = []
    if raw_version is None:
        # 1.7 wrote no version; loaders of 2.5+ require the attribute (absent means 0.1, §0).
        notes.append("recorded __version__ 0.1, which the file implied by having none")
    last_epoch: dict[str, int] = {}
    if "global_step" not in present:
        notes.append("no global_step dataset: learning-rate scheduler steps left unchanged")
    else:
        step = int(_scalar(f[quote("global_step", safe="")], "global_step"))
        milestones = []
        for key in sorted(
            (k for k in present if "lr_scheduler" in k and "milestones" in k and _TRAILING_INDEX.search(k)),
            key=lambda k: int(_TRAILING_INDEX.search(k).group(1)),  # type: ignore[union-attr]
        ):
            milestones.append(int(_scalar(f[quote(key, safe="")], key)))
        for key in keys:
            if key not in present or "lr_scheduler" not in key or "last_epoch" not in key:
                continue
            _scalar(f[quote(key, safe="")], key)  # must be a number we can overwrite
            value = step
            m = _SUB_SCHEDULER.search(key)
            if milestones and m and int(m.group(1)) > 0:
                i = int(m.group(1))
                if i - 1 >= len(milestones):
                    raise SpecRepairError(
                        f"{key!r} belongs to sub-scheduler {i} but the scheduler has {len(milestones)} milestones"
                    )
                value = max(step - milestones[i - 1], 0)
            last_epoch[key] = value
    return _Planned(version, raw_version is None, spec_pickle_hex(spec), had_tsd, links, last_epoch, notes)


def tied_partner(key: str, present: set[str]) -> str | None:
    """The key of ``present`` that ``key`` is tied to (same prefix, a known tied pair), if any."""
    for a, b in TIED_SUFFIXES:
        for mine, other in ((a, b), (b, a)):
            if key == mine or key.endswith("." + mine):
                candidate = key[: len(key) - len(mine)] + other
                if candidate in present:
                    return candidate
    return None


def _apply(path: str, plan: _Planned) -> None:
    import h5py

    with h5py.File(path, "r+") as f:
        f.attrs["__spec__"] = plan.spec_hex
        if plan.add_version:
            f.attrs["__version__"] = float(plan.version)
        for key, partner in plan.links:
            f[quote(key, safe="")] = f[quote(partner, safe="")]  # a hard link, as legacy ties are
        for key, value in plan.last_epoch.items():
            ds = f[quote(key, safe="")]
            ds[()] = value


def fix_checkpoint_spec(path: str, output: str | None = None, *, inplace: bool = False) -> FixReport:
    """Repair the legacy checkpoint at ``path`` (see the module docstring); returns what changed.

    ``output`` defaults to ``<stem>_fixed<suffix>`` beside it; ``inplace`` replaces ``path``
    itself (atomically). An existing output is never overwritten (TargetExists).
    """
    from ckptconv.formats.cs_h5_io import H5File, damaged_as_corrupt  # h5py: only when a file is fixed

    if inplace and output is not None:
        raise InvalidRequest("give an output path or inplace, not both")
    src = _local(path)
    if not os.path.isfile(src):
        raise ObjectNotFound(f"no checkpoint at {path}")
    final = src if inplace else _local(output or default_fixed_path(path))
    if not inplace and os.path.lexists(final):
        raise TargetExists(f"{final} already exists")
    # Read through the checkpoint reader's checked opening (global heap collections checked before
    # HDF5 walks them, damaged structures as CorruptCheckpoint): the user's file is untrusted. The
    # copy edited below holds the same bytes, and the edit touches only what this read went through.
    h5 = H5File(open_storage(src), src)
    try:
        with damaged_as_corrupt(path):
            plan = _plan(h5.file, path)
    finally:
        h5.close()

    tmp = os.path.join(os.path.dirname(final) or ".", f".{os.path.basename(final)}.fixing-{uuid.uuid4().hex[:8]}")
    try:
        shutil.copyfile(src, tmp)
        _apply(tmp, plan)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if inplace:
            os.replace(tmp, final)
        else:
            if os.path.lexists(final):
                raise TargetExists(f"{final} already exists")
            os.rename(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return FixReport(path, final, plan.version, plan.tensor_scalar_dict, plan.links, plan.last_epoch, plan.notes)
