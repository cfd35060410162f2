"""Cerebras releases: the ones this build knows, and reading a release out of a version string.

A release is ``"MAJOR.MINOR"`` (``"2.4"``); a version is what a checkpoint or a config records
(``"2.4.0"``, ``"2.4.0+abc"``, ``b"2.4.0"``). Every place that reads a release goes through here.
"""

from __future__ import annotations

import re
from typing import Any

RELEASES = ["1.6", "1.7", "1.8", "1.9", "2.0", "2.1", "2.2", "2.3", "2.4", "2.5", "2.6", "2.7", "2.8", "2.9"]
CURRENT_RELEASE = RELEASES[-1]  # `cs-current`: the newest release this build supports

_VERSION = re.compile(r"(\d+)\.(\d+)")


def parse_release(version: Any) -> tuple[int, int] | None:
    """``(2, 10)`` from ``"2.10.0+abc"`` (str or bytes); None when it does not start MAJOR.MINOR."""
    if isinstance(version, bytes):
        version = version.decode("utf-8", "replace")
    m = _VERSION.match(str(version)) if isinstance(version, str | int | float) else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def release_name(version: Any) -> str | None:
    """``"2.10"`` from ``"2.10.0"``, whether this build knows 2.10 or not."""
    key = parse_release(version)
    return f"{key[0]}.{key[1]}" if key else None


def release_key(release: str) -> tuple[int, int]:
    """The sort key of a release this code names itself (``"2.4"`` -> ``(2, 4)``); ValueError otherwise."""
    key = parse_release(release)
    if key is None:
        raise ValueError(f"not a release: {release!r}")
    return key


def known_release(version: Any) -> str | None:
    """``"2.4.0"`` -> ``"2.4"``; None if it is not a release this build knows."""
    name = release_name(version)
    return name if name in RELEASES else None


def newer_than_known(version: Any) -> str | None:
    """``"2.10"`` for ``"2.10.0"`` when that release is newer than every release this build knows."""
    key = parse_release(version)
    return f"{key[0]}.{key[1]}" if key and key > release_key(CURRENT_RELEASE) else None


def release_range(lo: str, hi: str) -> list[str]:
    """The known releases from ``lo`` to ``hi``, both included, oldest first."""
    return [r for r in RELEASES if release_key(lo) <= release_key(r) <= release_key(hi)]
