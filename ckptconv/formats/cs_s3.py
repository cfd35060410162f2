"""Cerebras object-per-key checkpoints under an S3 prefix (cs-checkpoint-format §3), read and write.

``cstorch.save(state, "s3://bucket/prefix")`` stores the same metadata as an H5 file, with one
object per stored payload instead of datasets:

- ``<prefix>/__METADATA__``: a pickle (dill, protocol 4) of the dict of root attributes
  (``__spec__``, ``__version__``, ``__cstorch_version__``, every ``<K>.__metadata__`` JSON record,
  ``__SUCCESS__``), written first without the records and rewritten at the end with them;
- ``<prefix>/<subkey>``: the raw C-order bytes of an array (bf16 as int16 bits) or the dill bytes
  of an object, zstandard-compressed when the metadata says ``compressed``; its S3 user metadata
  ``metadata`` holds the entry's metadata JSON, extended with ``__NUMPY__`` =
  ``{"shape", "dtype"}``, ``data_sizes`` (raw length) and ``boundaries`` (stored length). The
  same extended dict is in the key's record in ``__METADATA__``, so reading needs only that.

``__METADATA__`` is read with the restricted unpickler and written with the standard pickle
module (protocol 4 of plain str/float/bool values: the bytes dill writes for the same dict). The
layout also works on local directories (minus S3 user metadata), which tests and offline copies
use. There is no atomic rename on S3: a reader tells a finished checkpoint by ``__SUCCESS__``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptconv.core.bounded import load_json
from ckptconv.core.errors import (
    CorruptCheckpoint,
    IncompleteCheckpoint,
    ObjectNotFound,
    TargetExists,
    UnsupportedDtype,
    UnsupportedFormat,
)
from ckptconv.formats import restricted_pickle
from ckptconv.formats.base import Entry, OutputFile, TensorSource, check_bool_bytes
from ckptconv.formats.cs_base import CerebrasSink, cast_array, decode_object, follow_link, full_tensor, release_of
from ckptconv.formats.cs_serializers import (
    FORMAT_VERSION,
    array_metadata,
    check_unique_keys,
    numpy_dtype_name,
    parse_key_record,
    parse_root_spec,
    root_spec_text,
    stored_numpy_dtype,
    tensor_metadata,
)
from ckptconv.formats.layout import FileLayout, Span
from ckptconv.formats.links import refuse_link_cycles
from ckptconv.formats.listed_entries import ListedEntries
from ckptconv.formats.memory import empty_tensor
from ckptconv.formats.sharding import create_local_skeletons
from ckptconv.formats.tree import TreeSpec
from ckptconv.storage.digests import hex_digest

log = logging.getLogger(__name__)

METADATA = "__METADATA__"
MAX_METADATA_BYTES = 256 << 20  # a pickle of JSON records; anything bigger is not a checkpoint
USER_METADATA_LIMIT = 1800  # S3 allows 2 KiB of user metadata per object, keys included
_RANGE = 16 << 20


def _numpy_info(key: str, md: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype] | None:
    info = md.get("__NUMPY__")
    if not isinstance(info, dict):
        return None
    shape, dt = info.get("shape"), info.get("dtype")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CorruptCheckpoint(f"{key!r}: __NUMPY__ shape {shape!r} is not a list of sizes")
    try:
        dtype = np.dtype(dt)
    except TypeError:
        raise CorruptCheckpoint(f"{key!r}: __NUMPY__ dtype {dt!r} is not a numpy dtype") from None
    if dtype.hasobject or dtype.kind not in "biufc":
        raise CorruptCheckpoint(f"{key!r}: __NUMPY__ dtype {dt!r} is not numeric")
    return tuple(shape), dtype


def _first_int(md: dict[str, Any], name: str) -> int | None:
    v = md.get(name)
    if isinstance(v, list) and v and isinstance(v[0], int) and not isinstance(v[0], bool) and v[0] >= 0:
        return v[0]
    return None


class CsS3Source(ListedEntries, TensorSource):
    """Reads a Cerebras object-per-key checkpoint (S3 prefix or local directory).

    Options: ``allow_incomplete`` (read without ``__SUCCESS__``), ``threads`` (parallel ranged
    reads of one object).
    """

    format = "cs-s3"

    def __init__(self, storage: Any, uri: str, *, allow_incomplete: bool = False, threads: int = 4) -> None:
        super().__init__(storage, uri)
        self.prefix = uri.rstrip("/")
        self.threads = max(1, threads)
        self._meta_uri = storage.join(self.prefix, METADATA)
        try:
            size = storage.stat(self._meta_uri).size
        except ObjectNotFound:
            raise ObjectNotFound(
                f"{uri} has no {METADATA} object: not a Cerebras object-per-key checkpoint",
                hint="check the prefix (it names the checkpoint, without a trailing file name)",
            ) from None
        if size > MAX_METADATA_BYTES:
            raise CorruptCheckpoint(f"{self._meta_uri} is {size} bytes, far beyond any real metadata object")
        attrs = restricted_pickle.loads(storage.read_all(self._meta_uri), what=f"{METADATA} of {uri}")
        if not isinstance(attrs, dict) or not all(isinstance(k, str) for k in attrs):
            raise CorruptCheckpoint(f"{self._meta_uri} does not hold a dict of root attributes")
        self._attrs = attrs
        version = attrs.get("__version__")
        if isinstance(version, bool) or not isinstance(version, int | float):
            raise CorruptCheckpoint(f"{self._meta_uri}: __version__ is {version!r}, not a number")
        if version < 0.5:
            raise UnsupportedFormat(f"{uri}: object-per-key checkpoints of format {version} do not exist")
        self.version = float(version)
        self.complete = bool(attrs.get("__SUCCESS__"))
        if not self.complete and not allow_incomplete:
            raise IncompleteCheckpoint(f"{uri} was not completely written: its {METADATA} has no true __SUCCESS__")
        raw_spec = attrs.get("__spec__")
        if raw_spec is None:
            raise CorruptCheckpoint(f"{self._meta_uri} has no __spec__")
        self._spec = parse_root_spec(raw_spec)
        keys = self._spec.keys()
        check_unique_keys(keys)
        self._entries = [self._entry(parse_key_record(key, attrs.get(f"{key}.__metadata__"))) for key in keys]
        self._by_key = {e.key: e for e in self._entries}
        for e in self._entries:
            if e.kind == "link" and e.target not in self._by_key:
                raise CorruptCheckpoint(f"{e.key!r} links to {e.target!r}, which is not in the checkpoint")
        refuse_link_cycles(self._entries)
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="cs-s3") if threads > 1 else None

    def _entry(self, leaf: Any) -> Entry:
        if leaf.full or leaf.kind not in ("tensor", "array", "object"):
            return leaf.entry()
        obj = self.storage.join(self.prefix, leaf.subkey or leaf.key)
        md = dict(leaf.md)
        compressed = bool(md.get("compressed"))
        meta: dict[str, Any] = {"object": obj, "compressed": compressed}
        if leaf.kind == "object":
            return leaf.entry(**meta, nbytes=_first_int(md, "data_sizes") or 0)
        info = _numpy_info(leaf.key, md) or _numpy_info(leaf.key, self._user_metadata(obj, leaf.key))
        if leaf.kind == "tensor":
            on_disk = info[1] if info else np.dtype(stored_numpy_dtype(leaf.dtype))
            if info and info[0] != leaf.shape:
                raise CorruptCheckpoint(
                    f"{leaf.key!r}: stored shape {info[0]} disagrees with its metadata {leaf.shape}"
                )
        else:
            if info is None:
                raise CorruptCheckpoint(f"{leaf.key!r}: numpy array without shape and dtype (__NUMPY__)")
            on_disk = info[1]
            name = "bfloat16" if md.get("is_bfloat16") else numpy_dtype_name(on_disk)
            if name is None:
                raise UnsupportedDtype(f"{leaf.key!r}: numpy array of dtype {on_disk}", key=leaf.key)
            leaf.dtype, leaf.shape = name, info[0]
        raw = math.prod(leaf.shape) * on_disk.itemsize
        sizes = _first_int(md, "data_sizes")
        if sizes is not None and sizes != raw:
            raise CorruptCheckpoint(f"{leaf.key!r}: data_sizes says {sizes} bytes, its shape and dtype say {raw}")
        return leaf.entry(**meta, on_disk=on_disk.str, nbytes_raw=raw, stored=_first_int(md, "boundaries"))

    def _user_metadata(self, uri: str, key: str) -> dict[str, Any]:
        """The object's S3 user metadata JSON (``metadata`` or ``Metadata``), when the storage has any."""
        getter = getattr(self.storage, "user_metadata", None)
        if getter is None:
            return {}
        try:
            meta = getter(uri)
        except ObjectNotFound:
            raise CorruptCheckpoint(f"{key!r}: its object {uri} is missing") from None
        text = meta.get("metadata") or meta.get("Metadata")
        if not text:
            return {}
        out = load_json(text, what=f"{key!r}: the user metadata of {uri}")
        return out if isinstance(out, dict) else {}

    # --- protocol ------------------------------------------------------------------------------

    @property
    def info(self) -> dict[str, Any]:
        cv = self._attrs.get("__cstorch_version__")
        cv = cv if isinstance(cv, str) else None
        return {
            "format_version": self.version,
            "cstorch_version": cv,
            "release": release_of(cv, None),
            "complete": self.complete,
        }

    def files(self) -> list[str]:
        return [self._meta_uri, *(e.meta["object"] for e in self._entries if "object" in e.meta)]

    def read(self, key: str) -> Any:
        entry = follow_link(self._by_key, self._listed(key))
        if entry.kind == "value":
            return entry.value
        if "fill_value" in entry.meta:
            return full_tensor(entry)
        if entry.kind == "object":
            return decode_object(self._read_payload(entry))
        return self._read_numeric(entry)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # --- data ----------------------------------------------------------------------------------

    def _stored_size(self, entry: Entry) -> int:
        uri = entry.meta["object"]
        try:
            size = self.storage.stat(uri).size
        except ObjectNotFound:
            raise CorruptCheckpoint(f"{entry.key!r}: its object {uri} is missing") from None
        expected = entry.meta.get("stored")
        if expected is not None and expected != size:
            raise CorruptCheckpoint(f"{entry.key!r}: object {uri} has {size} bytes, its metadata says {expected}")
        return size

    def _read_payload(self, entry: Entry) -> bytes:
        size = self._stored_size(entry)
        data = self.storage.read_range(entry.meta["object"], 0, size)
        if entry.meta.get("compressed"):
            limit = entry.meta.get("nbytes") or None
            data = _zstd_decompress(data, limit, entry.key)
        return data

    def _read_numeric(self, entry: Entry) -> Any:
        import torch

        on_disk = np.dtype(entry.meta["on_disk"])
        want = np.dtype(stored_numpy_dtype(entry.dtype))
        direct = on_disk == want or (entry.dtype == "bfloat16" and on_disk == np.dtype("<u2"))
        n = entry.meta["nbytes_raw"]
        if direct:
            t = empty_tensor(entry.shape, entry.dtype)
            dest = (t.view(torch.int16) if entry.dtype == "bfloat16" else t).numpy().reshape(-1).view(np.uint8)
        else:
            arr = np.empty(entry.shape, dtype=on_disk)
            dest = arr.reshape(-1).view(np.uint8)
        self._fill(entry, memoryview(dest), n)
        if direct:
            check_bool_bytes(entry.key, entry.dtype, dest)
            return t
        return cast_array(arr, entry.dtype)

    def _fill(self, entry: Entry, dest: memoryview, n: int) -> None:
        uri = entry.meta["object"]
        size = self._stored_size(entry)
        if entry.meta.get("compressed"):
            _zstd_into(self.storage, uri, size, dest, entry.key)
            return
        if size != n:
            raise CorruptCheckpoint(f"{entry.key!r}: object {uri} has {size} bytes, expected {n}")
        if n == 0:
            return
        path = self.storage.local_path(uri)
        if path is not None:
            fd = os.open(path, os.O_RDONLY)
            try:
                if os.preadv(fd, [dest], 0) != n:
                    raise CorruptCheckpoint(f"{entry.key!r}: {uri} is truncated")
            finally:
                os.close(fd)
            return

        def piece(start: int) -> None:
            length = min(_RANGE, n - start)
            self.storage.read_into(uri, start, dest[start : start + length])

        starts = range(0, n, _RANGE)
        if self._pool is None or len(starts) == 1:
            for s in starts:
                piece(s)
        else:
            for f in [self._pool.submit(piece, s) for s in starts]:
                f.result()


