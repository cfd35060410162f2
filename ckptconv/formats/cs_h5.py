"""Cerebras H5 checkpoints (``.mdl``): format 0.5 read and write, legacy 0.1-0.4 read.

Bit-compatible with ``cstorch.save`` / ``cstorch.load`` of cerebras-pytorch 2.10
(cs-checkpoint-format §1). Layout of a 0.5 file:

- root attributes: ``__spec__`` (JSON ``[skeleton, treespec]``), ``__version__`` 0.5,
  ``__cstorch_version__``, one ``<K>.__metadata__`` JSON record per flat key, ``__SUCCESS__``;
- one dataset per stored payload, named by its flat key (a ``/`` in a key makes groups): numeric
  datasets for tensors and numpy arrays (bf16 as int16 bits, bool as an int8 enum, LZ4 filter on
  every non-0-d dataset), empty datasets whose opaque ``__BYTES__`` attribute holds a dill pickle;
- scalars, strings, None and links live in their metadata record only.

Writing differs from ``cstorch.save`` in its layout, for speed. By default (the ``contiguous``
layout, local and S3 alike) every numeric dataset is stored uncompressed and unchunked, allocated
when the file is created, which ``cstorch.load`` and h5py read as well (§1.12): every dataset's
offset is known before the data arrives, so values are positioned writes (or parts of an S3
upload, or bytes written by several processes of a fan-out) and the output is the same bytes
however it was written. It gives up the LZ4 filter, rarely a gain on weights.

With ``compression="lz4"`` (the ``fast`` layout) tensors larger than ``small_tensor_bytes``
(1 MiB) are stored in C-contiguous slab chunks of about ``chunk_bytes`` (1 MiB) that ckptconv
LZ4-frames itself and hands to HDF5 whole, instead of h5py's automatic chunks (typically 64 KiB,
each through the filter pipeline); a chunk that LZ4 would not shrink is stored as a raw LZ4 block,
as the filter itself does; smaller tensors get exactly h5py's chunks. ``chunking="h5py"``
reproduces h5py's chunks for every dataset. Everything else (attribute names, HDF5 types and
dataspaces, filters, JSON text) matches the real writer.

This module reads (``CsH5Source``); the writer (``CsH5Sink``) is ``cs_h5_write``, re-exported here
so that the format registry names one module.
"""

from __future__ import annotations

import logging
from typing import Any

import h5py
import numpy as np

from ckptconv.core.errors import (
    CorruptCheckpoint,
    IncompleteCheckpoint,
    UnsupportedDtype,
)
from ckptconv.formats.base import Entry, Extent, TensorSource, check_bool_bytes
from ckptconv.formats.cs_base import decode_object, follow_link, full_tensor, release_of
from ckptconv.formats.cs_h5_io import H5File, damaged_as_corrupt
from ckptconv.formats.cs_h5_legacy import LegacyLayout
from ckptconv.formats.cs_h5_write import CsH5Sink
from ckptconv.formats.cs_serializers import (
    TORCH_TENSOR,
    Leaf,
    check_unique_keys,
    numpy_dtype_name,
    parse_dtype,
    parse_key_record,
    parse_root_spec,
)
from ckptconv.formats.links import refuse_link_cycles
from ckptconv.formats.sharding import Slot, read_neighbours, tensor_view
from ckptconv.formats.tree import TreeSpec

log = logging.getLogger(__name__)


def read_format_version(h5: H5File) -> float:
    raw = h5.root_attr("__version__")
    if raw is None:
        return 0.1  # 1.7 files carry no version (§0)
    try:
        arr = np.asarray(raw)
        if arr.dtype.kind not in "iuf" or arr.size != 1:
            raise TypeError
        return float(arr.reshape(()))
    except (TypeError, ValueError):
        raise CorruptCheckpoint(f"{h5.uri}: __version__ is {raw!r}, not a number") from None


def _text(raw: Any) -> Any:
    if isinstance(raw, np.ndarray) and raw.shape == ():
        raw = raw[()]
    return raw


