"""Reads around the page cache (ckptconv.storage.direct_reads): the bytes of a plain positioned
read whatever the offset, length and the buffer's phase; the whole blocks of a buffer in phase go
direct; a file that ends early reads short; a filesystem that refuses direct reads gets plain ones."""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import random
from pathlib import Path

import numpy as np
import pytest

from ckptconv.core.errors import CorruptCheckpoint
from ckptconv.formats.memory import empty_raw
from ckptconv.formats.sharding import Slot, read_slot
from ckptconv.storage import direct_reads
from ckptconv.storage.direct_io import ALIGN
from ckptconv.storage.direct_reads import DIRECT_READ_BYTES, address_of, direct_span, read_file_into
from ckptconv.storage.local import LocalStorage

SIZE = 5 * DIRECT_READ_BYTES + 12345  # room for a value above the pool's own threshold (4 MiB)


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = random.Random(5).randbytes(SIZE)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def _direct_supported(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        buf = np.empty(2 * ALIGN, np.uint8)
        view = memoryview(buf)[-address_of(memoryview(buf)) % ALIGN :][:ALIGN]
        os.preadv(fd, [view], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _in_phase(nbytes: int, offset: int) -> memoryview:
    """A writable buffer of ``nbytes`` whose address is in phase with ``offset``."""
    return memoryview(empty_raw((nbytes,), "uint8", phase=offset % ALIGN).data).cast("B")


@pytest.fixture
def direct_preads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(offset, length) of every read made through a descriptor opened with O_DIRECT."""
    seen: list[tuple[int, int]] = []
    real = os.preadv

    def preadv(fd: int, buffers: list, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen.append((offset, sum(len(memoryview(b)) for b in buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(direct_reads.os, "preadv", preadv)
    return seen


@pytest.mark.parametrize("offset", [0, 1, ALIGN - 1, ALIGN, 3 * ALIGN + 17])
@pytest.mark.parametrize("extra", [0, 1, ALIGN - 1, 777])
def test_a_buffer_in_phase_reads_its_whole_blocks_direct_and_the_same_bytes(
    data_file: tuple[Path, bytes], direct_preads: list[tuple[int, int]], offset: int, extra: int
) -> None:
    path, data = data_file
    supported = _direct_supported(path)
    direct_preads.clear()  # the probe's read
    nbytes = 2 * DIRECT_READ_BYTES + extra
    view = _in_phase(nbytes, offset)
    assert address_of(view) % ALIGN == offset % ALIGN
    with open(path, "rb", buffering=0) as f:
        assert read_file_into(f.fileno(), offset, view) == nbytes
    assert bytes(view) == data[offset : offset + nbytes]
    if supported:
        lo, hi = direct_span(view, offset) or (0, 0)
        assert (offset + lo) % ALIGN == 0 and (hi - lo) % ALIGN == 0 and nbytes - (hi - lo) < 2 * ALIGN
        assert sum(n for _, n in direct_preads) == hi - lo > 0
        assert all(o % ALIGN == 0 and n % ALIGN == 0 for o, n in direct_preads)


def test_a_buffer_out_of_phase_or_small_is_read_through_the_page_cache(
    data_file: tuple[Path, bytes], direct_preads: list[tuple[int, int]]
) -> None:
    path, data = data_file
    offset = ALIGN + 3
    skewed = _in_phase(2 * DIRECT_READ_BYTES + 1, offset + 1)[: 2 * DIRECT_READ_BYTES]
    small = _in_phase(DIRECT_READ_BYTES - 1, offset)
    with open(path, "rb", buffering=0) as f:
        for view in (skewed, small):
            assert direct_span(view, offset) is None
            assert read_file_into(f.fileno(), offset, view) == len(view)
            assert bytes(view) == data[offset : offset + len(view)]
    assert direct_preads == []


def test_a_file_that_ends_inside_the_range_reads_short_through_either_path(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    for offset in (0, ALIGN + 9):
        for nbytes in (SIZE - offset + 1, SIZE - offset + 3 * ALIGN, SIZE + 5):
            view = _in_phase(nbytes, offset)
            with open(path, "rb", buffering=0) as f:
                got = read_file_into(f.fileno(), offset, view)
            assert got == min(nbytes, SIZE - offset) < nbytes
            assert bytes(view[:got]) == data[offset:]
    storage = LocalStorage()
    with pytest.raises(CorruptCheckpoint):
        storage.read_into(str(path), ALIGN, _in_phase(SIZE, ALIGN))


def test_a_filesystem_that_refuses_direct_reads_gets_plain_ones(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = data_file
    offset, nbytes = 5, 2 * DIRECT_READ_BYTES
    real_open, real_preadv = os.open, os.preadv

    def refusing_open(p: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "no O_DIRECT here")
        return real_open(p, flags, *args)

    def refusing_preadv(fd: int, buffers: list, at: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "no O_DIRECT reads here")
        return real_preadv(fd, buffers, at)

    for patch in ({"open": refusing_open}, {"preadv": refusing_preadv}):
        with monkeypatch.context() as m:
            for name, fn in patch.items():
                m.setattr(direct_reads.os, name, fn)
            view = _in_phase(nbytes, offset)
            with open(path, "rb", buffering=0) as f:
                assert read_file_into(f.fileno(), offset, view) == nbytes
            assert bytes(view) == data[offset : offset + nbytes]


def test_direct_reads_can_be_turned_off(
    data_file: tuple[Path, bytes], direct_preads: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = data_file
    monkeypatch.setenv("CKPTCONV_DIRECT_IO", "0")
    view = _in_phase(2 * DIRECT_READ_BYTES, 0)
    LocalStorage().read_into(str(path), 0, view)
    assert bytes(view) == data[: len(view)] and direct_preads == []


def test_a_tensor_read_from_a_local_file_lands_in_phase_and_whole(
    data_file: tuple[Path, bytes], direct_preads: list[tuple[int, int]]
) -> None:
    """The readers of local sources allocate their values in phase with the file (read_slot here;
    the cs-h5 and TF readers likewise), so the whole blocks of a large value go direct."""
    path, data = data_file
    supported = _direct_supported(path)
    direct_preads.clear()  # the probe's read
    offset = 3 * ALIGN + 100
    fd = os.open(path, os.O_RDONLY)
    try:
        # Raw and torch values, below and above the pool's own threshold, of a dtype whose element
        # the offset is aligned to; one that is not (odd offset, 2-byte values) stays aligned.
        for raw, nbytes, dtype, at in itertools.product(
            (True, False),
            (DIRECT_READ_BYTES, 5 * DIRECT_READ_BYTES // 2, 9 * DIRECT_READ_BYTES // 2),
            ("uint8", "int16"),
            (offset, offset + 1),
        ):
            if at + nbytes > SIZE:
                continue
            direct_preads.clear()
            shape = (nbytes // (2 if dtype == "int16" else 1),)
            t = read_slot(LocalStorage(), Slot(str(path), at, nbytes, dtype, shape), fd, raw=raw)
            address = t.data.ctypes.data if raw else t.data_ptr()
            got = t.data.tobytes() if raw else t.numpy().tobytes()
            assert got == data[at : at + nbytes]
            in_phase = at % (2 if dtype == "int16" else 1) == 0
            assert (address % ALIGN == at % ALIGN) == in_phase, (raw, nbytes, dtype, at)
            assert address % (2 if dtype == "int16" else 1) == 0
            if supported:
                assert bool(direct_preads) == in_phase
    finally:
        os.close(fd)


@pytest.mark.parametrize("fmt", ["safetensors", "cs-h5", "tf", "torch"])
def test_every_local_source_format_reads_its_large_values_direct(
    tmp_path: Path, direct_preads: list[tuple[int, int]], fmt: str
) -> None:
    """Each reader of local files places its values in phase: a large value's whole blocks go
    direct, and it reads back the bytes that were written."""
    from safetensors.numpy import save_file

    from ckptconv.engine.convert import convert
    from ckptconv.formats.detect import open_source

    rng = np.random.default_rng(3)
    values = {"big": rng.standard_normal(3 * DIRECT_READ_BYTES // 4, dtype=np.float32), "small": np.arange(5.0)}
    source = tmp_path / "src.safetensors"
    save_file(values, str(source))
    target = {"safetensors": "out", "cs-h5": "out.mdl", "tf": "tf/model.ckpt", "torch": "bin"}[fmt]
    out = str(tmp_path / target)
    convert(str(source), out, to=fmt)
    supported = _direct_supported(source)
    direct_preads.clear()  # the probe's, and any the conversion made
    src = open_source(out)
    try:
        got = src.read("big")
    finally:
        src.close()
    got_bytes = got.numpy().tobytes() if hasattr(got, "numpy") else got.data.tobytes()
    assert got_bytes == values["big"].tobytes()
    if supported:
        assert sum(n for _, n in direct_preads) >= len(got_bytes) - 2 * ALIGN
