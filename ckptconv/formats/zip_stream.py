"""A zip archive written front to back, as ``torch.save`` lays it out, without seeking (ZIP64 included)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Protocol

from isal import isal_zlib

from ckptconv.formats.layout import CRC32, DATA


class _Out(Protocol):
    def write(self, data: bytes | memoryview, each: Callable[[memoryview], None] | None = None) -> object:
        """Write ``data``; ``each(piece)`` on every piece of it once written, in order."""


class _Placing(_Out, Protocol):
    """An output that records where bytes another process writes go (``ckptconv.formats.layout``)."""

    def place(self, key: str, nbytes: int, kind: str) -> None: ...


class ZipStreamWriter:
    """Writes a zip archive front to back, as ``torch.save`` lays it out, without seeking.

    Members are stored uncompressed, their data aligned to ``alignment`` bytes by an ``FB``
    padding extra field, sizes and CRC in a data descriptor after the data (flag bit 3), and the
    archive always ends with zip64 end records. Members of ``zip64_from`` bytes or more, or
    starting beyond 4 GiB, carry zip64 extra fields.

    :meth:`reserve` lays out a member without its data (the output must be :class:`_Placing`): its
    data and the two copies of its CRC-32 (data descriptor, central directory) become spans of
    the member's key, the rest of the archive is written as it would be.
    """

    def __init__(self, out: _Out, *, alignment: int = 64, zip64_from: int = 0xFFFFFFFF) -> None:
        self.out = out
        self.alignment = alignment
        self.zip64_from = zip64_from
        self.pos = 0
        self.members: list[tuple[bytes, int, int, int, str | None]] = []  # name, header offset, crc, size, key
        self._open: tuple[bytes, int, int, bool] | None = None  # name, header offset, size, zip64
        self._crc = 0
        self._written = 0
        self._key: str | None = None  # the member being reserved: its CRC is a span of this key
        self.cd_start: int | None = None

    def _emit(self, data: bytes | memoryview) -> None:
        self.out.write(data)
        self.pos += data.nbytes if isinstance(data, memoryview) else len(data)

    def add(self, name: str, data: bytes) -> None:
        self.begin(name, len(data))
        self.feed(data)
        self.end()

    def begin(self, name: str, size: int) -> None:
        if self._open is not None:
            raise RuntimeError("zip member still open")
        raw = name.encode()
        zip64 = size >= self.zip64_from or self.pos >= 0xFFFFFFFF
        extra = struct.pack("<HHQQ", 1, 16, 0, 0) if zip64 else b""
        pad = -(self.pos + 30 + len(raw) + len(extra) + 4) % self.alignment
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding, as torch writes it
        version = 45 if zip64 else 0
        self._emit(struct.pack("<IHHHHHIIIHH", 0x04034B50, version, 0x0808, 0, 0, 0, 0, 0, 0, len(raw), len(extra)))
        self._emit(raw + extra)
        self._open = (raw, self.pos - 30 - len(raw) - len(extra), size, zip64)
        self._crc = 0
        self._written = 0

    def reserve(self, name: str, size: int, key: str) -> None:
        """A member of ``size`` bytes whose data (and CRC) ``key``'s value gives, written elsewhere."""
        self.begin(name, size)
        if size == 0:  # no data: its CRC is known (0)
            self.end()
            return
        out: _Placing = self.out  # type: ignore[assignment]
        out.place(key, size, DATA)
        self.pos += size
        self._written = size
        self._key = key
        self.end()

    def _emit_crc(self, crc: int, key: str | None) -> None:
        if key is None:
            self._emit(struct.pack("<I", crc))
            return
        out: _Placing = self.out  # type: ignore[assignment]
        out.place(key, 4, CRC32)
        self.pos += 4

    def feed(self, data: bytes | memoryview) -> None:
        def crc(piece: memoryview) -> None:
            # ISA-L's CRC-32 (the values of zlib.crc32): zlib's costs 0.5 s of CPU per GB, on
            # the thread that writes the archive.
            self._crc = isal_zlib.crc32(piece, self._crc)

        # The CRC is computed piece by piece as the output writes them (HashingWriter: beside
        # the file's digest, from the caches), not in a pass over the whole value first.
        self.out.write(data, each=crc)
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        self._written += n
        self.pos += n

    def end(self) -> None:
        if self._open is None:
            raise RuntimeError("no zip member open")
        raw, offset, size, zip64 = self._open
        if self._written != size:
            raise RuntimeError(f"zip member {raw!r}: {self._written} bytes written, {size} announced")
        key, self._key = self._key, None
        self._emit(struct.pack("<I", 0x08074B50))
        self._emit_crc(self._crc, key)
        self._emit(struct.pack("<QQ", size, size) if zip64 else struct.pack("<II", size, size))
        self.members.append((raw, offset, self._crc, size, key))
        self._open = None

    def finish(self) -> None:
        cd_start = self.cd_start = self.pos  # the central directory: every member's CRC
        for raw, offset, crc, size, key in self.members:
            big_size = size >= self.zip64_from
            big_offset = offset >= 0xFFFFFFFF
            extra = b""
            if big_size or big_offset:
                fields = (size, size) if big_size else ()
                fields += (offset,) if big_offset else ()
                extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields)
            version = 45 if extra else 0
            self._emit(struct.pack("<IHHHHHH", 0x02014B50, version, version, 0x0808, 0, 0, 0))
            self._emit_crc(crc, key)
            self._emit(
                struct.pack(
                    "<IIHHHHHII",
                    0xFFFFFFFF if big_size else size,
                    0xFFFFFFFF if big_size else size,
                    len(raw),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    0xFFFFFFFF if big_offset else offset,
                )
            )
            self._emit(raw + extra)
        cd_size = self.pos - cd_start
        n = len(self.members)
        eocd64 = self.pos
        self._emit(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, n, n, cd_size, cd_start))
        self._emit(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
        self._emit(
            struct.pack(
                "<IHHHHIIH",
                0x06054B50,
                0,
                0,
                min(n, 0xFFFF),
                min(n, 0xFFFF),
                min(cd_size, 0xFFFFFFFF),
                min(cd_start, 0xFFFFFFFF),
                0,
            )
        )
