"""What the Cerebras containers (H5 file, S3 object-per-key layout) share beyond metadata.

:class:`CerebrasSink` does the protocol bookkeeping of both sinks: refusing what ``cstorch.save``
refuses (dtypes without an RtFx code, colliding keys), checking the call order, turning values
into metadata-only records or pickled objects, and producing the per-key records at commit. A
container only stores numeric arrays and object payloads (``_store_numeric``/``_store_object``).

The source side shares value decoding: object payloads through the restricted unpickler, full
tensors from their description, and the release name of a checkpoint.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from ckptconv.core.dtypes import is_float_dtype
from ckptconv.core.errors import CorruptCheckpoint, KeyCollision, UnsupportedDtype, UnsupportedValue
from ckptconv.core.releases import release_name
from ckptconv.formats import restricted_pickle
from ckptconv.formats.base import Entry, OpaqueObject, RawTensor, TensorSink, dtype_name, torch_dtype
from ckptconv.formats.cs_serializers import (
    ARRAY_DTYPES,
    DEFAULT_CSTORCH_VERSION,
    TENSOR_DTYPES,
    array_metadata,
    key_record_text,
    link_metadata,
    object_metadata,
    object_payload,
    stored_numpy_dtype,
    tensor_metadata,
    value_metadata,
)
from ckptconv.formats.links import link_root
from ckptconv.formats.tree import TreeSpec, flat_dict_spec

LEGACY_RELEASES = {0.1: "1.7", 0.2: "1.8", 0.3: "1.9", 0.4: "2.0"}


def _dtype_hint(dtype: str | None) -> str:
    if is_float_dtype(dtype):
        return f"cast it (--dtype bf16/fp16/fp32) or choose a target format that holds {dtype}"
    return (
        f"{dtype} tensors (e.g. quantized weights) stay in formats that hold them: convert to safetensors, "
        "torch or tf instead, or dequantize them before converting to a Cerebras checkpoint"
    )


def release_of(cstorch_version: Any, format_version: float | None) -> str | None:
    """``"2.10"`` from ``"2.10.0"``; without a cstorch version, the §0 map of format versions."""
    if isinstance(cstorch_version, str | bytes) and (name := release_name(cstorch_version)):
        return name
    if format_version is not None:
        for v, rel in LEGACY_RELEASES.items():
            if abs(format_version - v) < 1e-9:
                return rel
    return None


def decode_object(payload: bytes) -> OpaqueObject:
    """An object payload: decoded when it is plain data, else kept as bytes (never executed)."""
    ok, value = restricted_pickle.try_loads(payload)
    return OpaqueObject(payload, "dill", value if ok else None, ok)


def full_tensor(entry: Entry) -> Any:
    """A DeferredFullTensor: ``fill_value`` everywhere (None means uninitialized; we give zeros)."""
    import torch

    fill = entry.meta.get("fill_value")
    t = torch.zeros(entry.shape, dtype=torch_dtype(entry.dtype))
    if fill is not None:
        t.fill_(fill)
    return t


def cast_array(arr: np.ndarray, dtype: str) -> Any:
    """A stored array as a tensor of ``dtype``, as cstorch loads it (§1.7): a numpy value cast to
    the dtype's numpy type; bf16 is the reinterpretation of the values cast to int16."""
    import torch

    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    with np.errstate(all="ignore"):
        if dtype == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(arr.astype(np.int16))).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(arr.astype(np.dtype(stored_numpy_dtype(dtype)))))


def follow_link(by_key: dict[str, Entry], entry: Entry) -> Entry:
    """The entry a link (or chain of links) stands for; LinkCycle on a cycle, CorruptCheckpoint when
    the chain leads to a missing key."""
    if entry.kind != "link":
        return entry
    root = by_key.get(link_root(entry.target or "", by_key))
    if root is None:
        raise CorruptCheckpoint(f"{entry.key!r}: its link leads nowhere (a missing key)")
    return root


def needs_payload(e: Entry) -> bool:
    """Whether an entry stores bytes in the container (a dataset or an object), not metadata only."""
    if e.kind in ("tensor", "array", "object"):
        return True
    return e.kind == "value" and value_metadata(e.value) is None


