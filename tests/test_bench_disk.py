"""The benchmarks' disk baseline (bench/disk.py): the disk-alone copy is a real copy, byte for byte,
and a copy that failed fails the command instead of passing for a fast one; the device counters
move with the bytes a case moves."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from bench.disk import Disk, direct_copy_command, direct_io_works


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    if not direct_io_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    rng = random.Random(7)
    out = []
    # Sizes off the 4 KiB block and below dd's 16 MiB block: the last partial block is copied too.
    for i, size in enumerate((3 * 4096 + 5, (17 << 20) + 123, 1)):
        p = tmp_path / "src" / f"shard-{i} with 'quotes'.bin"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(rng.randbytes(size))
        out.append(p)
    return out


def test_the_disk_alone_copies_every_shard_byte_for_byte(tmp_path: Path, shards: list[Path]) -> None:
    dest = tmp_path / "dd out"
    subprocess.run(direct_copy_command(shards, dest), check=True)
    for p in shards:
        assert (dest / p.name).read_bytes() == p.read_bytes()


def test_a_copy_that_fails_fails_the_command(tmp_path: Path, shards: list[Path]) -> None:
    missing = tmp_path / "src" / "gone.bin"
    for files in ([missing, *shards], [*shards, missing]):
        done = subprocess.run(direct_copy_command(files, tmp_path / "dd"), capture_output=True)
        assert done.returncode != 0


def test_the_device_counters_see_a_direct_write(tmp_path: Path) -> None:
    disk = Disk(tmp_path)
    before = disk.counters()
    if before is None:
        pytest.skip("no /proc/diskstats line for this filesystem's device")
    nbytes = 8 << 20
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(nbytes))
    os.sync()
    before = disk.counters()
    if not direct_io_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    subprocess.run(direct_copy_command([src], tmp_path / "out"), check=True)
    use = disk.since(before)
    assert use is not None and use.written_bytes >= nbytes and 0 <= use.busy(1.0) <= 1
