"""Output digests (BLAKE3) and the block digest: hashed out of order as parts go out, equal to what
the documented command prints; entries of earlier versions (sha256) still check."""

from __future__ import annotations

import io
import os
import shutil
import subprocess

import blake3
import pytest

from ckptconv.storage.digests import (
    ALGORITHM,
    BlockHasher,
    WrittenBlocks,
    combine,
    digest_facts,
    entry_digests,
    file_digests,
    holds_output,
)

BLOCK = 1 << 16


@pytest.mark.parametrize("size", [0, 1, BLOCK, 5 * BLOCK, 5 * BLOCK + 123])
def test_blocks_hashed_in_any_order_give_the_digest_of_one_read(size):
    data = os.urandom(size)
    hasher = BlockHasher(BLOCK)
    # Parts of two blocks sent last-first, as concurrent uploads may finish.
    for start in reversed(range(0, size, 2 * BLOCK)):
        hasher.add(start, data[start : start + 2 * BLOCK])
    whole, blocks = file_digests(io.BytesIO(data), BLOCK)
    assert ALGORITHM == "blake3" and whole == blake3.blake3(data).hexdigest()
    assert hasher.digest(size) == blocks
    expected = [blake3.blake3(data[i : i + BLOCK]).hexdigest() for i in range(0, size, BLOCK)]
    assert blocks == combine(expected) == blake3.blake3("".join(h + "\n" for h in expected).encode()).hexdigest()
    assert hasher.to_dict(size) == {"block_size": BLOCK, "blake3": blocks}


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
    assert digest == {"block_size": BLOCK, "blake3": file_digests(io.BytesIO(bytes(data)), BLOCK)[1]}


def test_a_block_never_hashed_is_an_error_not_a_digest():
    hasher = BlockHasher(BLOCK)
    hasher.add(0, b"x" * BLOCK)
    hasher.add(2 * BLOCK, b"y" * 10)
    with pytest.raises(ValueError, match="never hashed"):
        hasher.digest(2 * BLOCK + 10)
    with pytest.raises(ValueError, match="boundary"):
        hasher.add(5, b"z")


@pytest.mark.skipif(shutil.which("split") is None, reason="coreutils split is not installed")
@pytest.mark.parametrize("algorithm, tool", [("blake3", "b3sum"), ("sha256", "sha256sum")])
def test_the_documented_coreutils_command_prints_the_block_digest(tmp_path, algorithm, tool):
    """b3sum (Debian package b3sum) for this version's entries, sha256sum for an earlier version's."""
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")
    data = os.urandom(3 * BLOCK + 77)
    path = tmp_path / "model.mdl"
    path.write_bytes(data)
    out = subprocess.run(
        f"split -b {BLOCK} --filter={tool} {path} | cut -c1-64 | {tool}",
        shell=True,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[0]
    assert out == file_digests(io.BytesIO(data), BLOCK, algorithm)[1]


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_an_output_entry_is_held_by_its_digest_or_its_block_digest(algorithm):
    """Entries of this version (blake3) and of earlier ones (sha256, sha256_blocks) alike."""
    data = os.urandom(10_000)
    whole, blocks = file_digests(io.BytesIO(data), 4096, algorithm)
    by_whole = {"size": len(data), **digest_facts(whole, None, algorithm)}
    by_blocks = {"size": len(data), **digest_facts(None, {"block_size": 4096, algorithm: blocks}, algorithm)}
    assert holds_output(data, by_whole) and holds_output(data, by_blocks)
    changed = data[:-1] + bytes([data[-1] ^ 1])
    assert not holds_output(changed, by_whole) and not holds_output(changed, by_blocks)
    assert not holds_output(data[:-1], by_whole)
    assert not holds_output(data, {"size": len(data), algorithm: None})  # nothing to compare: not held
    assert not holds_output(data, {"size": len(data)})


def test_an_entry_names_its_hash_by_its_keys():
    data = os.urandom(5000)
    whole = blake3.blake3(data).hexdigest()
    assert digest_facts(whole, None) == {"blake3": whole}
    assert entry_digests({"uri": "x", "size": 5000, "blake3": whole}) == ("blake3", whole, None)
    # A manifest written before BLAKE3: its sha256 is read as sha256, never taken for a BLAKE3.
    old = {"uri": "x", "size": 5000, "sha256": None, "sha256_blocks": {"block_size": 4096, "sha256": "ab" * 32}}
    assert entry_digests(old) == ("sha256", None, {"block_size": 4096, "sha256": "ab" * 32})
    assert not holds_output(data, {"size": 5000, "sha256": whole})
    with pytest.raises(ValueError, match="names none"):
        entry_digests({"uri": "x", "size": 1, "md5": "00"})


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
