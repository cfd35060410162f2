"""Load the ``model`` state of a Cerebras checkpoint into a simulator model, strictly by default.

The rules are PyTorch's ``load_state_dict`` as the Model Zoo trainer applies it:

- the checkpoint's ``model`` keys must equal the model's ``state_dict()`` keys, tied duplicates
  included (``lm_head.weight`` next to ``embedding_layer.word_embeddings.weight``, ``ln_f.*`` next to
  ``transformer_decoder.norm.*``); any missing or unexpected key is a :class:`CheckpointMismatch`
  that lists them by name;
- ``disable_strict_checkpoint_loading`` accepts extra and missing keys (missing tensors keep their
  initial values) and reports them;
- a shape mismatch is always an error;
- trainer checkpoints prefix every model key with ``model.`` (the trainer wraps the model); keys
  with that prefix load into the inner model, as the trainer's loader does.

Tensors stream one at a time from the source into the parameters, upcast to the model's float32,
so memory holds the model plus one tensor.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ckptconv.core.errors import CheckpointError, CheckpointMismatch
from ckptconv.core.releases import parse_release
from ckptconv.engine.simulator.checkpoint_io import read_checkpoint, subtree_spec, top_level_keys
from ckptconv.formats.base import Entry, TensorSource
from ckptconv.formats.links import link_root

WRAPPER_PREFIX = "model."
MAX_LISTED = 50


@dataclass
class LoadReport:
    loaded: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrapper_prefix: bool = False
    source_dtypes: dict[str, int] = field(default_factory=dict)
    tied_conflicts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "loaded": self.loaded,
            "missing": self.missing,
            "unexpected": self.unexpected,
            "wrapper_prefix": self.wrapper_prefix,
            "source_dtypes": self.source_dtypes,
            "tied_conflicts": self.tied_conflicts,
        }


def checkpoint_model_keys(source: TensorSource) -> dict[str, str]:
    """Model state-dict key -> flat checkpoint key, for the checkpoint's top-level ``model``."""
    tops = top_level_keys(source)
    if "model" not in tops:
        raise CheckpointMismatch(
            "the checkpoint has no top-level `model` state",
            hint="a Cerebras model checkpoint is {'model': state_dict, ...}; check the file",
            top_level_keys=sorted(tops),
        )
    child = subtree_spec(source, "model")
    if child is not None:
        if child.is_leaf:
            raise CheckpointMismatch("the checkpoint's `model` entry is a single value, not a state dict")
        rel = child.keys()
    else:
        rel = [k[len("model.") :] for k in tops["model"]]
    mapping = {k: f"model.{k}" for k in rel}
    if mapping and all(k.startswith(WRAPPER_PREFIX) for k in mapping):
        mapping = {k[len(WRAPPER_PREFIX) :]: flat for k, flat in mapping.items()}
    return mapping


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:MAX_LISTED])
    more = f" (and {len(keys) - MAX_LISTED} more)" if len(keys) > MAX_LISTED else ""
    return shown + more


def tied_groups(model: nn.Module) -> dict[str, list[str]]:
    """State-dict key -> the other keys naming the same tensor."""
    by_id: dict[int, list[str]] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(v), []).append(k)
    return {k: [o for o in ks if o != k] for ks in by_id.values() for k in ks if len(ks) > 1}


def check_keys(
    model: nn.Module, entries: dict[str, Entry], mapping: dict[str, str], *, strict: bool
) -> tuple[list[str], list[str]]:
    """Missing and unexpected keys; raises CheckpointMismatch for shape mismatches and, when strict, any difference."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    missing = [k for k in expected if k not in mapping]
    unexpected = [k for k in mapping if k not in expected]
    shapes = []
    for k, flat in mapping.items():
        if k not in expected:
            continue
        e = entries.get(link_root(flat, entries))
        if e is None or e.kind not in ("tensor", "array"):
            shapes.append(f"{k}: not a tensor in the checkpoint")
        elif tuple(e.shape or ()) != expected[k]:
            shapes.append(f"{k}: checkpoint {list(e.shape or ())} vs model {list(expected[k])}")
    if shapes:
        raise CheckpointMismatch(
            f"{len(shapes)} tensor(s) have the wrong shape: {_listing(shapes)}",
            mismatched=shapes,
            missing=missing,
            unexpected=unexpected,
        )
    if strict and (missing or unexpected):
        ties = tied_groups(model)
        notes = [
            f"{k} (tied to {', '.join(ties[k])}, which the checkpoint has)"
            for k in missing
            if any(o in mapping for o in ties.get(k, []))
        ]
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s): {_listing(unexpected)}")
        if notes:
            parts.append(f"tied duplicates absent from the checkpoint: {_listing(notes)}")
        raise CheckpointMismatch(
            "the checkpoint does not match the model: " + "; ".join(parts),
            missing=missing,
            unexpected=unexpected,
            tied_missing=notes,
        )
    return missing, unexpected


@torch.no_grad()
def load_model_state(model: nn.Module, source: TensorSource, *, strict: bool = True) -> LoadReport:
    """Copy the checkpoint's ``model`` tensors into ``model``; see the module docstring for the rules."""
    entries = {e.key: e for e in source.entries()}
    mapping = checkpoint_model_keys(source)
    report = LoadReport(wrapper_prefix=any(flat[len("model.") :] != k for k, flat in mapping.items()))
    report.missing, report.unexpected = check_keys(model, entries, mapping, strict=strict)
    params = model.state_dict(keep_vars=True)
    dtypes: Counter[str] = Counter()
    written: set[int] = set()
    for key, flat in mapping.items():
        target = params.get(key)
        if target is None:
            continue
        value = source.read(flat)
        if not isinstance(value, torch.Tensor):
            raise CheckpointMismatch(f"{key}: the checkpoint holds a {type(value).__name__}, not a tensor")
        dtypes[str(value.dtype).removeprefix("torch.")] += 1
        if id(target) in written and not torch.equal(target.data, value.to(target.dtype)):
            report.tied_conflicts.append(key)
        target.data.copy_(value.to(target.dtype))
        written.add(id(target))
        report.loaded += 1
    report.source_dtypes = dict(dtypes)
    return report


def read_metadata(source: TensorSource) -> list[dict[str, Any]] | None:
    if "__metadata__" not in top_level_keys(source):
        return None
    meta = read_checkpoint(source, ["__metadata__"]).get("__metadata__")
    if not isinstance(meta, list):
        raise CheckpointError("`__metadata__` is not a list")
    return meta


def check_release(metadata: list[dict[str, Any]] | None, running: str, *, strict_version: bool = True) -> str | None:
    """The trainer's load-time version check; returns a warning text when not strict, raises when strict.

    Checkpoints without ``__metadata__`` or a version (e.g. fresh HF conversions) and versions with
    a local ``+...`` part are not checked.
    """
    if not metadata:
        return None
    last = metadata[-1] if isinstance(metadata[-1], dict) else {}
    version = last.get("version") or ""
    if not version or "+" in str(version):
        return None
    have, want = parse_release(version), parse_release(running)
    if have is None or have == want:
        return None
    msg = (
        f"checkpoint version {version} does not match the simulated release {running}; convert it with "
        f"`ckptconv convert --tgt-fmt cs-{want[0]}.{want[1]}` or set checkpoint.strict_version: false"
    )
    if strict_version:
        raise CheckpointError(msg, checkpoint_version=version, release=running)
    return msg