class CsH5Source(TensorSource):
    """Reads a Cerebras H5 checkpoint of any format version (0.5 here, 0.1-0.4 via cs_h5_legacy).

    Options: ``allow_incomplete`` reads a 0.5 file that lacks ``__SUCCESS__`` (refused by default,
    as cstorch does); ``threads`` for chunk decoding.
    """

    format = "cs-h5"

    def __init__(self, storage: Any, uri: str, *, allow_incomplete: bool = False, threads: int = 2) -> None:
        super().__init__(storage, uri)
        # Tensors whose bytes are one plain range of the file, where the storage reads neighbouring
        # ranges together (see extent()).
        self._slots: dict[str, Slot] = {}
        self.h5 = H5File(storage, uri, threads=threads)
        self.learned(self.h5.info)
        try:
            with damaged_as_corrupt(uri):
                self.version = read_format_version(self.h5)
                self._legacy: Any = None
                if self.version < 0.5:
                    self._legacy = LegacyLayout(self.h5, self.version)
                    return
                success = self.h5.root_attr("__SUCCESS__")
                self.complete = bool(np.asarray(success).any()) if success is not None else False
                if not self.complete and not allow_incomplete:
                    raise IncompleteCheckpoint(
                        f"{uri} was not completely written: it has no true __SUCCESS__ attribute"
                    )
                raw_spec = _text(self.h5.root_attr("__spec__"))
                if raw_spec is None:
                    raise CorruptCheckpoint(f"{uri} has no __spec__ attribute")
                self._spec = parse_root_spec(raw_spec)
                self._entries = self._load_entries()
                # Contiguous datasets are byte ranges read without HDF5's lock, chunked ones by the
                # chunk reader's threads: several values may be read at once.
                self.read_parallelism = storage.read_parallelism
        except BaseException:
            self.h5.close()
            raise
        self._by_key = {e.key: e for e in self._entries}

    # --- metadata ------------------------------------------------------------------------------

    def _load_entries(self) -> list[Entry]:
        keys = self._spec.keys()
        check_unique_keys(keys)
        entries = []
        for key in keys:
            leaf = parse_key_record(key, _text(self.h5.root_attr(f"{key}.__metadata__")))
            entries.append(self._entry(leaf))
        known = set(keys)
        for e in entries:
            if e.kind == "link" and e.target not in known:
                raise CorruptCheckpoint(f"{e.key!r} links to {e.target!r}, which is not in the checkpoint")
        refuse_link_cycles(entries)
        return entries

    def _entry(self, leaf: Leaf) -> Entry:
        if leaf.full:
            return leaf.entry()
        if leaf.kind == "tensor":
            ds = self.h5.dataset(leaf.subkey or leaf.key, leaf.key)
            if ds.shape is None or tuple(ds.shape) != leaf.shape:
                raise CorruptCheckpoint(
                    f"{leaf.key!r}: dataset shape {ds.shape} disagrees with its metadata shape {leaf.shape}"
                )
            self._check_dataset_attrs(ds, leaf)
            if self.storage.coalesce_bytes:  # where neighbours are read together (object storage)
                span = self.h5.tensor_extent(ds, leaf.dtype, leaf.shape)
                if span is not None:
                    self._slots[leaf.key] = Slot(self.uri, *span, leaf.dtype, leaf.shape)
            return leaf.entry(dataset=ds.name)
        if leaf.kind == "array":
            ds = self.h5.dataset(leaf.subkey or leaf.key, leaf.key)
            if ds.shape is None:
                raise CorruptCheckpoint(f"{leaf.key!r}: numpy array dataset holds no array")
            bf16 = self.h5.attr(ds, "is_bfloat16", leaf.md.get("is_bfloat16", False))
            name = numpy_dtype_name(ds.dtype)
            if bool(bf16):
                if ds.dtype.kind not in "iu" or ds.dtype.itemsize != 2:
                    raise CorruptCheckpoint(f"{leaf.key!r}: bf16 array stored as {ds.dtype}, not 16-bit integers")
                name = "bfloat16"
            if name is None:
                raise UnsupportedDtype(
                    f"{leaf.key!r} is a numpy array of dtype {ds.dtype}, which has no tensor equivalent",
                    key=leaf.key,
                    dtype=str(ds.dtype),
                )
            leaf.dtype = name
            leaf.shape = tuple(ds.shape)
            return leaf.entry(dataset=ds.name)
        if leaf.kind == "object":
            ds = self.h5.dataset(leaf.subkey or leaf.key, leaf.key)
            try:
                aid = h5py.h5a.open(ds.id, b"__BYTES__")
                nbytes = aid.get_storage_size()
            except KeyError:
                raise CorruptCheckpoint(f"{leaf.key!r}: object dataset has no __BYTES__ attribute") from None
            return leaf.entry(dataset=ds.name, nbytes=nbytes)
        return leaf.entry()

    def _check_dataset_attrs(self, ds: h5py.Dataset, leaf: Leaf) -> None:
        # The real loader merges dataset attributes over the JSON record (dataset wins); a
        # disagreement means one of them is damaged.
        t = _text(self.h5.attr(ds, "__TYPE__"))
        if t is not None and (t.decode() if isinstance(t, bytes) else t) != TORCH_TENSOR:
            raise CorruptCheckpoint(f"{leaf.key!r}: dataset says {t!r} but its record says {TORCH_TENSOR}")
        dtypes = self.h5.attr(ds, "dtypes")
        if dtypes is not None:
            arr = np.asarray(dtypes).reshape(-1)
            if arr.size and parse_dtype(leaf.key, arr[0]) != leaf.dtype:
                raise CorruptCheckpoint(
                    f"{leaf.key!r}: dataset dtype attribute {arr[0]!r} disagrees with its record ({leaf.dtype})"
                )
        shapes = self.h5.attr(ds, "shapes")
        if shapes is not None:
            arr = np.asarray(shapes)
            if arr.ndim == 2 and arr.shape[0] >= 1 and tuple(int(d) for d in arr[0]) != leaf.shape:
                raise CorruptCheckpoint(f"{leaf.key!r}: dataset shapes attribute disagrees with its record")

    def entries(self) -> list[Entry]:
        if self._legacy is not None:
            return self._legacy.entries()
        return list(self._entries)

    @property
    def spec(self) -> TreeSpec | None:
        if self._legacy is not None:
            return self._legacy.spec
        return self._spec

    @property
    def info(self) -> dict[str, Any]:
        if self._legacy is not None:
            return self._legacy.info
        with damaged_as_corrupt(self.uri):
            cv = _text(self.h5.root_attr("__cstorch_version__"))
        if isinstance(cv, bytes):
            cv = cv.decode("utf-8", "replace")
        return {
            "format_version": self.version,
            "cstorch_version": cv,
            "release": release_of(cv, None),
            "complete": self.complete,
        }

    # --- data ----------------------------------------------------------------------------------

    def read(self, key: str) -> Any:
        if self._legacy is not None:
            if key not in self._legacy.keys:
                raise KeyError(key)
            with damaged_as_corrupt(self.uri):
                return self._legacy.read(key)
        entry = self._by_key.get(key)
        if entry is None:
            raise KeyError(key)
        with damaged_as_corrupt(self.uri):
            return self._read_entry(follow_link(self._by_key, entry))

    def _read_entry(self, entry: Entry) -> Any:
        if entry.kind == "value":
            return entry.value
        if "fill_value" in entry.meta:
            return full_tensor(entry)
        ds = self.h5.dataset(entry.meta["dataset"], entry.key)
        if entry.kind == "tensor":
            return self.h5.read_tensor(ds, entry.key, entry.dtype, entry.shape, raw=self.raw_reads)
        if entry.kind == "array":
            import torch

            arr = self.h5.read_array(ds, entry.key)
            if entry.dtype == "bfloat16":
                return torch.from_numpy(np.ascontiguousarray(arr.astype(np.int16))).view(torch.bfloat16)
            return torch.from_numpy(arr)
        if entry.kind == "object":
            return decode_object(self.h5.read_opaque(ds, "__BYTES__", entry.key))
        raise CorruptCheckpoint(f"{entry.key!r}: unknown entry kind {entry.kind}")

    def extent(self, key: str) -> Extent | None:
        # Links and fill values have none: a link's bytes are its target's, read under that key.
        slot = self._slots.get(key)
        return None if slot is None else Extent(slot.uri, slot.offset, slot.nbytes)

    def read_neighbours(self, keys: list[str]) -> list[Any]:
        slots = [self._slots.get(k) for k in keys]
        if not keys or not all(slots):
            return super().read_neighbours(keys)
        values = read_neighbours(self.storage, slots, raw=self.raw_reads)
        for slot, key, value in zip(slots, keys, values, strict=True):
            check_bool_bytes(key, slot.dtype, tensor_view(value))
        return values

    def close(self) -> None:
        self.h5.close()


# The format registry names this module for both directions; the writer lives beside it.
__all__ = ["CsH5Sink", "CsH5Source"]
