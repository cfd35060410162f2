"""Read and write whole trainer checkpoints through the format layer (Cerebras H5, local or S3).

A trainer checkpoint is a nested state dict (``model``, ``optimizer``, ``schedulers``,
``global_step``, ``dataloader``, ``__metadata__``). Writing flattens it with :mod:`ckptconv.formats.tree`,
announces one :class:`~ckptconv.formats.base.Entry` per leaf (tensors, plain values, and links for
tensors that appear twice, as ``cstorch.save`` stores tied weights) and streams the leaves into the
``cs-h5`` sink. Reading goes the other way through the ``cs-h5`` source, optionally only for some
top-level keys, so a model-only read never touches optimizer state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ckptconv.core.errors import CheckpointError, UnsupportedValue
from ckptconv.formats import sink_class, source_class
from ckptconv.formats.base import Entry, OutputFile, TensorSource, dtype_name
from ckptconv.formats.tree import DICT, ODICT, TreeSpec, flatten, unflatten
from ckptconv.storage import open_storage

CS_FORMAT = "cs-h5"


def open_checkpoint(uri: str) -> TensorSource:
    """A ``cs-h5`` source over ``uri`` (local path or ``s3://``)."""
    return source_class(CS_FORMAT)(open_storage(uri), uri)


def _tensor_identity(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def entries_for(leaves: list[tuple[str, Any]]) -> list[Entry]:
    """One entry per leaf; a tensor seen before (same storage, offset, shape, strides) becomes a link."""
    entries: list[Entry] = []
    first: dict[tuple[Any, ...], str] = {}
    for key, value in leaves:
        if isinstance(value, torch.Tensor):
            ident = _tensor_identity(value)
            if ident in first:
                entries.append(Entry(key, "link", target=first[ident]))
                continue
            first[ident] = key
            entries.append(Entry(key, "tensor", dtype_name(value.dtype), tuple(value.shape)))
        elif value is None or isinstance(value, bool | int | float | str):
            entries.append(Entry(key, "value", value=value))
        else:
            raise UnsupportedValue(f"{key!r}: a {type(value).__name__} cannot be stored in a trainer checkpoint")
    return entries


def write_checkpoint(uri: str, state: dict[str, Any], *, cstorch_version: str) -> list[OutputFile]:
    """Write ``state`` as a Cerebras H5 checkpoint at ``uri``; nothing is visible before it is complete."""
    leaves, spec = flatten(state)
    entries = entries_for(leaves)
    sink = sink_class(CS_FORMAT)(open_storage(uri), uri, cstorch_version=cstorch_version)
    sink.check(entries)
    values = dict(leaves)
    try:
        sink.begin(entries, spec)
        for e in entries:
            if e.kind == "link":
                continue
            v = values[e.key]
            sink.write(e.key, v.detach() if isinstance(v, torch.Tensor) else v)
        return sink.commit()
    except BaseException:
        sink.abort()
        raise


def top_level_keys(source: TensorSource) -> dict[str, list[str]]:
    """Top-level key -> the flat keys below it, in checkpoint order."""
    spec = source.spec
    if spec is None:
        # A flat dict: every flat key is its own top-level key.
        return {e.key: [e.key] for e in source.entries()}
    if spec.type not in (DICT, ODICT):
        raise CheckpointError("the checkpoint is not a dict of states")
    out: dict[str, list[str]] = {}
    for label, child in zip(spec.child_labels(), spec.children, strict=True):
        prefix = str(label)
        leaf_paths = child.keys()  # flat paths below this child ("" for a leaf child)
        out[prefix] = [f"{prefix}.{k}" if k else prefix for k in leaf_paths]
    return out


def subtree_spec(source: TensorSource, key: str) -> TreeSpec | None:
    spec = source.spec
    if spec is None:
        return None
    for label, child in zip(spec.child_labels(), spec.children, strict=True):
        if str(label) == key:
            return child
    return None


def read_checkpoint(source: TensorSource, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """The checkpoint as a nested dict, limited to the top-level ``keys`` when given."""
    tops = top_level_keys(source)
    wanted = list(tops) if keys is None else [k for k in tops if k in set(keys)]
    out: dict[str, Any] = {}
    spec = source.spec
    labels = {str(label): label for label in spec.child_labels()} if spec is not None else {}
    by_key = {e.key: e for e in source.entries()}
    cache: dict[str, Any] = {}

    def read(key: str) -> Any:
        # A link reuses the value already read for its target, so tied tensors stay one tensor.
        entry = by_key.get(key)
        if entry is not None and entry.kind == "link" and entry.target in cache:
            return cache[entry.target]
        value = source.read(key)
        if isinstance(value, torch.Tensor):
            cache[key] = value
        return value

    for top in wanted:
        flat_keys = tops[top]
        values = [read(k) for k in flat_keys]
        child = subtree_spec(source, top)
        leaf = child is None or child.is_leaf
        out[labels.get(top, top)] = (values[0] if values else None) if leaf else unflatten(values, child)
    return out
