"""Where a fanned-out run keeps its records in the staging area: the layout and each part's record."""

from __future__ import annotations

from typing import Any

from ckptconv.core.bounded import load_json
from ckptconv.core.errors import ObjectNotFound
from ckptconv.engine.staging import _Layout
from ckptconv.storage.base import Storage

FANOUT_DIR = ".fanout"


def _doc_uri(layout: _Layout) -> str:
    return layout.storage.join(layout.staging, FANOUT_DIR, "layout.json")


def _part_uri(layout: _Layout, index: int) -> str:
    return layout.storage.join(layout.staging, FANOUT_DIR, f"part-{index:05d}.json")


def _gaps_uri(layout: _Layout, index: int) -> str:
    return layout.storage.join(layout.staging, FANOUT_DIR, f"gaps-{index:05d}.bin")


def _read_doc(storage: Storage, uri: str) -> dict[str, Any] | None:
    try:
        return load_json(storage.read_all(uri), what=uri)
    except ObjectNotFound:
        return None
