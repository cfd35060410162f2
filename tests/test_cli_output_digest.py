"""What `ckptconv status` and `convert` print for an output's digest: its BLAKE3 (a sha256 in a
result of an earlier version), or the block digest of a file written out of order (a local or
streamed `.mdl`, a fanned-out S3 output), never "None"."""

from __future__ import annotations

from ckptconv.cli.service import output_digest


def test_an_output_with_a_digest_prints_it_named_by_its_hash() -> None:
    assert output_digest({"blake3": "ab" * 32}) == "blake3:" + "ab" * 32
    assert output_digest({"blake3": "ab" * 32}, width=16) == "blake3:" + "ab" * 8


def test_an_output_with_only_a_block_digest_prints_it_with_its_block_size() -> None:
    text = output_digest({"blake3": None, "blake3_blocks": {"blake3": "cd" * 32, "block_size": 16 * 1024 * 1024}})
    assert text.startswith("blake3-blocks:" + "cd" * 32) and "16" in text and "None" not in text


def test_a_result_of_an_earlier_version_prints_its_sha256() -> None:
    assert output_digest({"sha256": "ab" * 32, "sha256_blocks": None}) == "sha256:" + "ab" * 32
    text = output_digest({"sha256": None, "sha256_blocks": {"sha256": "cd" * 32, "block_size": 16 * 1024 * 1024}})
    assert text.startswith("sha256-blocks:" + "cd" * 32)


def test_an_output_without_digests_prints_a_dash() -> None:
    assert output_digest({"blake3": None}) == "blake3:-"
    assert output_digest({"uri": "x"}) == "blake3:-"
