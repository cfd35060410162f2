"""What every reader that lists a checkpoint's entries when it opens answers the same way.

Such a reader (safetensors, torch pickles, Cerebras object-per-key checkpoints, legacy Cerebras H5
files) builds its entries in checkpoint order, an index of them by key and its tree spec while
opening, from metadata only; ``entries()``, ``spec`` and the lookup that starts every ``read``
are then the same three answers, kept here once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptconv.formats.base import Entry
    from ckptconv.formats.tree import TreeSpec


class ListedEntries:
    """Mixin for a reader that sets ``_entries`` (checkpoint order), ``_by_key`` (the same entries
    by key) and ``_spec`` while it opens. Listed before :class:`~ckptconv.formats.base.TensorSource`
    in a source's bases, so its ``entries`` and ``spec`` are the source's."""

    _entries: list[Entry]
    _by_key: dict[str, Entry]
    _spec: TreeSpec | None

    def entries(self) -> list[Entry]:
        # A copy: callers filter and reorder what they are given, never the reader's own list.
        return list(self._entries)

    @property
    def spec(self) -> TreeSpec | None:
        return self._spec

    def _listed(self, key: str) -> Entry:
        """The entry of ``key``; KeyError, as the source protocol asks of ``read``, for a key the
        checkpoint does not hold."""
        entry = self._by_key.get(key)
        if entry is None:
            raise KeyError(key)
        return entry
