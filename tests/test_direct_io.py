"""Writes around the page cache (ckptconv.storage.direct_io): the same bytes as plain positioned
writes whatever the offsets, sizes and order; failures raised by the next call, typed through
LocalPatch; a filesystem that refuses direct writes gets plain ones; dropped writes stay dropped."""

from __future__ import annotations

import errno
import gc
import itertools
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ckptconv.core.errors import StorageError
from ckptconv.storage import direct_io
from ckptconv.storage.direct_io import ALIGN, BATCH_BYTES, BATCHES, WRITERS, DirectWrites
from ckptconv.storage.local import LocalPatch


def _writes(seed: int, size: int) -> list[tuple[int, bytes]]:
    """Writes tiling [0, size): tiny, block-aligned and unaligned ones, one longer than every
    staging buffer together, in runs of adjacent pieces (a value written in pieces) whose order
    jumps back and forth."""
    rng = random.Random(seed)
    long = (BATCHES + 1) * BATCH_BYTES + 7
    start = rng.randrange(size - long)
    cuts = {0, size, start, start + long, *(rng.randrange(size) for _ in range(60))}
    cuts |= {ALIGN * rng.randrange(size // ALIGN) for _ in range(20)}
    bounds = sorted(c for c in cuts if not start < c < start + long)
    pieces = [(a, rng.randbytes(b - a)) for a, b in itertools.pairwise(bounds)]
    runs = [pieces[i : i + 5] for i in range(0, len(pieces), 5)]
    rng.shuffle(runs)
    return [p for run in runs for p in run]


def _expected(writes: list[tuple[int, bytes]], size: int) -> bytes:
    out = bytearray(size)
    for at, data in writes:
        out[at : at + len(data)] = data
    return bytes(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_file_holds_every_write_whatever_the_offsets_and_order(tmp_path: Path, seed: int) -> None:
    size = 6 * BATCH_BYTES + 12345
    path = tmp_path / "out.bin"
    path.write_bytes(b"")
    os.truncate(path, size)
    writes = _writes(seed, size)
    fd = os.open(path, os.O_WRONLY)
    w = DirectWrites(str(path), fd)
    direct = w.direct
    try:
        for at, data in writes:
            w.write_at(at, memoryview(data))
        w.close()
    finally:
        os.close(fd)
    assert path.read_bytes() == _expected(writes, size)
    if direct:  # where the filesystem takes direct writes (ext4, XFS, recent tmpfs), they were used
        assert w.direct_bytes > size // 2


def test_switched_off_every_byte_goes_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTCONV_DIRECT_IO", "0")
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(3 * BATCH_BYTES))
    data = np.random.default_rng(3).bytes(2 * BATCH_BYTES + 5)
    patch = LocalPatch(str(path), direct=True)
    patch.write_at(ALIGN + 1, data)
    patch.close()
    assert patch.direct_bytes == 0
    assert path.read_bytes()[ALIGN + 1 : ALIGN + 1 + len(data)] == data


def test_a_filesystem_that_refuses_a_direct_write_gets_plain_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some filesystems take the O_DIRECT open and answer EINVAL to the write: that write and every
    later one go through the page cache, nothing lost."""
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(3 * BATCH_BYTES))
    fd = os.open(path, os.O_WRONLY)
    w = DirectWrites(str(path), fd)
    if not w.direct:
        pytest.skip("this filesystem refuses O_DIRECT at the open already")
    refused = w._back.dfd
    pwrite = os.pwrite

    def einval_for_direct(f: int, data: memoryview, offset: int) -> int:
        if f == refused:
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwrite(f, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", einval_for_direct)
    data = np.random.default_rng(4).bytes(BATCH_BYTES + 3 * ALIGN)
    try:
        w.write_at(5, memoryview(data))
        w.write_at(5 + len(data), memoryview(data))
        w.close()
    finally:
        os.close(fd)
    assert w.direct_bytes == 0 and not w.direct
    assert path.read_bytes()[5 : 5 + 2 * len(data)] == data + data


def test_a_failed_write_is_raised_typed_by_the_next_call_and_nothing_after_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that failed behind the caller (a full disk where nothing was reserved) surfaces as
    the storage error that names the file and says what to do, at the next write or the flush."""
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(4 * BATCH_BYTES))
    patch = LocalPatch(str(path), direct=True)
    pwrite, calls = os.pwrite, []

    def full_after_one(f: int, data: memoryview, offset: int) -> int:
        calls.append(offset)
        if offset >= BATCH_BYTES:
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(f, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", full_after_one)
    ones = b"\1" * BATCH_BYTES
    with pytest.raises(StorageError) as raised:
        for i in range(4):
            patch.write_at(i * BATCH_BYTES, ones)
        patch.flush()
    assert raised.value.details.get("errno") == errno.ENOSPC and "free disk space" in (raised.value.hint or "")
    assert str(path) in raised.value.message
    with pytest.raises(StorageError):
        patch.close()  # the failure stays; the descriptors are let go all the same
    monkeypatch.undo()
    content = path.read_bytes()
    assert content[:BATCH_BYTES] == ones and content[2 * BATCH_BYTES :] == bytes(2 * BATCH_BYTES)


def test_a_rewrite_waits_for_the_write_in_flight_it_overlaps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers in flight together land in any order; one holding bytes that an earlier buffer
    still being written also holds waits for it, so the later bytes win as in order."""
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(2 * BATCH_BYTES))
    pwrite = os.pwrite

    def slow_first_value(f: int, data: memoryview, offset: int) -> int:
        if bytes(data[:1]) == b"\1":
            time.sleep(0.5)  # the other writer is free meanwhile
        return pwrite(f, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", slow_first_value)
    fd = os.open(path, os.O_WRONLY)
    try:
        w = DirectWrites(str(path), fd)
        w.write_at(0, memoryview(b"\1" * BATCH_BYTES))
        w.write_at(ALIGN, memoryview(b"\2" * ALIGN))  # not adjacent: the first buffer goes out now
        w.close()
    finally:
        os.close(fd)
    monkeypatch.undo()
    content = path.read_bytes()
    assert content[ALIGN : 2 * ALIGN] == b"\2" * ALIGN
    assert content[:ALIGN] == b"\1" * ALIGN and content[2 * ALIGN : BATCH_BYTES] == b"\1" * (BATCH_BYTES - 2 * ALIGN)


@pytest.mark.parametrize("n", [0, 1, direct_io.GIL_FREE_COPY_BYTES - 1, direct_io.GIL_FREE_COPY_BYTES, 3 << 20])
def test_copy_bytes_copies_from_read_only_bytes_into_a_slice(n: int) -> None:
    src = np.random.default_rng(n).bytes(n)
    dst = bytearray(n + 8)
    direct_io.copy_bytes(memoryview(dst)[5 : 5 + n], memoryview(src))
    assert dst[:5] == bytes(5) and dst[5 : 5 + n] == src and dst[5 + n :] == bytes(3)


def test_copy_bytes_copies_a_strided_view_as_a_slice_assignment_does() -> None:
    src = np.frombuffer(np.random.default_rng(9).bytes(4 * direct_io.GIL_FREE_COPY_BYTES), np.uint8)[::2]
    dst = bytearray(len(src))
    direct_io.copy_bytes(memoryview(dst), memoryview(src))
    assert dst == src.tobytes()


def test_abandoned_writes_are_dropped_without_a_word(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(2 * BATCH_BYTES))
    patch = LocalPatch(str(path), direct=True)
    patch.write_at(0, b"\1" * 1000)  # still in its staging buffer
    patch.abandon()
    patch.abandon()  # twice is fine
    assert path.read_bytes() == bytes(2 * BATCH_BYTES)


@pytest.mark.parametrize("to", ["cs-h5", "safetensors", "torch", "tf"])
def test_an_output_is_the_same_file_with_direct_writes_or_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str
) -> None:
    from safetensors.numpy import save_file

    from ckptconv.engine.convert import convert

    rng = np.random.default_rng(5)
    source = tmp_path / "in.safetensors"
    sizes = [3, 1 << 20, 1234567, 5, 1 << 21]
    save_file({f"w{i}": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(sizes)}, str(source))
    trees = []
    for setting in ("0", "1"):
        monkeypatch.setenv("CKPTCONV_DIRECT_IO", setting)
        target = tmp_path / setting / ("model.mdl" if to == "cs-h5" else "model")
        convert(str(source), str(target), to=to)
        files = sorted(p for p in target.parent.rglob("*") if p.is_file() and "manifest" not in p.name)
        trees.append({str(p.relative_to(target.parent)): p.read_bytes() for p in files})
    assert trees[0] == trees[1] and trees[0]


def test_a_write_after_close_is_refused_and_lands_nowhere(tmp_path: Path) -> None:
    """The closed descriptor's number may already name another file: the write fails (EBADF), as a
    plain write to a closed descriptor does, instead of landing there."""
    mine, other = tmp_path / "mine.bin", tmp_path / "other.bin"
    mine.write_bytes(bytes(16))
    other.write_bytes(bytes(16))
    patch = LocalPatch(str(mine), direct=True)
    patch.close()
    reused = os.open(other, os.O_WRONLY)
    try:
        with pytest.raises(StorageError) as raised:
            patch.write_at(0, b"LATE")
        assert raised.value.details.get("errno") == errno.EBADF
    finally:
        os.close(reused)
    assert other.read_bytes() == bytes(16) and mine.read_bytes() == bytes(16)


def writer_threads() -> int:
    return sum(t.name == "ckptconv-direct-writes" for t in threading.enumerate())


def test_a_writer_dropped_without_commit_lets_go_of_its_thread_and_descriptors(tmp_path: Path) -> None:
    from ckptconv.storage.local import LocalStorage

    def open_files() -> list[str]:
        found = []
        for n in os.listdir("/proc/self/fd"):
            try:
                found.append(os.readlink(f"/proc/self/fd/{n}"))
            except FileNotFoundError:  # the listing's own descriptor, gone since
                pass
        return found

    before = writer_threads()
    w = LocalStorage().open_writer(str(tmp_path / "dropped.bin"))
    size = BATCH_BYTES + (2 << 20)  # a full staging buffer: the writers' threads have started
    w.preallocate(size)
    for _ in range(size >> 20):
        w.write(b"\2" * (1 << 20))
    tmp = w._tmp  # type: ignore[attr-defined]
    assert writer_threads() == before + WRITERS
    del w
    gc.collect()
    assert writer_threads() == before
    assert not any(tmp in path for path in open_files())


def test_a_writer_collected_on_its_own_thread_holding_its_lock_still_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cycle collector may free an abandoned front on one of its writer threads, while that
    thread holds the writer's lock; the finalizer must not wait there for the other thread, which
    needs that lock to finish its buffer."""
    monkeypatch.setattr(direct_io, "BATCH_BYTES", 64 << 10)
    pwrite, write = os.pwrite, direct_io._Writer._write
    dropped, collected = threading.Event(), threading.Event()

    def slow_second(f: int, data: memoryview, offset: int) -> int:
        if offset >= 1 << 20:
            time.sleep(0.3)  # the other writer is still busy when the first collects
        return pwrite(f, data, offset)

    def collecting(self: direct_io._Writer, batch: direct_io._Batch) -> None:
        write(self, batch)
        if batch.start == 1 and not collected.is_set():
            dropped.wait(5)
            with self.cond:  # as a collection triggered inside its with-block would
                gc.collect()
            collected.set()

    monkeypatch.setattr(direct_io.os, "pwrite", slow_second)
    monkeypatch.setattr(direct_io._Writer, "_write", collecting)
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(4 << 20))
    before = writer_threads()
    fd = os.open(path, os.O_WRONLY)
    gc.disable()
    try:
        w = DirectWrites(str(path), fd)
        for i in range(3):  # none adjacent: two buffers go out, on both threads
            w.write_at((i << 20) + 1, memoryview(bytes([i + 1]) * 1000))
        w.cycle = w  # type: ignore[attr-defined]  # only the cyclic collector frees it
        del w
        dropped.set()
        assert collected.wait(5)
        deadline = time.monotonic() + 5
        while writer_threads() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer_threads() == before
    finally:
        gc.enable()
        os.close(fd)


@pytest.mark.parametrize("to", ["cs-h5", "safetensors", "torch", "tf"])
def test_every_local_output_format_writes_its_values_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str
) -> None:
    """Announced by its size (cs-h5, safetensors, a TF data file of tensors) or as bulk data by the
    output set (a torch archive, whose size is not known before its first byte)."""
    from safetensors.numpy import save_file

    from ckptconv.engine.convert import convert

    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    written: list[int] = []
    stop = direct_io._Writer.stop

    def counting(self: direct_io._Writer, *, drop: bool) -> None:
        written.append(self.direct_bytes)
        stop(self, drop=drop)

    monkeypatch.setattr(direct_io._Writer, "stop", counting)
    rng = np.random.default_rng(7)
    source = tmp_path / "in.safetensors"
    save_file({f"w{i}": rng.standard_normal(1 << 21, dtype=np.float32) for i in range(3)}, str(source))
    convert(str(source), str(tmp_path / "out" / ("model.mdl" if to == "cs-h5" else "model")), to=to)
    assert sum(written) >= 2 * (1 << 23)  # most of the 24 MiB of values
