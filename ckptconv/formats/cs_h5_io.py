"""Opening Cerebras H5 files and reading their numeric datasets into tensors (all format versions).

Files open through h5py directly when the storage has a local path, otherwise through the
storage's seekable reader. Data of LZ4-chunked datasets (see :mod:`ckptconv.formats.cs_h5_chunks`)
and of contiguous unfiltered ones bypasses HDF5, when their HDF5 type stores exactly the bits of
the numpy type h5py names for it (:func:`_plain_bits`); everything else goes through h5py, which
converts. HDF5 errors on damaged files surface as :class:`~ckptconv.core.errors.CorruptCheckpoint`.

HDF5 itself loops forever on a global heap collection whose objects do not advance (found by
fuzzing a fixture with zeroed or shifted byte runs): files are read through
:class:`~ckptconv.formats.cs_h5_heap.HeapCheckingReader`, which refuses such a collection before
HDF5 parses it. Should another damaged structure hang the library, nothing in Python can
interrupt it; jobs are bounded by their time limit, which ends the worker process.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from ckptconv.core.errors import CkptconvError, CorruptCheckpoint, UnsafeCheckpoint, UnsupportedFormat
from ckptconv.formats.base import check_bool_bytes
from ckptconv.formats.cs_base import cast_array
from ckptconv.formats.cs_h5_chunks import LZ4_FILTER_ID, ChunkReader, register_lz4, stored_chunks
from ckptconv.formats.cs_h5_heap import HeapCheckingReader
from ckptconv.formats.cs_serializers import stored_numpy_dtype
from ckptconv.formats.memory import empty_raw, empty_tensor
from ckptconv.storage.base import RangeReader
from ckptconv.storage.direct_io import ALIGN
from ckptconv.storage.direct_reads import read_file_into

if TYPE_CHECKING:
    import torch

    from ckptconv.formats.base import RawTensor
    from ckptconv.storage.base import Storage


# What h5py raises when a file's structures are damaged (besides hanging: see the module docstring).
H5_ERRORS = (OSError, RuntimeError, ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError)


@contextlib.contextmanager
def damaged_as_corrupt(uri: str) -> Iterator[None]:
    """Turn h5py's exceptions on a damaged file into CorruptCheckpoint (ours pass through)."""
    try:
        yield
    except CkptconvError:
        raise
    except H5_ERRORS as e:
        raise CorruptCheckpoint(f"{uri}: the HDF5 structure is damaged ({type(e).__name__}: {e})") from None


# The first read of a remote file, as RangeReader's sequential read-ahead.
FIRST_READ = 8 << 20

# Attribute type classes a checkpoint may hold (bools are h5py enums over integers).
_ATTR_CLASSES = {h5py.h5t.INTEGER, h5py.h5t.FLOAT, h5py.h5t.STRING, h5py.h5t.ENUM, h5py.h5t.OPAQUE}
_ATTR_CLASS_NAMES = {
    h5py.h5t.REFERENCE: "reference",
    h5py.h5t.COMPOUND: "compound",
    h5py.h5t.ARRAY: "array",
    h5py.h5t.VLEN: "variable-length sequence",
    h5py.h5t.BITFIELD: "bitfield",
    h5py.h5t.TIME: "time",
}
# cstorch writes string attributes as scalars or one-element arrays; a few more are tolerated.
MAX_ATTR_STRINGS = 64


