"""Which container format a URI holds, and where a conversion's outputs go.

Every rule comes from the registry (:mod:`ckptconv.formats.registry`): a file's name (its
``suffixes`` and ``index_suffixes``, the longest ending wins), its first bytes (each format's
``sniff``: the HDF5 signature, a zip header or pickle protocol byte, a safetensors header length
followed by ``{``), the names under a directory or prefix (``markers``, then ``sniff_names``), and a
checkpoint named by a prefix of its files (``prefix_suffixes``: a TF bundle's ``.index``). When a
file's name and bytes disagree, the bytes win if the named format has a sniff to check them with.
"""

from __future__ import annotations

from typing import Any

from ckptconv.core.errors import ObjectNotFound, UnknownFormat, UnsupportedFormat
from ckptconv.core.uri import as_prefix, basename, normalize_uri
from ckptconv.formats import FORMATS, source_class
from ckptconv.formats.base import TensorSource, given_options
from ckptconv.formats.signatures import HEAD_BYTES
from ckptconv.storage import open_storage
from ckptconv.storage.base import Storage
from ckptconv.storage.pinned import pin_reads


def _by_length(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Longest first: ``x.safetensors.index.json`` is an index before it is any ``.json``."""
    return sorted(pairs, key=lambda p: -len(p[0]))


# (file-name ending, format) and (marker name, format), read from the registry.
_SUFFIXES = _by_length([(suffix, f.name) for f in FORMATS.values() for suffix in f.names])
_MARKERS = [(marker, f.name) for f in FORMATS.values() for marker in f.markers]


def format_from_name(uri: str) -> str | None:
    name = basename(uri).lower()
    for suffix, fmt in _SUFFIXES:
        if name.endswith(suffix):
            return fmt
    return None


def check_format(name: str) -> str:
    if name not in FORMATS:
        raise UnknownFormat(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}")
    return name


def detect_source_format(storage: Storage, uri: str) -> str:
    """The format of the checkpoint at ``uri`` (a file, an index file, a directory or a prefix)."""
    try:
        head: bytes | None = storage.read_head(uri, HEAD_BYTES)[0]  # one request, where there is a file
    except ObjectNotFound:
        head = None
    if head is not None:
        by_name = format_from_name(uri)
        by_magic = _format_from_magic(head)
        if by_magic and by_name and by_name != by_magic and FORMATS[by_name].sniff is not None:
            # A name can lie (a .bin that is safetensors); the bytes cannot. A format without a
            # sniff (a TF index, a DCP .metadata) names a whole checkpoint its first file says little of.
            return by_magic
        if by_name:
            return by_name
        if by_magic:
            return by_magic
        raise UnsupportedFormat(f"cannot tell the format of {uri}")
    prefix = as_prefix(uri)
    names = [info.uri[len(prefix) :] for info in storage.list(prefix)]
    if not names:
        # A checkpoint named by its prefix: a TF bundle's <prefix>.index beside <prefix>.data-*
        for f in FORMATS.values():
            if any(storage.exists(uri + suffix) for suffix in f.prefix_suffixes):
                return f.name
        raise ObjectNotFound(f"nothing at {uri}")
    top = [n for n in names if "/" not in n]
    for marker, fmt in _MARKERS:
        if marker in top:
            return fmt
    kinds = {format_from_name(n) for n in top} - {None}
    if len(kinds) == 1:
        return kinds.pop()  # type: ignore[return-value]
    if not kinds:
        for f in FORMATS.values():
            if f.sniff_names is not None and f.sniff_names(names):
                return f.name
    raise UnsupportedFormat(
        f"cannot tell the format of the directory {uri} (found {', '.join(sorted(top)[:8])})",
        hint="point at the checkpoint file or its index file, or name the format with --from",
    )


def _format_from_magic(head: bytes) -> str | None:
    return next((f.name for f in FORMATS.values() if f.sniff is not None and f.sniff(head)), None)


def target_format_from_name(uri: str) -> str | None:
    fmt = format_from_name(uri)
    return fmt if fmt in FORMATS else None


def open_source(uri: str, format: str | None = None, *, storage: Storage | None = None, **options: Any) -> TensorSource:
    """Open the checkpoint at ``uri`` (format detected when not given). Reads metadata only; every
    later read of one of its objects is of the version read first (ckptconv.storage.pinned).
    ``storage``: the pinned view to read through, when the checkpoint is part of a larger one."""
    storage = storage or pin_reads(open_storage(uri))
    uri = normalize_uri(uri)
    fmt = check_format(format) if format else detect_source_format(storage, uri)
    cls = source_class(fmt)
    return cls(storage, uri, **given_options(options))
