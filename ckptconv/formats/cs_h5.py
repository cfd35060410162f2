"""Cerebras H5 checkpoints (``.mdl``): format 0.5 read and write, legacy 0.1-0.4 read.

Bit-compatible with ``cstorch.save`` / ``cstorch.load`` of cerebras-pytorch 2.10
(cs-checkpoint-format §1). Layout of a 0.5 file:

- root attributes: ``__spec__`` (JSON ``[skeleton, treespec]``), ``__version__`` 0.5,
  ``__cstorch_version__``, one ``<K>.__metadata__`` JSON record per flat key, ``__SUCCESS__``;
- one dataset per stored payload, named by its flat key (a ``/`` in a key makes groups): numeric
  datasets for tensors and numpy arrays (bf16 as int16 bits, bool as an int8 enum, LZ4 filter on
  every non-0-d dataset), empty datasets whose opaque ``__BYTES__`` attribute holds a dill pickle;
- scalars, strings, None and links live in their metadata record only.

Writing differs from ``cstorch.save`` in one deliberate way, for speed: tensors larger than
``small_tensor_bytes`` (1 MiB) are stored in C-contiguous slab chunks of about ``chunk_bytes``
(1 MiB) that ckptconv LZ4-frames itself and hands to HDF5 whole, instead of h5py's automatic
chunks (typically 64 KiB, each through the filter pipeline); a chunk that LZ4 would not shrink is
stored as a raw LZ4 block, as the filter itself does. The real loader reads any chunking (§1.12;
the oracle tests load such files with cstorch 2.10); ``chunking="h5py"`` reproduces h5py's chunks
for every dataset. Everything else (attribute names, HDF5 types and dataspaces, filters, JSON
text) matches the real writer, and small tensors get exactly h5py's chunks.

The ``contiguous`` layout (the default for S3 targets) stores every dataset uncompressed and
unchunked, which ``cstorch.load`` and h5py read as well; it trades the LZ4 filter (rarely a gain
on weights) for knowing every dataset's offset before the data arrives.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import h5py
import hdf5plugin
import numpy as np

from ckptconv.core.errors import (
    CorruptCheckpoint,
    IncompleteCheckpoint,
    KeyCollision,
    SinkProtocolError,
    TargetExists,
    UnsupportedDtype,
)
from ckptconv.formats.base import Entry, OutputFile, TensorSource
from ckptconv.formats.cs_base import CerebrasSink, decode_object, follow_link, full_tensor, needs_payload, release_of
from ckptconv.formats.cs_h5_chunks import DEFAULT_CHUNK_BYTES, LZ4_FILTER_ID, ChunkWriter, slab_chunk_shape
from ckptconv.formats.cs_h5_contiguous import (
    META_BLOCK_BASE,
    META_BLOCK_MAX,
    META_BYTES_PER_DATASET,
    LocalPlacement,
    Region,
    SkeletonOnly,
    StreamedPlacement,
    create_contiguous,
    region_of,
)
from ckptconv.formats.cs_h5_io import H5File, damaged_as_corrupt
from ckptconv.formats.cs_h5_legacy import LegacyLayout
from ckptconv.formats.cs_serializers import (
    FORMAT_VERSION,
    TORCH_TENSOR,
    Leaf,
    array_metadata,
    check_unique_keys,
    numpy_dtype_name,
    parse_dtype,
    parse_key_record,
    parse_root_spec,
    root_spec_text,
    stored_numpy_dtype,
    tensor_metadata,
)
from ckptconv.formats.layout import FileLayout, Span, gap_bytes
from ckptconv.formats.tree import TreeSpec
from ckptconv.storage import scratch
from ckptconv.storage.base import read_blocks
from ckptconv.storage.local import ensure_parent_dir
from ckptconv.storage.part_upload import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, PartUpload

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
        self.h5 = H5File(storage, uri, threads=threads)
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
        import torch

        if entry.kind == "value":
            return entry.value
        if "fill_value" in entry.meta:
            return full_tensor(entry)
        ds = self.h5.dataset(entry.meta["dataset"], entry.key)
        if entry.kind == "tensor":
            return self.h5.read_tensor(ds, entry.key, entry.dtype, entry.shape)
        if entry.kind == "array":
            arr = self.h5.read_array(ds, entry.key)
            if entry.dtype == "bfloat16":
                return torch.from_numpy(np.ascontiguousarray(arr.astype(np.int16))).view(torch.bfloat16)
            return torch.from_numpy(arr)
        if entry.kind == "object":
            return decode_object(self.h5.read_opaque(ds, "__BYTES__", entry.key))
        raise CorruptCheckpoint(f"{entry.key!r}: unknown entry kind {entry.kind}")

    def close(self) -> None:
        self.h5.close()


# --- writing --------------------------------------------------------------------------------------


class CsH5Sink(CerebrasSink):
    """Writes a Cerebras H5 checkpoint, format 0.5, that ``cstorch.load`` 2.10 reads.

    Options:
    - ``chunking``: ``"fast"`` (default for local targets; large slab chunks for tensors over
      ``small_tensor_bytes``), ``"h5py"`` (h5py's automatic chunks for every dataset, as cstorch
      writes them; slower) or ``"contiguous"`` (default for S3 targets: uncompressed contiguous
      datasets allocated up front, see :mod:`ckptconv.formats.cs_h5_contiguous`; an S3 target is
      then streamed as a multipart upload without a local copy, while the chunked layouts build
      the whole file on local disk first and upload it at commit);
    - ``part_size`` (16 MiB) and ``concurrency`` (4 parts in flight): the streamed upload;
    - ``chunk_bytes`` (1 MiB), ``small_tensor_bytes`` (1 MiB), ``threads`` (2): the fast path;
    - ``lz4``: ``"auto"`` (default: compress a large chunk only when samples of it compress, since
      weights seldom do), ``"always"`` (every chunk, as the HDF5 filter does) or ``"never"``;
      chunks that are not compressed are stored as raw LZ4 blocks, which every reader accepts;
    - ``cstorch_version`` recorded in ``__cstorch_version__`` (default "2.10.0");
    - ``fsync`` (True): flush the file to disk before publishing it.

    The file is written to ``{target}.{8 hex}.tmp`` beside a local target (a temporary directory
    for a remote one: the whole file for the chunked layouts, uploaded on commit; only the
    metadata skeleton for the contiguous layout) and published only by ``commit``.
    """

    format = "cs-h5"

    def __init__(self, storage: Any, uri: str, **options: Any) -> None:
        super().__init__(storage, uri, **options)
        remote = storage.local_path(uri) is None
        # Only the metadata (a skeleton): the datasets' bytes are written by other processes.
        self.skeleton = bool(options.get("skeleton", False))
        self.chunking = (
            "contiguous" if self.skeleton else options.get("chunking") or ("contiguous" if remote else "fast")
        )
        if self.chunking not in ("fast", "h5py", "contiguous"):
            raise ValueError(f"chunking must be 'fast', 'h5py' or 'contiguous', not {self.chunking!r}")
        self.part_size = int(options.get("part_size", DEFAULT_PART_SIZE))
        self.concurrency = int(options.get("concurrency", DEFAULT_CONCURRENCY))
        self._regions: dict[str, Region] = {}
        self._placement: LocalPlacement | StreamedPlacement | None = None
        self.chunk_bytes = int(options.get("chunk_bytes", DEFAULT_CHUNK_BYTES))
        self.small_tensor_bytes = int(options.get("small_tensor_bytes", 1 << 20))
        self.threads = int(options.get("threads", 2))
        self.fsync = bool(options.get("fsync", True))
        self.lz4 = str(options.get("lz4", "auto"))
        self._file: h5py.File | None = None
        self._tmp_path: str | None = None
        self._tmp_dir: str | None = None
        self._writer: ChunkWriter | None = None
        self._h5: ThreadPoolExecutor | None = None

    def _on_h5_thread(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` on the sink's own HDF5 thread and wait for it.

        Why a thread: HDF5 keeps many small long-lived allocations (its metadata cache). Made from
        the caller's thread they land in the same malloc arena as the tensors flowing through,
        pin its top, and the freed tensors' memory can no longer be reused or returned: peak RSS
        grew by hundreds of MB over a 1 GB checkpoint. From a thread of their own they live in
        another arena.
        """
        if self._h5 is None:
            self._h5 = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cs-h5")
        return self._h5.submit(fn, *args).result()

    # --- protocol ------------------------------------------------------------------------------

    def _begin(self, entries: list[Entry], spec: TreeSpec | None) -> None:
        spec = self._prepare(entries, spec)
        # Datasets live at their key's path: "a" as a dataset and "a/b" would need "a" to be a group.
        paths = {e.key for e in self._entries if needs_payload(e)}
        for p in sorted(paths):
            parts = p.split("/")
            for n in range(1, len(parts)):
                prefix = "/".join(parts[:n])
                if prefix in paths:
                    raise KeyCollision(f"{prefix!r} and {p!r} cannot both be stored: HDF5 needs {prefix!r} as a group")
        if self.storage.exists(self.uri):
            raise TargetExists(f"{self.uri} already exists")
        local = self.storage.local_path(self.uri)
        if local is not None:
            ensure_parent_dir(str(local))
            self._tmp_path = f"{local}.{uuid.uuid4().hex[:8]}.tmp"
        else:
            # Remote target: build the file in a scratch directory of this process, upload it at commit.
            self._tmp_dir = str(scratch.make_dir("h5"))
            self._tmp_path = os.path.join(self._tmp_dir, "checkpoint.mdl")
        # A sink dropped without commit() or abort() (or an interpreter exiting) still cleans up.
        self._finalizer = weakref.finalize(self, _remove_temp, self._tmp_path, self._tmp_dir)
        self._on_h5_thread(self._create, root_spec_text(spec))
        if self.chunking == "contiguous":
            self._regions = self._on_h5_thread(self._allocate)
            if self.skeleton:
                self._placement = SkeletonOnly()
            elif self._tmp_dir is None:
                self._placement = LocalPlacement(self._tmp_path)
            else:
                upload = PartUpload(
                    self.storage.backend(self.uri),  # drives S3's multipart calls for this one object
                    self.uri,
                    part_size=self.part_size,
                    concurrency=self.concurrency,
                )
                self._placement = StreamedPlacement(self._tmp_path, upload, list(self._regions.values()))

    def _allocate(self) -> dict[str, Region]:
        """Create every numeric dataset now, contiguous and allocated (see cs_h5_contiguous)."""
        assert self._file is not None
        regions = {}
        for e in self._todo:
            if e.kind not in ("tensor", "array"):
                continue
            shape = tuple(e.shape or ())
            md = tensor_metadata(e.dtype, shape) if e.kind == "tensor" else array_metadata(e.dtype == "bfloat16")
            ds = create_contiguous(self._file, e.key, shape, np.dtype(stored_numpy_dtype(e.dtype)))
            _set_attrs(ds, md)
            region = region_of(ds)
            if region is not None:
                regions[e.key] = region
        self._file.flush()
        return regions

    def _create(self, spec_text: str) -> None:
        assert self._tmp_path is not None
        if self.chunking == "contiguous":
            # One metadata block large enough for every dataset's object header: HDF5 otherwise
            # allocates 2 KiB metadata blocks at the end of the file as it goes, between the
            # datasets, and every upload part holding one would wait for commit in local storage.
            numeric = sum(1 for e in self._todo if e.kind in ("tensor", "array"))
            block = min(META_BLOCK_MAX, META_BYTES_PER_DATASET * numeric + META_BLOCK_BASE)
            self._file = h5py.File(self._tmp_path, "x", meta_block_size=block)
        else:
            self._file = h5py.File(self._tmp_path, "x")
        attrs = self._file.attrs
        attrs["__spec__"] = spec_text
        attrs["__version__"] = np.float64(FORMAT_VERSION)
        attrs["__cstorch_version__"] = self.cstorch_version
        self._writer = ChunkWriter(threads=self.threads, mode=self.lz4)

    # --- the layout, for outputs written by several processes (ckptconv.engine.fanout) --------------

    def placed_keys(self) -> set[str]:
        """Entries whose bytes are a preallocated dataset region (after ``begin`` of a skeleton)."""
        return set(self._regions) if self.skeleton else set()

    def _reserve(self, key: str) -> None:
        """Its record is known from its dtype and shape alone; its bytes go to its region."""
        entry = self._due[key]
        shape = tuple(entry.shape or ())
        md = (
            tensor_metadata(entry.dtype, shape) if entry.kind == "tensor" else array_metadata(entry.dtype == "bfloat16")
        )
        self._records[key] = md

    def _finish_skeleton(self) -> list[tuple[FileLayout, bytes]]:
        """The file's layout and the bytes of its gaps (all its metadata). A local output is the
        skeleton itself, placed at the sink's URI for the processes that write its datasets; a
        remote one keeps nothing here (the gaps are returned)."""
        if not self.skeleton or self._tmp_path is None:
            raise SinkProtocolError("cs-h5 sink: a skeleton needs a sink created with skeleton=True")
        self._on_h5_thread(self._finish, self._record_texts())
        self._close_file()
        size = os.path.getsize(self._tmp_path)
        spans = [Span(k, k, r.offset, r.nbytes) for k, r in self._regions.items() if r.nbytes]
        layout = FileLayout(self.uri, size, sorted(spans, key=lambda s: s.offset))
        with open(self._tmp_path, "rb") as f:
            gaps = gap_bytes(layout, lambda start, end: os.pread(f.fileno(), end - start, start))
        try:
            if self._tmp_dir is None:
                self.storage.publish([(self._tmp_path, self.uri)])
                self._placed_skeleton = True
        except BaseException:
            self.abort()
            raise
        self._placement = None
        self._cleanup_tmp()
        return [(layout, gaps)]

    def _commit(self) -> list[OutputFile]:
        assert self._tmp_path is not None
        self._on_h5_thread(self._finish, self._record_texts())
        self._close_file()  # stops the HDF5 thread
        size = os.path.getsize(self._tmp_path)
        if isinstance(self._placement, StreamedPlacement):
            try:
                self._placement.finish(self._tmp_path, size)
            except BaseException:
                self.abort()
                raise
            self._placement = None
            self._cleanup_tmp()
            return [OutputFile(self.uri, size, None, "data")]
        if self._placement is not None:
            self._placement.close()
            self._placement = None
        if self.fsync:
            fd = os.open(self._tmp_path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        sha256 = None
        try:
            if self._tmp_dir is None:
                self.storage.publish([(self._tmp_path, self.uri)])
            else:
                # Hashed as it is uploaded: nobody has to read the object back for its checksum.
                digest = hashlib.sha256()
                with open(self._tmp_path, "rb") as src, self.storage.open_writer(self.uri) as w:
                    for block in read_blocks(src):
                        digest.update(block)
                        w.write(block)
                sha256 = digest.hexdigest()
        except BaseException:
            self.abort()
            raise
        self._cleanup_tmp()
        return [OutputFile(self.uri, size, sha256, "data")]

    def _abort(self) -> None:
        if getattr(self, "_placed_skeleton", False):
            self._placed_skeleton = False
            self.storage.delete(self.uri)
        placement, self._placement = self._placement, None
        try:
            if placement is not None:
                placement.close()
                if isinstance(placement, StreamedPlacement):
                    placement.upload.abort()
        finally:
            self._close_file()
            self._cleanup_tmp()

    # --- internals -----------------------------------------------------------------------------

    def _finish(self, records: list[tuple[str, str]]) -> None:
        assert self._file is not None
        attrs = self._file.attrs
        for name, text in records:
            attrs[name] = text
        attrs["__SUCCESS__"] = np.bool_(True)  # last: the file is complete
        self._close_h5()

    def _close_h5(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None

    def _close_file(self) -> None:
        if self._h5 is not None:
            try:
                self._on_h5_thread(self._close_h5)
            finally:
                self._h5.shutdown(wait=True)
                self._h5 = None
        else:
            self._close_h5()

    def _cleanup_tmp(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()  # runs _remove_temp once
        self._tmp_dir = None
        self._tmp_path = None

    def _store_numeric(self, entry: Entry, md: dict[str, Any], arr: np.ndarray) -> dict[str, Any]:
        if self._placement is not None:
            # Allocated at begin with these attributes: only the bytes remain to be placed.
            region = self._regions.get(entry.key)
            if region is not None:
                self._placement.place(region, memoryview(arr.reshape(-1).view(np.uint8)))
            elif arr.size:
                # h5py allocates a 0-d dataset late whatever the property list says: HDF5 writes
                # its few bytes now, outside every preallocated region.
                self._on_h5_thread(self._write_late, entry.key, arr)
            return md
        return self._on_h5_thread(self._numeric_dataset, entry, md, arr)

    def _write_late(self, key: str, arr: np.ndarray) -> None:
        assert self._file is not None
        self._file[key][()] = arr

    def _store_object(self, key: str, md: dict[str, Any], payload: bytes) -> dict[str, Any]:
        return self._on_h5_thread(self._object_dataset, key, md, payload)

    def _numeric_dataset(self, entry: Entry, md: dict[str, Any], arr: np.ndarray) -> dict[str, Any]:
        assert self._file is not None and self._writer is not None
        f = self._file
        key = entry.key
        if arr.ndim == 0:  # SCALAR dataspace, contiguous, no filter (§1.8)
            ds = f.create_dataset(key, data=arr)
        elif arr.size == 0 or self.chunking == "h5py" or arr.nbytes <= self.small_tensor_bytes:
            ds = f.create_dataset(key, shape=arr.shape, dtype=arr.dtype, **hdf5plugin.LZ4())
            if arr.size:
                ds.write_direct(arr)
        else:
            chunks = slab_chunk_shape(arr.shape, arr.itemsize, self.chunk_bytes)
            ds = f.create_dataset(
                key, shape=arr.shape, dtype=arr.dtype, chunks=chunks, compression=LZ4_FILTER_ID, compression_opts=(0,)
            )
            flat = memoryview(arr.reshape(-1).view(np.uint8))
            self._writer.write(ds.id, flat, arr.shape, chunks, arr.itemsize)
        _set_attrs(ds, md)
        return md

    def _object_dataset(self, key: str, md: dict[str, Any], payload: bytes) -> dict[str, Any]:
        assert self._file is not None
        # Creation order tracked: object header v2, so a payload over 64 KiB fits in dense storage.
        ds = self._file.create_dataset(key, data=h5py.Empty("f"), track_order=True)
        ds.attrs["__TYPE__"] = md["__TYPE__"]
        ds.attrs["compressed"] = np.bool_(md["compressed"])
        ds.attrs["__BYTES__"] = np.frombuffer(payload, dtype="V1")
        return md


def _remove_temp(path: str | None, directory: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


_STR = h5py.string_dtype()


def _set_attrs(ds: h5py.Dataset, md: dict[str, Any]) -> None:
    """Dataset attributes with the HDF5 types cstorch gives them (§1.8)."""
    for name, v in md.items():
        if isinstance(v, bool):
            ds.attrs[name] = np.bool_(v)
        elif isinstance(v, str):
            ds.attrs[name] = v
        elif name == "dtypes":
            ds.attrs[name] = np.array(v, dtype=_STR)
        elif name == "shapes":
            # h5py stores [[]] (0-d) as an empty float64 array, as cstorch's files show
            ds.attrs[name] = np.array(v, dtype=np.int64) if v and v[0] else np.array(v, dtype=np.float64)
        else:
            ds.attrs[name] = np.array(v, dtype=np.int64)


__all__ = ["CsH5Sink", "CsH5Source"]
