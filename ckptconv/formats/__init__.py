"""Checkpoint formats: one TensorSource and one TensorSink per container format.

Which formats exist is :data:`~ckptconv.formats.registry.FORMATS`; ``source_class`` and
``sink_class`` are the only way the engine reaches a format's classes, and import its module on
first use so that listing formats costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

from ckptconv.core.errors import UnknownFormat, UnsupportedFormat
from ckptconv.formats.base import TensorSink, TensorSource
from ckptconv.formats.registry import FORMATS, FormatSpec
from ckptconv.storage.base import Storage


def _load(name: str, attr: str | None) -> Any:
    spec = FORMATS.get(name)
    if spec is None:
        raise UnknownFormat(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    if attr is None:
        raise UnsupportedFormat(f"format {name!r} cannot be used in this direction")
    try:
        module = importlib.import_module(spec.module)
    except ModuleNotFoundError as e:
        if e.name == spec.module:
            raise UnsupportedFormat(f"format {name!r} is not available in this build") from e
        raise
    return getattr(module, attr)


def source_class(name: str) -> type[TensorSource]:
    return _load(name, FORMATS[name].source if name in FORMATS else None)


def sink_class(name: str) -> type[TensorSink]:
    return _load(name, FORMATS[name].sink if name in FORMATS else None)


def target_exists(storage: Storage, target: str, fmt: str | None) -> bool:
    """Whether writing ``target`` would meet something already there: an object at the URI, objects
    under it (a directory or prefix target), or for a TF bundle (named by its prefix) its ``.index``.
    Conversions never overwrite; the API refuses such a target at submit and the engine again
    before writing (two submissions can race past the first check)."""
    if storage.exists(target) or any(True for _ in storage.list(target + "/")):
        return True
    spec = FORMATS.get(fmt) if fmt else None
    return spec is not None and any(storage.exists(target + s) for s in spec.prefix_suffixes)


__all__ = ["FORMATS", "FormatSpec", "sink_class", "source_class", "target_exists"]
