"""Writing Cerebras H5 checkpoints (``CsH5Sink``, format 0.5); the layout is described in ``cs_h5``.

The sink writes tensors as they arrive: by default (the ``contiguous`` layout) uncompressed at
offsets planned before the data arrives (positioned writes into a local file, positioned parts of
an S3 upload); with LZ4 compression, in slab chunks that it LZ4-frames itself. The metadata
records and ``__SUCCESS__`` are written at commit.
"""

from __future__ import annotations

import os
import shutil
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import h5py
import numpy as np

from ckptconv.core.errors import (
    InvalidRequest,
    KeyCollision,
    SinkProtocolError,
    TargetExists,
)
from ckptconv.formats.base import Entry, OutputFile
from ckptconv.formats.cs_base import CerebrasSink, needs_payload
from ckptconv.formats.cs_h5_chunks import (
    DEFAULT_CHUNK_BYTES,
    LZ4_FILTER_ID,
    ChunkWriter,
    check_lz4_mode,
    register_lz4,
    slab_chunk_shape,
    stored_chunks,
)
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
from ckptconv.formats.cs_serializers import (
    FORMAT_VERSION,
    array_metadata,
    root_spec_text,
    stored_numpy_dtype,
    tensor_metadata,
)
from ckptconv.formats.layout import FileLayout, Span, gap_bytes
from ckptconv.formats.tree import TreeSpec
from ckptconv.storage import scratch
from ckptconv.storage.base import read_blocks, streaming_buffer_bytes
from ckptconv.storage.digests import WrittenBlocks, new_hash
from ckptconv.storage.local import check_free_space, ensure_parent_dir, release_reserve, reserve_space
from ckptconv.storage.part_upload import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PART_SIZE,
    PartUpload,
    check_part_size,
    upload_buffer_bytes,
)

# A chunked dataset's metadata: its object header with attributes (about 1 KiB) and its chunk
# index's first B-tree node (about 5 KiB for 64 chunks of a 2-d dataset).
META_BYTES_PER_CHUNKED_DATASET = 8 << 10
# Below this much data the metadata is left where HDF5 puts it: reading a few blocks back is cheap.
HASHED_META_MIN_DATA = 64 << 20
# What the file may hold besides the data, for its space check and reservation: HDF5's metadata
# (a block of up to META_BLOCK_BASE, headers, attributes and chunk indexes per entry).
META_RESERVE_BASE = META_BLOCK_BASE
META_RESERVE_PER_ENTRY = 16 << 10


