"""Legacy Cerebras H5 checkpoints (format 0.1-0.4, releases 1.7-2.4), read only (cs-checkpoint-format §2).

Differences from format 0.5:

- the root ``__spec__`` is the hex of a dill pickle of torch's ``TreeSpec``; it is decoded with
  :mod:`ckptconv.formats.restricted_pickle` (stand-in classes, nothing executed) and its leaf count
  recomputed;
- every leaf is a dataset at the root named ``urllib.parse.quote(key, safe="")``, described by its
  ``__H5_TYPE__`` attribute (1.9+) or by flag attributes (1.7/1.8);
- tied weights are HDF5 hard links: the first key in flatten order holds the data, later names
  of the same object become ``link`` entries;
- there is no ``__SUCCESS__`` marker; keys of the spec missing from the file read as None, with
  a warning (as cstorch does);
- format 0.3 and older stored torch tensors as ``NumpyArrayH5Type``: they read as tensors.

Entries that reference data outside the file (raw appliance files, other checkpoints, traced
graphs) are refused with UnsupportedFormat.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

import h5py
import numpy as np

from ckptconv.core.errors import CorruptCheckpoint, UnsupportedDtype, UnsupportedFormat
from ckptconv.formats import restricted_pickle
from ckptconv.formats.base import Entry
from ckptconv.formats.cs_base import decode_object, follow_link, full_tensor, release_of
from ckptconv.formats.cs_h5_io import H5File
from ckptconv.formats.cs_serializers import check_unique_keys, numpy_dtype_name
from ckptconv.formats.listed_entries import ListedEntries
from ckptconv.formats.tree import TreeSpec

log = logging.getLogger(__name__)

_EXTERNAL = {
    "DeferredGraphTensor": "a traced graph that only the Cerebras appliance can evaluate",
    "DeferredFileTensor": "a raw tensor file outside the checkpoint",
    "StoredApplianceTensorH5Type": "a raw tensor file outside the checkpoint",
}
_NUMERIC = ("TorchTensorH5Type", "NumpyArrayH5Type", "StoredTensorH5Type")
_FULL = ("DeferredFullTensor", "FullTensorH5Type")


def _str(v: Any) -> Any:
    if isinstance(v, np.ndarray) and v.shape == ():
        v = v[()]
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v


def _flag(h5: H5File, ds: h5py.Dataset, name: str) -> bool:
    v = h5.attr(ds, name)
    return v is not None and bool(np.asarray(v).any())


def _shape(key: str, v: Any) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in np.asarray(v).reshape(-1))
    except (TypeError, ValueError):
        raise CorruptCheckpoint(f"{key!r}: shape attribute {v!r} is not a list of sizes") from None
    if any(d < 0 for d in dims):
        raise CorruptCheckpoint(f"{key!r}: negative size in shape {dims}")
    return dims


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


class LegacyLayout(ListedEntries):
    """Metadata and reads of one legacy file (used by :class:`~ckptconv.formats.cs_h5.CsH5Source`)."""

    def __init__(self, h5: H5File, version: float) -> None:
        self.h5 = h5
        self.version = version
        self.warnings: list[str] = []
        raw = _str(h5.root_attr("__spec__"))
        if raw is None:
            raise CorruptCheckpoint(f"{h5.uri}: legacy checkpoint without a __spec__ attribute")
        try:
            payload = bytes.fromhex(raw) if isinstance(raw, str) else bytes(raw)
        except ValueError:
            raise CorruptCheckpoint(f"{h5.uri}: legacy __spec__ is not hex-encoded") from None
        node = restricted_pickle.loads(payload, what=f"tree spec of {h5.uri}")
        if not isinstance(node, restricted_pickle.PickledTreeSpec):
            raise CorruptCheckpoint(f"{h5.uri}: legacy __spec__ does not hold a tree spec")
        self._spec: TreeSpec = node.to_tree_spec()
        cv = _str(h5.root_attr("__cstorch_version__"))
        self.cstorch_version = cv if isinstance(cv, str) else None
        self.release = release_of(self.cstorch_version, version)
        self._entries = self._load_entries()
        self._by_key = {e.key: e for e in self._entries}
        self.keys = set(self._by_key)

    # --- metadata ------------------------------------------------------------------------------

    def _load_entries(self) -> list[Entry]:
        keys = self._spec.keys()
        check_unique_keys(keys)
        entries: list[Entry] = []
        owners: dict[Any, str] = {}  # HDF5 object -> first key naming it (hard links = ties)
        for key in keys:
            name = quote(key, safe="")
            link = self.h5.file.get(name, getlink=True)
            if link is None:
                msg = f"{key!r} is in the tree spec but not in the file; it reads as None"
                log.warning(msg)
                self.warnings.append(msg)
                entries.append(Entry(key, "value", value=None, meta={"missing": True}))
                continue
            ds = self.h5.dataset(name, key)
            if ds in owners:
                entries.append(Entry(key, "link", target=owners[ds]))
                continue
            owners[ds] = key
            entries.append(self._entry(key, name, ds))
        return entries

    def _entry(self, key: str, name: str, ds: h5py.Dataset) -> Entry:
        h5type = _str(self.h5.attr(ds, "__H5_TYPE__"))
        meta: dict[str, Any] = {"dataset": name, "h5_type": h5type}
        if h5type is None:
            return self._flag_entry(key, name, ds, meta)
        if h5type in _NUMERIC:
            kind = "array" if h5type == "NumpyArrayH5Type" and self.version > 0.3 else "tensor"
            dtype, shape = self._numeric(key, ds)
            return Entry(key, kind, dtype, shape, meta=meta)
        if h5type == "ScalarH5Type":
            return Entry(key, "value", value=self._scalar(key, ds), meta=meta)
        if h5type == "StringH5Type":
            value = _str(self.h5.attr(ds, "string_value"))
            if not isinstance(value, str):
                raise CorruptCheckpoint(f"{key!r}: string entry without string_value")
            return Entry(key, "value", value=value, meta=meta)
        if h5type == "NoneH5Type":
            return Entry(key, "value", value=None, meta=meta)
        if h5type == "ObjectH5Type":
            hexed = _str(self.h5.attr(ds, "object_value"))
            if not isinstance(hexed, str):
                raise CorruptCheckpoint(f"{key!r}: object entry without object_value")
            return Entry(key, "object", meta={**meta, "nbytes": len(hexed) // 2})
        if h5type == "DeferredH5Tensor":
            if not _flag(self.h5, ds, "link_to_self"):
                raise UnsupportedFormat(
                    f"{key!r} refers to a tensor in another file ({_str(self.h5.attr(ds, 'filepath'))!r})",
                    hint="convert the checkpoint that holds the data, or copy it into this one with cstorch",
                    key=key,
                )
            target = _str(self.h5.attr(ds, "key"))
            if not isinstance(target, str):
                raise CorruptCheckpoint(f"{key!r}: deferred tensor without a key")
            inner_name = target if target in self.h5.file else quote(target, safe="")
            inner = self.h5.dataset(inner_name, key)
            dtype, shape = self._numeric(key, inner)
            return Entry(key, "tensor", dtype, shape, meta={**meta, "dataset": inner_name})
        if h5type in _FULL:
            return self._full_entry(key, ds, meta)
        if h5type in _EXTERNAL:
            raise UnsupportedFormat(
                f"{key!r} is a {h5type}: {_EXTERNAL[h5type]}, not data in this checkpoint",
                hint="materialize the checkpoint with cstorch (load it and save it again) before converting",
                key=key,
            )
        raise UnsupportedFormat(f"{key!r} has the unknown legacy type {h5type!r}", key=key)

    def _flag_entry(self, key: str, name: str, ds: h5py.Dataset, meta: dict[str, Any]) -> Entry:
        """Releases 1.7/1.8: the kind is told by flag attributes."""
        if self.h5.attr(ds, "filepath") is not None:
            raise UnsupportedFormat(
                f"{key!r} refers to a raw tensor file outside the checkpoint",
                hint="materialize the checkpoint with cstorch (load it and save it again) before converting",
                key=key,
            )
        if _flag(self.h5, ds, "is_constructible"):
            return self._full_entry(key, ds, meta)
        if _flag(self.h5, ds, "is_none"):
            return Entry(key, "value", value=None, meta=meta)
        if _flag(self.h5, ds, "is_string"):
            value = _str(self.h5.attr(ds, "string_val"))
            if not isinstance(value, str):
                raise CorruptCheckpoint(f"{key!r}: string entry without string_val")
            return Entry(key, "value", value=value, meta=meta)
        if _flag(self.h5, ds, "is_scalar"):
            return Entry(key, "value", value=self._scalar(key, ds), meta=meta)
        dtype, shape = self._numeric(key, ds)
        return Entry(key, "tensor", dtype, shape, meta=meta)

    def _numeric(self, key: str, ds: h5py.Dataset) -> tuple[str, tuple[int, ...]]:
        if ds.shape is None:
            raise CorruptCheckpoint(f"{key!r}: tensor dataset holds no array")
        if _flag(self.h5, ds, "is_bfloat16"):
            if ds.dtype.kind not in "iu" or ds.dtype.itemsize != 2:
                raise CorruptCheckpoint(f"{key!r}: bf16 tensor stored as {ds.dtype}, not 16-bit integers")
            return "bfloat16", tuple(ds.shape)
        name = numpy_dtype_name(ds.dtype)
        if name is None:
            raise UnsupportedDtype(f"{key!r} has dtype {ds.dtype}, which has no tensor equivalent", key=key)
        return name, tuple(ds.shape)

    def _scalar(self, key: str, ds: h5py.Dataset) -> Any:
        # A 0-d dataset of a few bytes: reading it is metadata-sized.
        if ds.shape != ():
            raise CorruptCheckpoint(f"{key!r}: scalar dataset has shape {ds.shape}")
        arr = self.h5.read_array(ds, key)
        if arr.dtype.kind not in "biuf":
            raise CorruptCheckpoint(f"{key!r}: scalar dataset of type {arr.dtype}")
        return _plain(arr[()])

    def _full_entry(self, key: str, ds: h5py.Dataset, meta: dict[str, Any]) -> Entry:
        shape = _shape(key, self.h5.attr(ds, "shape", ()))
        fill = _plain(_str(self.h5.attr(ds, "fill_value")))
        if isinstance(fill, np.ndarray):
            fill = _plain(fill.reshape(-1)[0]) if fill.size == 1 else None
        if fill is not None and not isinstance(fill, bool | int | float):
            raise CorruptCheckpoint(f"{key!r}: fill value {fill!r} is not a number")
        if _flag(self.h5, ds, "is_bfloat16"):
            dtype = "bfloat16"
        else:
            dtype = numpy_dtype_name(ds.dtype)
            if dtype is None:
                raise UnsupportedDtype(f"{key!r}: full tensor of dtype {ds.dtype}", key=key)
        return Entry(key, "tensor", dtype, shape, meta={**meta, "fill_value": fill})

    # --- protocol ------------------------------------------------------------------------------

    @property
    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format_version": self.version,
            "cstorch_version": self.cstorch_version,
            "release": self.release,
            "complete": None,  # legacy files carry no completion marker
        }
        if self.warnings:
            out["warnings"] = list(self.warnings)
        return out

    def read(self, key: str) -> Any:
        entry = follow_link(self._by_key, self._listed(key))
        if entry.kind == "value":
            return entry.value
        if "fill_value" in entry.meta:
            return full_tensor(entry)
        if entry.kind == "object":
            ds = self.h5.dataset(entry.meta["dataset"], entry.key)
            hexed = _str(self.h5.attr(ds, "object_value"))
            try:
                payload = bytes.fromhex(hexed)
            except (TypeError, ValueError):
                raise CorruptCheckpoint(f"{entry.key!r}: object_value is not hex") from None
            return decode_object(payload)
        ds = self.h5.dataset(entry.meta["dataset"], entry.key)
        return self.h5.read_tensor(ds, entry.key, entry.dtype, entry.shape)
