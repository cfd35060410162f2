"""Model-layout format names: ``hf``, ``cs-X.Y`` (``cs-auto`` as a source, ``cs-current`` as a
target) and the suffixes of the wrapper tables (``cs-X.Y-dpo``, ``cs-2.1-no-dpo``), parsed into
release-graph nodes (:mod:`ckptconv.engine.layouts.upgrades`)."""

from __future__ import annotations

import functools
import re

from ckptconv.core.errors import NoConversionPath
from ckptconv.core.releases import CURRENT_RELEASE, RELEASES
from ckptconv.engine.layouts.family import WRAPPER
from ckptconv.engine.layouts.registry import model_tables


def parse_format(fmt: str, *, side: str) -> str:
    """``hf`` | ``cs-X.Y`` (| ``cs-auto`` as source, ``cs-current`` as target) -> node name.

    ``cs-auto`` is returned unchanged (the caller resolves it from the checkpoint).
    """
    if fmt == "hf":
        return "hf"
    if fmt == "cs-current":
        if side == "source":
            raise NoConversionPath("cs-current names a target release; for a source use cs-auto or cs-X.Y")
        return f"cs-{CURRENT_RELEASE}"
    if fmt == "cs-auto":
        if side == "target":
            raise NoConversionPath("cs-auto detects a source release; for a target use cs-current or cs-X.Y")
        return fmt
    m = re.fullmatch(r"cs-(\d+)\.(\d+)", fmt)
    if not m or f"{int(m.group(1))}.{int(m.group(2))}" not in RELEASES:
        raise NoConversionPath(
            f"unknown model format {fmt!r}",
            hint=f"use hf, cs-auto (source), cs-current (target) or one of cs-{RELEASES[0]} ... cs-{RELEASES[-1]}",
        )
    return f"cs-{int(m.group(1))}.{int(m.group(2))}"


CANONICAL_RELEASE = "2.1"  # the key vocabulary family tables are written in (2.1 and newer)


@functools.cache
def _format_pattern() -> re.Pattern[str]:
    """A release node with an optional wrapper suffix: ``-<suffix>`` or ``-no-<suffix>`` for each
    wrapper table's ``format_suffix`` (``dpo``)."""
    suffixes = "|".join(re.escape(s) for s in wrapper_suffixes())
    return re.compile(rf"(cs-\d+\.\d+|cs-current|cs-auto|hf)(-no-(?:{suffixes})|-(?:{suffixes}))?")


def wrapper_suffixes() -> list[str]:
    """The format suffixes of the wrapper tables (``dpo``: ``cs-X.Y-dpo``, ``cs-2.1-no-dpo``)."""
    return sorted(str(t.raw["format_suffix"]) for t in model_tables().values() if t.kind == WRAPPER)


def split_format(fmt: str) -> tuple[str, str]:
    """``cs-2.9-dpo`` -> (``cs-2.9``, ``dpo``); ``cs-2.1-no-dpo`` -> (``cs-2.1``, ``no-dpo``);
    anything else -> (fmt, "")."""
    m = _format_pattern().fullmatch(fmt)
    if m is None or m.group(2) is None:
        return fmt, ""
    return m.group(1), m.group(2)[1:]


def parse_model_format(fmt: str, *, side: str) -> str:
    """Validate a model-layout format, wrapper suffixes included; returns the release node plus suffix."""
    base, wrapper = split_format(fmt)
    node = parse_format(base, side=side)
    if wrapper and node == "hf":
        wrappers = [t for t in model_tables().values() if t.kind == WRAPPER]
        hint = "; ".join(f"{t.name} formats are {', '.join(f for f in t.formats if f != 'hf')}" for t in wrappers)
        raise NoConversionPath(f"{fmt!r} is not a format", hint=hint)
    return f"{node}-{wrapper}" if wrapper else node


def release_of(node: str) -> str:
    return node.removeprefix("cs-")
