"""Tied weights: following a link entry to the entry that holds its value.

A ``link`` entry aliases ``Entry.target`` (see :mod:`ckptconv.formats.base`); a target may itself
be a link. Every reader, sink, planner and comparison follows chains with :func:`link_root`, so a
chain that comes back on itself is refused the same way everywhere: :class:`~ckptconv.core.errors.LinkCycle`.
A chain that ends at a key the checkpoint does not hold is a dangling link, which each caller
reports in its own terms (a corrupt source, an unsupported sink input, a missing tensor).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ckptconv.core.errors import LinkCycle
from ckptconv.formats.base import Entry


def link_root(key: str, by_key: Mapping[str, Entry]) -> str:
    """Where the chain of links starting at ``key`` ends: ``key`` itself unless it is a link, else
    the first key along the chain that is not a link of ``by_key`` (absent from ``by_key`` when the
    chain dangles). :class:`~ckptconv.core.errors.LinkCycle` when the chain comes back to a key."""
    seen: list[str] = []
    entry = by_key.get(key)
    while entry is not None and entry.kind == "link":
        if key in seen:
            raise LinkCycle(
                f"link {seen[0]!r} leads back to itself: {' -> '.join([*seen, key])}", key=seen[0], keys=seen
            )
        seen.append(key)
        key = entry.target or ""
        entry = by_key.get(key)
    return key


def link_target(key: str, by_key: Mapping[str, Entry]) -> Entry | None:
    """The entry holding the value of ``key`` (links followed); None when the chain dangles."""
    return by_key.get(link_root(key, by_key))


def refuse_link_cycles(entries: Iterable[Entry]) -> None:
    """:class:`~ckptconv.core.errors.LinkCycle` when any link of ``entries`` is part of a cycle or
    leads into one; sources call it when opened, so listing a checkpoint already says so."""
    by_key = {e.key: e for e in entries}
    for e in by_key.values():
        if e.kind == "link":
            link_root(e.key, by_key)