class CerebrasSink(TensorSink):
    """Protocol bookkeeping shared by the Cerebras sinks (see the module docstring)."""

    supports_links = True
    supports_objects = True
    accepts_raw = True

    def __init__(self, storage: Any, uri: str, **options: Any) -> None:
        super().__init__(storage, uri, **options)
        self.cstorch_version = str(options.get("cstorch_version", DEFAULT_CSTORCH_VERSION))
        self._entries: list[Entry] = []
        self._spec: TreeSpec | None = None
        self._records: dict[str, dict[str, Any]] = {}
        self._todo: list[Entry] = []  # the entries write() stores, in order (every non-link)
        self._due: dict[str, Entry] = {}

    @classmethod
    def check(cls, entries: Any) -> None:
        entries = list(entries)
        super().check(entries)
        for e in entries:
            if e.kind == "tensor" and e.dtype not in TENSOR_DTYPES:
                raise UnsupportedDtype(
                    f"{e.key!r} is a {e.dtype} tensor; Cerebras checkpoints cannot hold {e.dtype} "
                    "(cstorch.save refuses it: no RtFx dtype)",
                    key=e.key,
                    dtype=e.dtype,
                    hint=_dtype_hint(e.dtype),
                )
            if e.kind == "array" and e.dtype not in ARRAY_DTYPES:
                raise UnsupportedDtype(
                    f"{e.key!r} is a {e.dtype} numpy array, which a Cerebras checkpoint cannot hold",
                    key=e.key,
                    dtype=e.dtype,
                )

    def _prepare(self, entries: list[Entry], spec: TreeSpec | None) -> TreeSpec:
        """Validate everything announced; remember it. Returns the spec to record."""
        entries = list(entries)
        spec = spec if spec is not None else flat_dict_spec([e.key for e in entries])
        self.check(entries)
        keys = [e.key for e in entries]
        seen: set[str] = set()
        for k in keys:
            if k in seen:
                raise KeyCollision(f"two entries have the same key {k!r}", key=k)
            seen.add(k)
        if spec.keys() != keys:
            raise UnsupportedValue("the tree spec's keys do not match the entries (same keys, same order)")
        position = {k: i for i, k in enumerate(keys)}
        by_key = {e.key: e for e in entries}
        for i, e in enumerate(entries):
            if e.kind != "link":
                continue
            if e.target not in by_key:
                raise UnsupportedValue(f"{e.key!r} links to {e.target!r}, which is not an entry", key=e.key)
            if by_key[e.target].kind == "link" or position[e.target] > i:
                raise UnsupportedValue(
                    f"{e.key!r} must link to the first occurrence of its value, not to {e.target!r}", key=e.key
                )
        for e in entries:
            if needs_payload(e) and any(part in ("", ".", "..") for part in e.key.split("/")):
                raise UnsupportedValue(
                    f"{e.key!r} cannot name stored data (empty, '.' or '..' path component)",
                    key=e.key,
                    hint="rename the key; '/' in a key makes nested names",
                )
        self._entries = entries
        self._spec = spec
        self._todo = [e for e in entries if e.kind != "link"]
        self._due = {e.key: e for e in self._todo}
        self._records = {}
        return spec

    def _write(self, key: str, value: Any) -> None:
        entry = self._due[key]
        if entry.kind in ("tensor", "array"):
            dtype, arr = self._numeric(entry, value)
            if entry.kind == "tensor":
                md = tensor_metadata(dtype, tuple(arr.shape))
            else:
                md = array_metadata(dtype == "bfloat16")
            self._records[key] = self._store_numeric(entry, md, arr)
        elif entry.kind == "object" or (entry.kind == "value" and value_metadata(value) is None):
            self._records[key] = self._store_object(key, object_metadata(), object_payload(key, value))
        elif entry.kind == "value":
            self._records[key] = value_metadata(value)  # type: ignore[assignment]
        else:
            raise UnsupportedValue(f"{key!r}: cannot write an entry of kind {entry.kind}", key=key)

    def _numeric(self, entry: Entry, value: Any) -> tuple[str, np.ndarray]:
        """The C-ordered on-disk array of a tensor (bf16 as its int16 bits)."""
        key = entry.key
        if isinstance(value, RawTensor):
            if value.dtype != entry.dtype or value.shape != tuple(entry.shape or ()):
                raise UnsupportedValue(
                    f"{key!r}: got a {value.dtype} tensor of shape {value.shape},"
                    f" announced {entry.dtype} {entry.shape}",
                    key=key,
                )
            self.check([entry])
            return value.dtype, value.data.view(np.dtype(stored_numpy_dtype(value.dtype))).reshape(value.shape)
        import torch

        if not isinstance(value, torch.Tensor):
            raise UnsupportedValue(f"{key!r}: expected a tensor, got {type(value).__name__}", key=key)
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        dtype = dtype_name(t.dtype)
        if dtype != entry.dtype or tuple(t.shape) != tuple(entry.shape or ()):
            raise UnsupportedValue(
                f"{key!r}: got a {dtype} tensor of shape {tuple(t.shape)}, announced {entry.dtype} {entry.shape}",
                key=key,
            )
        self.check([entry])
        t = t.contiguous()
        arr = (t.view(torch.int16) if dtype == "bfloat16" else t).numpy()
        return dtype, arr.view(np.dtype(stored_numpy_dtype(dtype)))

    def _record_texts(self) -> list[tuple[str, str]]:
        """``(attribute name, JSON text)`` of every per-key record, in entry order."""
        out = []
        for e in self._entries:
            md = link_metadata(e.target) if e.kind == "link" else self._records[e.key]  # type: ignore[arg-type]
            out.append((f"{e.key}.__metadata__", key_record_text(e.key, md)))
        return out

    @abc.abstractmethod
    def _store_numeric(self, entry: Entry, md: dict[str, Any], arr: np.ndarray) -> dict[str, Any]:
        """Store one numeric array; returns the metadata to record (``md`` plus container extras)."""

    @abc.abstractmethod
    def _store_object(self, key: str, md: dict[str, Any], payload: bytes) -> dict[str, Any]:
        """Store one pickled payload; returns the metadata to record."""
