"""Runs a shipped conformance suite (ckptconv.testing) on S3: moto's real HTTP server, through the
``s3_bucket`` fixture of conftest.py."""

from __future__ import annotations

import pytest


class OnS3:
    """Mix in before a ``FormatTests`` subclass: the same tests, writing under an S3 prefix. The
    hostile corpus is local files, read once by the local class."""

    attack_dir = None

    @pytest.fixture
    def base_uri(self, s3_bucket: str) -> str:
        return f"s3://{s3_bucket}/area"