def _zstd_decompress(data: bytes, limit: int | None, key: str) -> bytes:
    import zstandard

    try:
        out = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    except zstandard.ZstdError as e:
        raise CorruptCheckpoint(f"{key!r}: zstd payload does not decode ({e})") from None
    if limit and len(out) != limit:
        raise CorruptCheckpoint(f"{key!r}: zstd payload decodes to {len(out)} bytes, expected {limit}")
    return out


def _zstd_into(storage: Any, uri: str, size: int, dest: memoryview, key: str) -> None:
    """Stream-decompress an object into ``dest``; memory stays at one compressed range plus its output."""
    import zstandard

    dobj = zstandard.ZstdDecompressor().decompressobj()
    pos = 0
    try:
        for start in range(0, size, _RANGE):
            out = dobj.decompress(storage.read_range(uri, start, min(_RANGE, size - start)))
            if pos + len(out) > len(dest):
                raise CorruptCheckpoint(f"{key!r}: zstd payload decodes to more than {len(dest)} bytes")
            dest[pos : pos + len(out)] = out
            pos += len(out)
    except zstandard.ZstdError as e:
        raise CorruptCheckpoint(f"{key!r}: zstd payload does not decode ({e})") from None
    if pos != len(dest) or not dobj.eof:
        raise CorruptCheckpoint(f"{key!r}: zstd payload decodes to {pos} bytes, expected {len(dest)}")