class CsH5Sink(CerebrasSink):
    """Writes a Cerebras H5 checkpoint, format 0.5, that ``cstorch.load`` 2.10 reads.

    Options:
    - ``compression``: ``"none"`` (default) or ``"lz4"``: the LZ4-chunked ``"fast"`` layout below,
      whose chunks' sizes are known only once compressed (so it cannot be fanned out, see
      :meth:`unsplittable`);
    - ``chunking``: ``"contiguous"`` (the default without compression, local or S3: uncompressed
      contiguous datasets allocated up front, see :mod:`ckptconv.formats.cs_h5_contiguous`; an S3
      target is then streamed as a multipart upload without a local copy), ``"fast"`` (the default
      with LZ4: large slab chunks for tensors over ``small_tensor_bytes``) or ``"h5py"`` (h5py's
      automatic chunks for every dataset, as cstorch writes them; slower). The chunked layouts
      build the whole file on local disk first and upload it at commit for an S3 target;
    - ``part_size`` (16 MiB) and ``concurrency`` (4 parts in flight): the streamed upload;
    - ``chunk_bytes`` (1 MiB), ``small_tensor_bytes`` (1 MiB), ``threads`` (2): the fast path;
    - ``lz4``: ``"auto"`` (default: compress a large chunk only when samples of it compress, since
      weights seldom do), ``"always"`` (every chunk, as the HDF5 filter does) or ``"never"``;
      chunks that are not compressed are stored as raw LZ4 blocks, which every reader accepts;
    - ``cstorch_version`` recorded in ``__cstorch_version__`` (default "2.10.0");
    - ``fsync`` (True): flush the file to disk before publishing it.

    A local output of the fast or contiguous layout is hashed as it is written (its block digest,
    :class:`~ckptconv.storage.digests.WrittenBlocks`): only the blocks holding HDF5's own metadata
    are read back at commit, not the whole file.

    The file is written to ``{target}.{8 hex}.tmp`` beside a local target (a temporary directory
    for a remote one: the whole file for the chunked layouts, uploaded on commit; only the
    metadata skeleton for the contiguous layout) and published only by ``commit``.
    """

    format = "cs-h5"

    def __init__(self, storage: Any, uri: str, **options: Any) -> None:
        super().__init__(storage, uri, **options)
        # Only the metadata (a skeleton): the datasets' bytes are written by other processes.
        self.skeleton = bool(options.get("skeleton", False))
        refused = self.unsplittable(options) if self.skeleton else None
        if refused:
            raise InvalidRequest(f"a cs-h5 skeleton is written contiguous: {refused}")
        self.chunking = _chunking(options)
        self.part_size = int(options.get("part_size", DEFAULT_PART_SIZE))
        self.concurrency = int(options.get("concurrency", DEFAULT_CONCURRENCY))
        self._regions: dict[str, Region] = {}
        self._placement: LocalPlacement | StreamedPlacement | None = None
        self.chunk_bytes = int(options.get("chunk_bytes", DEFAULT_CHUNK_BYTES))
        self.small_tensor_bytes = int(options.get("small_tensor_bytes", 1 << 20))
        self.threads = int(options.get("threads", 2))
        self.fsync = bool(options.get("fsync", True))
        self.lz4 = check_lz4_mode(str(options.get("lz4", "auto")))
        if self.chunking == "contiguous" and storage.local_path(uri) is None:
            check_part_size(self.part_size)  # refused now, not after the skeleton is built
        self._file: h5py.File | None = None
        self._tmp_path: str | None = None
        self._tmp_dir: str | None = None
        self._writer: ChunkWriter | None = None
        self._h5: ThreadPoolExecutor | None = None
        # A local output's block digest, hashed as its bytes are written (see _hash_as_written).
        self._written: WrittenBlocks | None = None
        self._read_fd = -1
        self._reserved = False

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
        # Before HDF5 writes a byte: once a write of its own has failed for want of space, h5py
        # crashes the process when the objects of that file are closed or collected (the failed
        # flush leaves HDF5's state broken), so a full disk must be met here, with a typed error.
        check_free_space(os.path.dirname(self._tmp_path), self._output_bound(), self.uri)
        # _create makes the file and reserves its blocks: fallocate refuses what statvfs does not
        # show (a quota; another writer filling the disk since the check). Every refusal is behind
        # us after it; the skeleton (a dataset and its attributes per entry, hundreds of ms for a
        # large model) overlaps the first reads.
        self._on_h5_thread(self._create, root_spec_text(spec))
        self._checks_passed()
        if self.chunking == "contiguous":
            self._regions = self._on_h5_thread(self._allocate)
            if self.skeleton:
                self._placement = SkeletonOnly()
            elif self._tmp_dir is None:
                self._placement = LocalPlacement(self._tmp_path, self.uri, self._written)
            else:
                upload = PartUpload(
                    self.storage.backend(self.uri),  # drives S3's multipart calls for this one object
                    self.uri,
                    part_size=self.part_size,
                    concurrency=self.concurrency,
                )
                self._placement = StreamedPlacement(self._tmp_path, upload, list(self._regions.values()))

    @classmethod
    def unsplittable(cls, options: dict[str, Any]) -> str | None:
        """A chunked layout (LZ4) cannot be cut into parts written by several processes: a dataset's
        chunks take the room they compress to, so no offset is known before the data is written."""
        if _chunking(options) == "contiguous":
            return None
        return "compressed cs-h5 datasets take the room they compress to: their offsets are not known up front"

    @classmethod
    def remote_buffer_bytes(cls, options: dict[str, Any]) -> int:
        """The contiguous layout (the default) streams through one concurrent part upload; the
        chunked layouts upload the finished file with one streaming writer."""
        if _chunking(options) != "contiguous":
            return streaming_buffer_bytes()
        part_size = int(options.get("part_size", DEFAULT_PART_SIZE))
        return upload_buffer_bytes(part_size, int(options.get("concurrency", DEFAULT_CONCURRENCY)))

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

    def _writes_data_here(self) -> bool:
        """Whether the values' bytes go into this local file: not for a skeleton (the datasets'
        regions are filled by others) nor a streamed contiguous file (written to the upload)."""
        return not self.skeleton and not (self.chunking == "contiguous" and self._tmp_dir is not None)

    def _output_bound(self) -> int:
        """Most bytes the file can take on local disk: the data where it is written here (raw in
        the contiguous layout; in a chunked one LZ4 frames of at most raw size plus 1/255, plus
        each chunk's index entry, at most 1/64 for chunks of 4 KiB or more) and HDF5's metadata."""
        data = 0
        if self._writes_data_here():
            data = sum(e.nbytes for e in self._todo)
        chunked = 0 if self.chunking == "contiguous" else data // 255 + data // 64
        return data + chunked + META_RESERVE_BASE + META_RESERVE_PER_ENTRY * len(self._todo)

    def _reserve_space(self) -> None:
        """Allocate the file's blocks before HDF5 writes them (see ``reserve_space``): the space
        check in ``_begin`` leaves the disk to fill up meanwhile, this does not. A skeleton or a
        streamed contiguous file holds little besides the datasets' regions, which are not
        written here: no reservation (its metadata may sit after them)."""
        if not self._writes_data_here():
            return
        assert self._tmp_path is not None
        fd = os.open(self._tmp_path, os.O_WRONLY)
        try:
            self._reserved = reserve_space(fd, self._output_bound(), self.uri)
        finally:
            os.close(fd)

    def _hash_as_written(self) -> bool:
        """A local output of the fast or contiguous layout gets its block digest as it is written:
        we write (or hand HDF5) nearly every byte, and only the blocks holding HDF5's own metadata
        are read back at commit, instead of the whole file for its digest."""
        return self._tmp_dir is None and not self.skeleton and self.chunking in ("fast", "contiguous")

    def _create(self, spec_text: str) -> None:
        assert self._tmp_path is not None
        if self._hash_as_written():
            self._written = WrittenBlocks()
        numeric = [e for e in self._todo if e.kind in ("tensor", "array")]
        if self.chunking == "contiguous":
            # One metadata block large enough for every dataset's object header: HDF5 otherwise
            # allocates 2 KiB metadata blocks at the end of the file as it goes, between the
            # datasets, and every upload part holding one would wait for commit in local storage.
            block = min(META_BLOCK_MAX, META_BYTES_PER_DATASET * len(numeric) + META_BLOCK_BASE)
            self._file = h5py.File(self._tmp_path, "x", meta_block_size=block)
        elif self._written is not None and sum(e.nbytes for e in numeric) >= HASHED_META_MIN_DATA:
            # The same for the chunked layout's headers and chunk indexes, sized to them (no
            # reserve: a small file stays small): every digest block holding metadata between the
            # chunks would be read back at commit.
            block = min(META_BLOCK_MAX, META_BYTES_PER_CHUNKED_DATASET * len(numeric))
            self._file = h5py.File(self._tmp_path, "x", meta_block_size=block)
        else:
            self._file = h5py.File(self._tmp_path, "x")
        self._reserve_space()
        attrs = self._file.attrs
        attrs["__spec__"] = spec_text
        attrs["__version__"] = np.float64(FORMAT_VERSION)
        attrs["__cstorch_version__"] = self.cstorch_version
        self._writer = ChunkWriter(threads=self.threads, mode=self.lz4, written=self._written)
        if self._written is not None:
            self._read_fd = os.open(self._tmp_path, os.O_RDONLY)

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
        if isinstance(self._placement, LocalPlacement):
            # The values still on their way land before HDF5 adds its last metadata, the reserve
            # is given back and the file is measured.
            try:
                self._placement.finish()
            except BaseException:
                self.abort()
                raise
            self._placement = None
        self._on_h5_thread(self._finish, self._record_texts())
        self._close_file()  # stops the HDF5 thread
        if self._reserved:
            release_reserve(self._tmp_path)
        size = os.path.getsize(self._tmp_path)
        if isinstance(self._placement, StreamedPlacement):
            upload = self._placement.upload
            try:
                self._placement.finish(self._tmp_path, size)
            except BaseException:
                self.abort()
                raise
            self._placement = None
            self._cleanup_tmp()
            # Its parts were hashed as they went out: the block digest, no read-back.
            return [OutputFile(self.uri, size, None, "data", blocks=upload.blocks.to_dict(size))]
        if self._placement is not None:
            self._placement.close()
            self._placement = None
        blocks = None
        fd = os.open(self._tmp_path, os.O_RDONLY)
        try:
            if self._written is not None and self.fsync:
                # The blocks not hashed as written (HDF5's metadata among them) are read back from
                # the page cache and hashed on another thread while fsync waits for the disk.
                with ThreadPoolExecutor(max_workers=1, thread_name_prefix="h5-read-back") as pool:
                    hashed = pool.submit(self._written.finish, fd, size)
                    os.fsync(fd)
                    blocks = hashed.result()
            else:
                if self.fsync:
                    os.fsync(fd)
                if self._written is not None:
                    blocks = self._written.finish(fd, size)
        finally:
            os.close(fd)
        digest = None
        try:
            if self._tmp_dir is None:
                self.storage.publish([(self._tmp_path, self.uri)])
            else:
                # Hashed as it is uploaded: nobody has to read the object back for its checksum.
                h = new_hash()
                with open(self._tmp_path, "rb") as src, self.storage.open_writer(self.uri) as w:
                    for block in read_blocks(src):
                        h.update(block)
                        w.write(block)
                digest = h.hexdigest()
        except BaseException:
            self.abort()
            raise
        self._cleanup_tmp()
        return [OutputFile(self.uri, size, digest, "data", blocks=blocks)]

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
        if self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.close()  # waits for the chunks still being hashed
        finally:
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
        ds = self._file[key]
        ds[()] = arr
        self._report_stored(ds)

    def _report_stored(self, ds: h5py.Dataset) -> None:
        """Hand the bytes HDF5 just stored for ``ds`` (small, still in the page cache) to the digest."""
        if self._written is None:
            return
        ds.flush()  # its chunks leave HDF5's chunk cache for the file
        if ds.chunks is None:
            offset = ds.id.get_offset()
            extents = [] if offset is None else [(int(offset), int(ds.id.get_storage_size()))]
        else:
            extents = [(c.address, c.size) for c in stored_chunks(ds.id)]
        for offset, size in extents:
            self._written.wrote(offset, os.pread(self._read_fd, size, offset))

    def _store_object(self, key: str, md: dict[str, Any], payload: bytes) -> dict[str, Any]:
        return self._on_h5_thread(self._object_dataset, key, md, payload)

    def _numeric_dataset(self, entry: Entry, md: dict[str, Any], arr: np.ndarray) -> dict[str, Any]:
        assert self._file is not None and self._writer is not None
        register_lz4()
        f = self._file
        key = entry.key
        if arr.ndim == 0:  # SCALAR dataspace, contiguous, no filter (§1.8)
            ds = f.create_dataset(key, data=arr)
            self._report_stored(ds)
        elif arr.size == 0 or self.chunking == "h5py" or arr.nbytes <= self.small_tensor_bytes:
            ds = f.create_dataset(
                key, shape=arr.shape, dtype=arr.dtype, compression=LZ4_FILTER_ID, compression_opts=(0,)
            )
            if arr.size:
                ds.write_direct(arr)
                self._report_stored(ds)
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


COMPRESSIONS = ("none", "lz4")


def _chunking(options: dict[str, Any]) -> str:
    """The layout ``options`` ask for: ``chunking`` when given, else the one ``compression`` needs."""
    compression = options.get("compression") or "none"
    if compression not in COMPRESSIONS:
        raise InvalidRequest(f"cs-h5 compression must be one of {', '.join(COMPRESSIONS)}, not {compression!r}")
    chunking = options.get("chunking") or ("fast" if compression == "lz4" else "contiguous")
    if chunking not in ("fast", "h5py", "contiguous"):
        raise ValueError(f"chunking must be 'fast', 'h5py' or 'contiguous', not {chunking!r}")
    if compression == "lz4" and chunking == "contiguous":
        raise InvalidRequest("LZ4 compression needs a chunked cs-h5 layout, not 'contiguous'")
    return chunking


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
