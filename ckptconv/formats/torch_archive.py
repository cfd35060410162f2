"""Reading zip-format torch archives (``torch.save``, PyTorch >= 1.6) without ``torch.load``.

The archive's central directory is read through ranged reads; ``data.pkl`` (small) is unpickled by
:class:`DescribingUnpickler`, the restricted unpickler of :mod:`ckptconv.formats.restricted_pickle`
reading storage records, which turns every tensor into a description (storage record, dtype,
offset, shape, stride) instead of data. A tensor's bytes are then one ranged read of its
``<archive>/data/<n>`` member, locally or on S3.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from typing import TYPE_CHECKING, Any

from ckptconv.core.dtypes import DTYPE_SIZES
from ckptconv.core.errors import CkptconvError, CorruptCheckpoint, UnsupportedFormat
from ckptconv.formats.pickle_allowlist import MAX_NESTING, StorageRef, StorageType, TensorRef
from ckptconv.formats.restricted_pickle import RestrictedUnpickler, run
from ckptconv.formats.sharding import Slot, read_slot
from ckptconv.storage.base import RangeReader

if TYPE_CHECKING:
    import torch

    from ckptconv.storage.base import Storage

MAX_PICKLE_BYTES = 256 << 20  # data.pkl holds structure only; real ones are a few MB
MAX_LEAVES = 10_000_000


class DescribingUnpickler(RestrictedUnpickler):
    """Unpickles ``data.pkl`` into containers, plain values and :class:`TensorRef` descriptions.

    Globals resolve through the one allowlist (:mod:`ckptconv.formats.pickle_allowlist`), narrowed
    to what torch's own ``weights_only`` loader accepts, so ckptconv reads a torch archive exactly
    when ``torch.load(weights_only=True)`` would; storage records become :class:`StorageRef`. A
    pickle naming anything else is refused before a single call is made.
    """

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), weights_only=True)
        self.storages: dict[str, StorageRef] = {}

    def persistent_load(self, pid: Any) -> StorageRef:
        if not isinstance(pid, tuple) or len(pid) != 5:
            raise CorruptCheckpoint("data.pkl has a malformed storage record")
        typename, storage_type, key, _location, numel = pid
        if isinstance(typename, bytes):
            typename = typename.decode("ascii", "replace")
        if typename != "storage" or not isinstance(storage_type, StorageType):
            raise CorruptCheckpoint("data.pkl has a persistent record that is not a storage")
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise CorruptCheckpoint("data.pkl has a storage record with an invalid key or size")
        nbytes = numel * DTYPE_SIZES[storage_type.dtype]
        ref = self.storages.get(key)
        if ref is None:
            ref = self.storages[key] = StorageRef(key, storage_type.dtype, nbytes)
        elif ref.nbytes != nbytes:
            raise CorruptCheckpoint(f"data.pkl gives storage {key!r} two different sizes")
        return ref


def describe_pickle(data: bytes, where: str) -> Any:
    """The object tree of a ``data.pkl``, tensors as :class:`TensorRef`. Never runs code."""
    return run(DescribingUnpickler(data), where)


def check_tree(root: Any, where: str) -> None:
    """Refuse cycles, absurd depth, and trees whose flattening would explode (shared subtrees)."""
    counted: dict[int, int] = {}
    active: set[int] = set()

    def count(obj: Any, depth: int) -> int:
        if not isinstance(obj, dict | list | tuple | set | frozenset):
            return 1
        if depth > MAX_NESTING:
            raise CorruptCheckpoint(f"{where}: the pickle nests containers more than {MAX_NESTING} deep")
        oid = id(obj)
        if oid in counted:
            return counted[oid]
        if oid in active:
            raise CorruptCheckpoint(f"{where}: the pickle contains a container that holds itself")
        active.add(oid)
        items = obj.values() if isinstance(obj, dict) else obj
        n = sum(count(v, depth + 1) for v in items)
        active.discard(oid)
        if n > MAX_LEAVES:
            raise CorruptCheckpoint(f"{where}: the pickle would flatten to more than {MAX_LEAVES} entries")
        counted[oid] = n
        return n

    count(root, 0)


class Archive:
    """One zip-format torch file: its storage members and the tensors ``data.pkl`` describes.

    Only the central directory goes through ``zipfile`` (a few small reads at the end of the
    file); members are read with ranged reads at their data offsets, so opening an archive on
    S3 never downloads tensor data. ``base``/``size`` place the archive inside a larger file (the
    records of a PyTorch distributed checkpoint are ``torch.save`` archives at offsets of its
    ``.distcp`` files); offsets this class returns are offsets in that file.
    """

    def __init__(self, storage: Storage, uri: str, *, base: int = 0, size: int | None = None) -> None:
        self.storage = storage
        self.uri = uri
        self.base = base
        self.size = storage.stat(uri).size if size is None else size
        self._offsets: dict[str, int] = {}
        try:
            with self._reader() as reader, zipfile.ZipFile(reader) as zf:
                self.members = {info.filename: info for info in zf.infolist()}
        except CkptconvError:  # the storage's own error (missing, unreachable): not a damaged archive
            raise
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:  # zipfile on a damaged archive
            raise CorruptCheckpoint(f"{self.uri} is not a readable zip archive ({e})") from e
        names = list(self.members)
        if not names or "/" not in names[0]:
            raise CorruptCheckpoint(f"{self.uri}: the archive has no torch record directory")
        # torch.load takes the record directory from the first member, whatever its name.
        self.prefix = names[0].split("/", 1)[0] + "/"
        if self.prefix + "constants.pkl" in self.members:
            raise UnsupportedFormat(
                f"{self.uri} is a TorchScript archive, not a state dict",
                hint="save model.state_dict() with torch.save and convert that file",
            )
        if self._member("data.pkl").file_size > MAX_PICKLE_BYTES:
            raise CorruptCheckpoint(f"{self.uri}: data.pkl is larger than {MAX_PICKLE_BYTES} bytes")
        pkl = self._read_member("data.pkl")
        order = self._read_member("byteorder") if self.prefix + "byteorder" in self.members else b"little"
        if order not in (b"little", b"big"):
            raise CorruptCheckpoint(f"{self.uri}: unknown byte order {order[:16]!r}")
        self.big_endian = order == b"big"
        self.tree = describe_pickle(pkl, self.uri)

    def _reader(self) -> Any:
        if self.base == 0 and self.size == self.storage.stat(self.uri).size:
            return self.storage.open_reader(self.uri)
        return io.BufferedReader(RangeReader(self.storage, self.uri, self.size, start=self.base), 64 << 10)

    def _member(self, name: str) -> zipfile.ZipInfo:
        info = self.members.get(self.prefix + name)
        if info is None:
            raise CorruptCheckpoint(f"{self.uri}: the archive has no {self.prefix}{name} record")
        return info

    def _read_member(self, name: str) -> bytes:
        """A small member, whole, checked against its CRC."""
        info = self._member(name)
        data = self.storage.read_range(self.uri, self.data_offset(name), info.file_size)
        if zlib.crc32(data) != info.CRC:
            raise CorruptCheckpoint(f"{self.uri}: {self.prefix}{name} fails its CRC check")
        return data

    def check(self, ref: TensorRef) -> None:
        """The storage member exists and is large enough for the storage, which holds the view."""
        info = self._member("data/" + ref.storage.key)
        begin, end = ref.span()
        if info.file_size < ref.storage.nbytes or end > ref.storage.nbytes:
            raise CorruptCheckpoint(
                f"{self.uri}: storage {ref.storage.key} holds {info.file_size} bytes, "
                f"too few for a {ref.dtype}{list(ref.shape)} tensor at byte {begin}"
            )

    def data_offset(self, name: str) -> int:
        """Where the bytes of a stored (uncompressed) member start in the file."""
        if name not in self._offsets:
            info = self._member(name)
            if info.compress_type != zipfile.ZIP_STORED:
                raise UnsupportedFormat(
                    f"{self.uri}: {info.filename} is compressed; torch.save stores records uncompressed",
                    hint="re-save the checkpoint with torch.save",
                )
            if info.header_offset + 30 > self.size:
                raise CorruptCheckpoint(f"{self.uri}: {info.filename} starts past the end of the file")
            head = self.storage.read_range(self.uri, self.base + info.header_offset, 30)
            sig, name_len, extra_len = struct.unpack("<I22xHH", head)
            if sig != 0x04034B50:
                raise CorruptCheckpoint(f"{self.uri}: {info.filename} has a bad local header")
            start = info.header_offset + 30 + name_len + extra_len
            if start + info.file_size > self.size:
                raise CorruptCheckpoint(f"{self.uri}: {info.filename} runs past the end of the file")
            self._offsets[name] = self.base + start
        return self._offsets[name]


def read_ref(archive: Archive, ref: TensorRef, fd: int | None) -> torch.Tensor:
    """One tensor from its storage member: the bytes of its view, then the view itself."""
    import torch

    begin, end = ref.span()
    start = archive.data_offset("data/" + ref.storage.key)
    size = DTYPE_SIZES[ref.dtype]
    if ref.is_contiguous():
        t = read_slot(archive.storage, Slot(archive.uri, start + begin, end - begin, ref.dtype, ref.shape), fd)
    else:
        # Strided (e.g. transposed) views read the storage span they touch and copy out the view.
        span = read_slot(
            archive.storage, Slot(archive.uri, start + begin, end - begin, ref.dtype, ((end - begin) // size,)), fd
        )
        t = torch.as_strided(span, ref.shape, ref.stride).contiguous()
        del span
    if archive.big_endian and size > 1:
        t = _swap_bytes(t)
    return t


def _swap_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    width = t.element_size() // 2 if t.is_complex() else t.element_size()
    raw = t.reshape(-1).view(torch.uint8).view(-1, width).flip(1).contiguous()
    return raw.reshape(-1).view(t.dtype).reshape(t.shape)