class CsS3Sink(CerebrasSink):
    """Writes a Cerebras object-per-key checkpoint under a prefix (S3 or a local directory).

    Options: ``compress`` (False; zstd every payload and mark it ``compressed``, as cstorch's
    ``compress_weights``), ``zstd_level`` (3), ``cstorch_version`` ("2.10.0").

    As with ``cstorch.save``, objects appear under the prefix while writing; the checkpoint counts
    as written only once ``__METADATA__`` carries ``__SUCCESS__`` (written by ``commit``, last).
    ``abort`` deletes everything under the prefix (which ``begin`` required to be empty).

    ``skeleton`` (ckptconv.engine.fanout): every uncompressed, non-empty tensor's object is a file
    of one span that other processes write (with its user metadata); the other objects and the
    final ``__METADATA__`` are written whole by ``finish_skeleton``.
    """

    format = "cs-s3"

    def __init__(self, storage: Any, uri: str, **options: Any) -> None:
        super().__init__(storage, uri, **options)
        self.prefix = uri.rstrip("/")
        self.compress = bool(options.get("compress", False))
        self.zstd_level = int(options.get("zstd_level", 3))
        self._outputs: list[OutputFile] = []
        self._started = False
        self._root: dict[str, Any] = {}
        self.skeleton = bool(options.get("skeleton", False))
        self._laid_out: list[FileLayout] = []
        self._skeletons: list[str] = []  # preallocated local files (abort removes them with the prefix)

    def _begin(self, entries: list[Entry], spec: TreeSpec | None) -> None:
        spec = self._prepare(entries, spec)
        if self.storage.exists(self.prefix) or any(True for _ in self.storage.list(self.prefix + "/")):
            raise TargetExists(f"{self.uri} already exists (there are objects under it)")
        self._root = {
            "__spec__": root_spec_text(spec),
            "__version__": FORMAT_VERSION,
            "__cstorch_version__": self.cstorch_version,
        }
        self._started = True
        if not self.skeleton:  # a skeleton's __METADATA__ is written once, complete (finish_skeleton)
            self._put(
                self.storage.join(self.prefix, METADATA), pickle.dumps(self._root, protocol=4), None, overwrite=False
            )

    def _user_metadata(self, uri: str, user_md: dict[str, Any] | None) -> dict[str, str] | None:
        if user_md is None or getattr(self.storage, "scheme", "") != "s3":
            return None
        text = json.dumps(user_md)
        if len(text) > USER_METADATA_LIMIT:  # __METADATA__ carries the same record; S3 allows 2 KiB
            log.debug("metadata of %s exceeds S3's user metadata limit; kept in __METADATA__ only", uri)
            return None
        return {"metadata": text}

    def _put(self, uri: str, data: Any, user_md: dict[str, Any] | None, *, overwrite: bool = False) -> int:
        kwargs: dict[str, Any] = {"overwrite": overwrite}
        metadata = self._user_metadata(uri, user_md)
        if metadata is not None:
            kwargs["metadata"] = metadata
        view = memoryview(data).cast("B")
        with self.storage.open_writer(uri, **kwargs) as w:
            for start in range(0, len(view), _RANGE):
                w.write(view[start : start + _RANGE])
        return len(view)

    def _payload(self, raw: memoryview) -> Any:
        if not self.compress:
            return raw
        import zstandard

        return zstandard.ZstdCompressor(level=self.zstd_level).compress(raw)

    def _store_numeric(self, entry: Entry, md: dict[str, Any], arr: np.ndarray) -> dict[str, Any]:
        raw = memoryview(arr.reshape(-1).view(np.uint8))
        data = self._payload(raw)
        out = dict(md)
        out["__NUMPY__"] = {"shape": list(arr.shape), "dtype": str(arr.dtype)}
        out["compressed"] = self.compress
        out["data_sizes"] = [len(raw)]
        out["boundaries"] = [len(data)]
        return self._upload(entry.key, data, out)

    def _store_object(self, key: str, md: dict[str, Any], payload: bytes) -> dict[str, Any]:
        data = self._payload(memoryview(payload))
        out = dict(md)
        out["compressed"] = self.compress
        out["data_sizes"] = [len(payload)]
        out["boundaries"] = [len(data)]
        return self._upload(key, data, out)

    def _upload(self, key: str, data: Any, md: dict[str, Any]) -> dict[str, Any]:
        uri = self.storage.join(self.prefix, key)
        size = self._put(uri, data, md)
        digest = hex_digest(data) if self.skeleton else None  # a side file of the fan-out
        self._outputs.append(OutputFile(uri, size, digest, "data"))
        return md

    # --- the layout, for outputs written by several processes (ckptconv.engine.fanout) --------------

    def placed_keys(self) -> set[str]:
        """Tensors and arrays stored raw (uncompressed, at least one byte): an object of one span."""
        if not self.skeleton or self.compress:
            return set()
        return {e.key for e in self._todo if e.kind in ("tensor", "array") and e.nbytes > 0}

    def _reserve(self, key: str) -> None:
        entry = self._due[key]
        self.check([entry])
        dtype, shape = str(entry.dtype), tuple(entry.shape or ())
        md = tensor_metadata(dtype, shape) if entry.kind == "tensor" else array_metadata(dtype == "bfloat16")
        md["__NUMPY__"] = {"shape": list(shape), "dtype": str(np.dtype(stored_numpy_dtype(dtype)))}
        md["compressed"] = False
        md["data_sizes"] = [entry.nbytes]
        md["boundaries"] = [entry.nbytes]
        self._records[key] = md
        uri = self.storage.join(self.prefix, key)
        self._laid_out.append(
            FileLayout(uri, entry.nbytes, [Span(key, key, 0, entry.nbytes)], metadata=self._user_metadata(uri, md))
        )

    def _finish_skeleton(self) -> list[tuple[FileLayout, bytes]]:
        """The reserved objects' layouts (no gaps), created preallocated on local storage; the other
        objects were written whole, and ``__METADATA__``, complete, is written now."""
        try:
            create_local_skeletons(self.storage, self._laid_out, [b""] * len(self._laid_out), self._skeletons)
            root = dict(self._root)
            for name, text in self._record_texts():
                root[name] = text
            root["__SUCCESS__"] = True
            data = pickle.dumps(root, protocol=4)
            meta_uri = self.storage.join(self.prefix, METADATA)
            self._put(meta_uri, data, None)
        except BaseException:
            self.abort()
            raise
        self._outputs.append(OutputFile(meta_uri, len(data), hex_digest(data), "index"))
        self._started = False
        return [(f, b"") for f in self._laid_out]

    def side_files(self) -> list[OutputFile]:
        return list(self._outputs)

    def _commit(self) -> list[OutputFile]:
        root = dict(self._root)
        for name, text in self._record_texts():
            root[name] = text
        root["__SUCCESS__"] = True
        meta_uri = self.storage.join(self.prefix, METADATA)
        size = self._put(meta_uri, pickle.dumps(root, protocol=4), None, overwrite=True)
        self._started = False
        return [*self._outputs, OutputFile(meta_uri, size, None, "index")]

    def _abort(self) -> None:
        if self._started:
            self.storage.delete_prefix(self.prefix + "/")
            self._started = False
        self._outputs = []


__all__ = ["CsS3Sink", "CsS3Source"]