class H5File:
    """One open H5 checkpoint plus the means to read its chunks without HDF5."""

    def __init__(self, storage: Storage, uri: str, *, threads: int = 2) -> None:
        self.uri = uri
        self.storage = storage
        self._fd: int | None = None
        self._reader: Any = None
        path = storage.local_path(uri)
        head = b""
        if path is None:
            # The front of the file (superblock, root group, usually its attributes) and its size
            # in one request; ObjectNotFound when absent.
            head, info = storage.read_head(uri, FIRST_READ)
        else:
            info = storage.stat(uri)  # ObjectNotFound when absent
        self.info = info
        self.size = info.size
        register_lz4()
        try:
            if path is not None:
                self._fd = os.open(path, os.O_RDONLY)
                self.size = os.fstat(self._fd).st_size
                # Through the file-object driver, so that every global heap collection is checked
                # before HDF5 walks it (see cs_h5_heap); tensor data bypasses HDF5 anyway. Other
                # reads of this descriptor are positioned (pread), so they share it safely.
                self._reader = HeapCheckingReader(io.FileIO(self._fd, "rb", closefd=False), uri, self.size)
                self.file = h5py.File(self._reader, "r")
                # No access-pattern hint (as for safetensors): POSIX_FADV_SEQUENTIAL doubles the
                # kernel's read-ahead window, and with two reader threads the data then waits
                # longer in the page cache before it is copied out; that copy cost about three
                # times the CPU per byte (cs-h5 -> safetensors spent 1.2 s instead of 0.7 s per GB
                # in preadv, page cache dropped) and no wall time was gained.
                self.chunks = ChunkReader(file_size=self.size, pread_fd=self._fd, threads=threads)
            else:
                remote = io.BufferedReader(RangeReader(storage, uri, self.size, first_block=head), 64 << 10)
                self._reader = HeapCheckingReader(remote, uri, self.size)
                self.file = h5py.File(self._reader, "r")
                self.chunks = ChunkReader(
                    file_size=self.size,
                    read_bytes=lambda off, n: storage.read_range(uri, off, n),
                    threads=threads,
                )
        except CkptconvError:  # the storage's own error (missing, unreachable): not a damaged file
            self.close()
            raise
        except (OSError, RuntimeError) as e:  # h5py opening a truncated or damaged file
            self.close()
            raise CorruptCheckpoint(
                f"{uri} is not a readable HDF5 file (truncated or damaged?): {e}",
            ) from None

    def close(self) -> None:
        f = getattr(self, "file", None)
        if f is not None:
            try:
                f.close()
            except Exception:
                pass
            self.file = None
        ch = getattr(self, "chunks", None)
        if ch is not None:
            ch.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    # --- attributes -----------------------------------------------------------------------------

    def root_attr(self, name: str, default: Any = None) -> Any:
        return self.attr(self.file, name, default)

    def attr(self, obj: Any, name: str, default: Any = None) -> Any:
        """The value of attribute ``name`` of ``obj``, its type and size checked before it is read."""
        try:
            if name not in obj.attrs:
                return default
            self._check_attr(h5py.h5a.open(obj.id, name.encode()), name)
            return obj.attrs[name]
        except CkptconvError:  # ours (UnsafeCheckpoint, a storage error) are already typed
            raise
        except H5_ERRORS as e:
            raise CorruptCheckpoint(f"{self.uri}: attribute {name!r} is unreadable: {e}") from None

    def _check_attr(self, aid: Any, name: str) -> None:
        """Refuse an attribute no Cerebras writer makes before h5py materializes it.

        Checkpoints hold numbers, booleans, strings and opaque bytes in their attributes. Other
        types (object and region references, compounds, arrays, sequences, nested to any depth)
        are refused by class, so nothing nested is ever decoded. A fixed-size value lives inside
        the file, so its size cannot exceed the file's; variable-length strings can all point at
        one large heap object, so how many of them one attribute may hold is bounded.
        """
        tid = aid.get_type()
        cls = tid.get_class()
        if cls not in _ATTR_CLASSES:
            raise CorruptCheckpoint(
                f"{self.uri}: attribute {name!r} has HDF5 type class {_ATTR_CLASS_NAMES.get(cls, cls)}, "
                "which no Cerebras checkpoint holds"
            )
        if cls == h5py.h5t.ENUM and tid.get_super().get_class() != h5py.h5t.INTEGER:
            raise CorruptCheckpoint(f"{self.uri}: attribute {name!r} is an enumeration of a non-integer type")
        count = math.prod(aid.shape or ())
        if cls == h5py.h5t.STRING and tid.is_variable_str():
            if count > MAX_ATTR_STRINGS:
                raise CorruptCheckpoint(
                    f"{self.uri}: attribute {name!r} holds {count} variable-length strings "
                    f"(at most {MAX_ATTR_STRINGS} in a checkpoint's attribute)"
                )
        elif count * tid.get_size() > self.size:
            raise CorruptCheckpoint(
                f"{self.uri}: attribute {name!r} claims {count * tid.get_size()} bytes, "
                f"more than the file's {self.size}"
            )

    def dataset(self, name: str, key: str) -> h5py.Dataset:
        """The dataset ``name``; refuses anything that would read bytes outside this file."""
        try:
            link = self.file.get(name, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                raise UnsafeCheckpoint(
                    f"{key!r}: {name!r} is an HDF5 external link to {link.filename!r}; ckptconv does not follow it",
                    hint="checkpoints must hold their own data; copy the linked data into the file first",
                )
            obj = self.file.get(name)
        except CkptconvError:  # ours (UnsafeCheckpoint, a storage error) are already typed
            raise
        except H5_ERRORS as e:
            raise CorruptCheckpoint(f"{key!r}: dataset {name!r} is unreadable: {e}") from None
        if obj is None:
            raise CorruptCheckpoint(f"{key!r}: its dataset {name!r} is missing from the file")
        if not isinstance(obj, h5py.Dataset):
            raise CorruptCheckpoint(f"{key!r}: {name!r} is a group, not a dataset")
        if obj.external or obj.is_virtual:
            raise UnsafeCheckpoint(
                f"{key!r}: dataset {name!r} keeps its data in other files; ckptconv does not read them",
                hint="checkpoints must hold their own data; rewrite the dataset without external storage",
            )
        return obj

    # --- data -----------------------------------------------------------------------------------

    def read_tensor(
        self, ds: h5py.Dataset, key: str, dtype: str, shape: tuple[int, ...], *, raw: bool = False
    ) -> torch.Tensor | RawTensor:
        """The dataset as a CPU tensor of ``dtype``: bf16 from its int16 bits, other types value-cast (§1.7).

        ``raw``: a :class:`RawTensor` when the stored bits are the tensor's (no cast), without torch."""
        if ds.shape is None:
            raise CorruptCheckpoint(f"{key!r}: dataset holds no array (empty dataspace)")
        if tuple(ds.shape) != tuple(shape):
            raise CorruptCheckpoint(
                f"{key!r}: dataset shape {tuple(ds.shape)} disagrees with its metadata shape {tuple(shape)}"
            )
        on_disk = ds.dtype
        if on_disk.kind not in "biufc":
            raise CorruptCheckpoint(f"{key!r}: dataset has non-numeric type {on_disk} for a {dtype} tensor")
        if not _tensor_bits(ds, dtype):
            # Castable on-disk type (e.g. float64 values for a float32 tensor): numpy value cast, as cstorch does.
            return cast_array(self._read_array(ds, key), dtype)
        phase = _phase(ds)
        if raw:
            value: Any = empty_raw(shape, dtype, phase=phase)
            dest = value.data.view(on_disk).reshape(shape)
        else:
            import torch

            value = empty_tensor(shape, dtype, phase=phase)
            dest = (value.view(torch.int16) if dtype == "bfloat16" else value).numpy().view(on_disk)
        if dest.size:
            self._read_into(ds, dest, key)
            check_bool_bytes(key, dtype, dest)
        return value

    def tensor_extent(self, ds: h5py.Dataset, dtype: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """(offset, nbytes) of a dataset whose stored bytes are exactly the ``dtype`` tensor's, as
        one allocated, unfiltered range inside the file: what :meth:`read_tensor` would read with
        one ranged read. None otherwise (read_tensor then reads it, and says what is wrong with it)."""
        try:
            if ds.shape is None or tuple(ds.shape) != tuple(shape) or not _tensor_bits(ds, dtype):
                return None
            nbytes = math.prod(shape) * ds.dtype.itemsize
            offset = _one_range(ds, nbytes)
        except H5_ERRORS:  # a damaged header: read_tensor reports it for its key
            return None
        if offset is None or nbytes == 0 or offset < 0 or offset + nbytes > self.size:
            return None
        return offset, nbytes

    def read_array(self, ds: h5py.Dataset, key: str) -> np.ndarray:
        """The dataset in its own on-disk type (little-endian native)."""
        on_disk = ds.dtype
        if ds.shape is None:
            raise CorruptCheckpoint(f"{key!r}: dataset holds no array (empty dataspace)")
        if on_disk.kind in "biufc" and _plain_bits(ds):
            dest = np.empty(ds.shape, dtype=on_disk)
            if dest.size:
                self._read_into(ds, dest, key)
            return _valid_bools(dest, key)
        return self._read_array(ds, key)

    def _read_array(self, ds: h5py.Dataset, key: str) -> np.ndarray:
        try:
            arr = ds[()]
        except CkptconvError:  # ours (UnsafeCheckpoint, a storage error) are already typed
            raise
        except H5_ERRORS as e:
            raise CorruptCheckpoint(f"{key!r}: dataset is unreadable: {e}") from None
        arr = np.asarray(arr)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        # HDF5 converts an enum value that is neither FALSE nor TRUE (a bool enum over another
        # integer type than h5py's own) to all one bits: h5py then hands back a "bool" of 255.
        return _valid_bools(arr, key)

    def _read_into(self, ds: h5py.Dataset, dest: np.ndarray, key: str) -> None:
        try:
            dcpl = ds.id.get_create_plist()
            filters = [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]
            if ds.chunks is not None and filters == [LZ4_FILTER_ID]:
                chunks = tuple(ds.chunks)
                stored = stored_chunks(ds.id)
                expected = math.prod(math.ceil(s / c) for s, c in zip(ds.shape, chunks, strict=True))
                if len(stored) == expected:
                    self.chunks.read(ds.id, dest, chunks, f"{key!r}", stored)
                    return
            if self._read_contiguous(ds, dest, key):
                return
            if filters and any(not h5py.h5z.filter_avail(f) for f in filters):
                raise UnsupportedFormat(f"{key!r}: dataset uses HDF5 filters {filters} that are not available")
            ds.read_direct(dest)
        except CkptconvError:  # ours (UnsafeCheckpoint, a storage error) are already typed
            raise
        except H5_ERRORS as e:
            raise CorruptCheckpoint(f"{key!r}: dataset is unreadable: {e}") from None

    def _read_contiguous(self, ds: h5py.Dataset, dest: np.ndarray, key: str) -> bool:
        """Read an unchunked, unfiltered dataset's bytes straight into ``dest``, without HDF5.

        Through h5py every read holds its global lock (and, remote, goes through a Python file
        object one request at a time): the executor's reader threads would take turns. A
        contiguous dataset is one byte range: read with a positioned read (local) or the storage's
        concurrent ranged GETs, on as many threads as ask. False when the data is not stored as
        one allocated range of exactly ``dest``'s size (HDF5 then reads it, fill values included).
        """
        nbytes = dest.nbytes
        offset = _one_range(ds, nbytes)
        if offset is None or not dest.flags.c_contiguous:
            return False
        if offset < 0 or offset + nbytes > self.size:
            raise CorruptCheckpoint(f"{key!r}: dataset at byte {offset} (+{nbytes}) lies beyond the end of the file")
        view = memoryview(dest.reshape(-1).view(np.uint8))
        if self._fd is None:
            self.storage.read_into(self.uri, offset, view)
            return True
        if read_file_into(self._fd, offset, view) < nbytes:
            raise CorruptCheckpoint(f"{key!r}: file truncated inside the dataset")
        return True

    def read_opaque(self, obj: Any, name: str, key: str) -> bytes:
        """The raw bytes of an opaque attribute (``__BYTES__``), shape (N,) or scalar."""
        value = self.attr(obj, name)
        if value is None:
            raise CorruptCheckpoint(f"{key!r}: object dataset has no {name} attribute")
        if isinstance(value, bytes):
            return value
        arr = np.asarray(value)
        if arr.dtype.kind != "V":
            raise CorruptCheckpoint(f"{key!r}: {name} is not an opaque byte string")
        return arr.tobytes()


def _plain_bits(ds: h5py.Dataset) -> bool:
    """Whether the dataset's stored bits are those of the numpy type h5py names for it, little-endian.

    h5py names the nearest numpy type for any HDF5 type: an integer using 16 of 32 bits from bit
    8, or a float with its own exponent bias, are reported as plain ``int32`` / ``float64``
    although their bytes are not; only HDF5 reads such values right (it converts them)."""
    on_disk = ds.dtype
    return on_disk.byteorder in "=<|" and ds.id.get_type().equal(h5py.h5t.py_create(on_disk))


def _tensor_bits(ds: h5py.Dataset, dtype: str) -> bool:
    """Whether the dataset stores a ``dtype`` tensor's own bits (bf16: as 16-bit integers)."""
    on_disk = ds.dtype
    want = np.dtype(stored_numpy_dtype(dtype))
    return (on_disk == want or (dtype == "bfloat16" and on_disk == np.dtype("<u2"))) and _plain_bits(ds)


def _one_range(ds: h5py.Dataset, nbytes: int) -> int | None:
    """Where the dataset's bytes start when they are stored as one allocated range of exactly
    ``nbytes`` (unchunked, unfiltered); None otherwise."""
    if ds.chunks is not None or ds.id.get_create_plist().get_nfilters():
        return None
    offset = ds.id.get_offset()
    if offset is None or ds.id.get_storage_size() != nbytes:
        return None
    return int(offset)


def _valid_bools(arr: np.ndarray, key: str) -> np.ndarray:
    """``arr``, once a bool one is found to hold only 0 and 1 (see check_bool_bytes)."""
    if arr.dtype == np.bool_:
        check_bool_bytes(key, "bool", arr)
    return arr


def _phase(ds: h5py.Dataset) -> int | None:
    """Where a contiguous dataset's bytes start, modulo a block: a buffer in that phase is read
    around the page cache (storage.direct_reads). None for a chunked one, or one not allocated."""
    try:
        offset = ds.id.get_offset() if ds.chunks is None else None
    except H5_ERRORS:
        return None
    return None if offset is None else offset % ALIGN
