"""The block digest: hashed out of order as parts go out, equal to what the documented command prints."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess

import pytest

from ckptconv.storage.digests import BlockHasher, WrittenBlocks, combine, file_digests, holds_output

BLOCK = 1 << 16


@pytest.mark.parametrize("size", [0, 1, BLOCK, 5 * BLOCK, 5 * BLOCK + 123])
def test_blocks_hashed_in_any_order_give_the_digest_of_one_read(size):
    data = os.urandom(size)
    hasher = BlockHasher(BLOCK)
    # Parts of two blocks sent last-first, as concurrent uploads may finish.
    for start in reversed(range(0, size, 2 * BLOCK)):
        hasher.add(start, data[start : start + 2 * BLOCK])
    whole, blocks = file_digests(io.BytesIO(data), BLOCK)
    assert whole == hashlib.sha256(data).hexdigest()
    assert hasher.digest(size) == blocks
    expected = [hashlib.sha256(data[i : i + BLOCK]).hexdigest() for i in range(0, size, BLOCK)]
    assert blocks == combine(expected)


def test_a_file_written_partly_unseen_gets_the_digest_of_one_read(tmp_path):
    """Runs reported as written are hashed; blocks someone else wrote into (or over) are read back."""
    size = 9 * BLOCK + 77
    data = bytearray(os.urandom(size))
    path = tmp_path / "f"
    path.write_bytes(bytes(size))
    written = WrittenBlocks(BLOCK)
    fd = os.open(path, os.O_RDWR)
    try:

        def write(offset, piece, *, seen=True):
            os.pwrite(fd, piece, offset)
            if seen:
                written.wrote(offset, piece)

        # Front to back in uneven runs, as chunks go out, and an unseen writer's bytes inside
        # block 3 (metadata between chunks).
        pos = 0
        for n in (1000, BLOCK, 3 * BLOCK - 1000, BLOCK // 2):
            write(pos, data[pos : pos + n])
            pos += n
        write(pos, data[pos : pos + 100], seen=False)
        pos += 100
        write(pos, data[pos:])
        assert written.hashed_bytes() == 8 * BLOCK  # block 3 and the last, short one are read back
        # A block written over by a reported write is read back too (its hash may be stale).
        data[7 * BLOCK + 5 : 7 * BLOCK + 9] = b"new!"
        write(7 * BLOCK + 5, data[7 * BLOCK + 5 : 7 * BLOCK + 9])
        assert written.hashed_bytes() == 7 * BLOCK
        digest = written.finish(fd, size)
    finally:
        os.close(fd)
    assert digest == {"block_size": BLOCK, "sha256": file_digests(io.BytesIO(bytes(data)), BLOCK)[1]}


def test_a_block_never_hashed_is_an_error_not_a_digest():
    hasher = BlockHasher(BLOCK)
    hasher.add(0, b"x" * BLOCK)
    hasher.add(2 * BLOCK, b"y" * 10)
    with pytest.raises(ValueError, match="never hashed"):
        hasher.digest(2 * BLOCK + 10)
    with pytest.raises(ValueError, match="boundary"):
        hasher.add(5, b"z")


@pytest.mark.skipif(shutil.which("split") is None, reason="coreutils split is not installed")
def test_the_documented_coreutils_command_prints_the_block_digest(tmp_path):
    data = os.urandom(3 * BLOCK + 77)
    path = tmp_path / "model.mdl"
    path.write_bytes(data)
    out = subprocess.run(
        f"split -b {BLOCK} --filter=sha256sum {path} | cut -c1-64 | sha256sum",
        shell=True,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[0]
    assert out == file_digests(io.BytesIO(data), BLOCK)[1]


def test_an_output_entry_is_held_by_its_sha256_or_its_block_digest():
    data = os.urandom(10_000)
    whole, blocks = file_digests(io.BytesIO(data), 4096)
    by_sha = {"size": len(data), "sha256": whole}
    by_blocks = {"size": len(data), "sha256": None, "sha256_blocks": {"block_size": 4096, "sha256": blocks}}
    assert holds_output(data, by_sha) and holds_output(data, by_blocks)
    changed = data[:-1] + bytes([data[-1] ^ 1])
    assert not holds_output(changed, by_sha) and not holds_output(changed, by_blocks)
    assert not holds_output(data[:-1], by_sha)
    assert not holds_output(data, {"size": len(data), "sha256": None})  # nothing to compare: not held


def test_a_writers_share_of_a_file_is_the_blocks_it_wrote_whole():
    # One part of a fan-out: the blocks it wrote whole (the file's last, shorter one too), merged by
    # the commit with the others' into the digest of one read.
    data = os.urandom(10 * 1024 + 300)
    first, second = WrittenBlocks(1024), WrittenBlocks(1024)
    for at in range(0, 4096, 100):  # pieces that do not follow the blocks
        first.wrote(at, data[at : min(at + 100, 4096)])
    first.wrote(4096, data[4096:4600])  # part of a block: someone else writes the rest
    for at in range(4096, len(data), 700):
        second.wrote(at, data[at : at + 700])
    assert sorted(first.hashed(len(data))) == [0, 1, 2, 3]
    assert sorted(second.hashed(len(data))) == list(range(4, 11))  # block 10: the last, 300 bytes
    assert 10 not in second.hashed(len(data) + 1)  # not the last block of a longer file: not whole
    merged = BlockHasher(1024)
    merged.merge(first.hashed(len(data)))
    merged.merge(second.hashed(len(data)))
    assert merged.digest(len(data)) == file_digests(io.BytesIO(data), 1024)[1]
