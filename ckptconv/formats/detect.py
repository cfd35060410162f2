"""Which container format a URI holds, and where a conversion's outputs go.

Detection looks at names first (cheap, and exact for the layouts the formats define) and falls back
to the first bytes of a file: the HDF5 signature, a zip header (PyTorch >= 1.6), a pickle protocol
byte (older PyTorch), or a safetensors header length followed by ``{`` (after any JSON whitespace).
"""

from __future__ import annotations

import posixpath
from typing import Any

from ckptconv.core.errors import ObjectNotFound, UnknownFormat, UnsupportedFormat
from ckptconv.core.uri import normalize_uri
from ckptconv.formats import FORMATS, source_class
from ckptconv.formats.base import TensorSource
from ckptconv.formats.safetensors_fmt import looks_like_header
from ckptconv.storage import open_storage
from ckptconv.storage.base import Storage

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"

_SUFFIXES: list[tuple[str, str]] = [
    (".safetensors.index.json", "safetensors"),
    (".bin.index.json", "torch"),
    (".safetensors", "safetensors"),
    (".mdl", "cs-h5"),
    (".h5", "cs-h5"),
    (".hdf5", "cs-h5"),
    (".bin", "torch"),
    (".pt", "torch"),
    (".pth", "torch"),
    (".ckpt", "torch"),
    (".index", "tf"),
    (".metadata", "dcp"),
]

# Inside a directory or prefix: the file that identifies a format, most specific first.
_MARKERS: list[tuple[str, str]] = [
    ("model.safetensors.index.json", "safetensors"),
    ("pytorch_model.bin.index.json", "torch"),
    ("__METADATA__", "cs-s3"),
    (".metadata", "dcp"),
]


def basename(uri: str) -> str:
    return posixpath.basename(uri.rstrip("/"))


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
    if storage.exists(uri):
        by_name = format_from_name(uri)
        head = storage.read_range(uri, 0, min(64, storage.stat(uri).size))
        by_magic = _format_from_magic(head)
        if by_magic and by_name and by_name != by_magic and by_name not in ("tf", "dcp"):
            # A name can lie (a .bin that is safetensors); the bytes cannot. A TF index and a DCP
            # .metadata name a whole checkpoint whose first file alone says little.
            return by_magic
        if by_name:
            return by_name
        if by_magic:
            return by_magic
        raise UnsupportedFormat(f"cannot tell the format of {uri}")
    prefix = uri.rstrip("/") + "/"
    names = [info.uri[len(prefix) :] for info in storage.list(prefix)]
    if not names:
        # A TF bundle is named by its prefix: <prefix>.index beside <prefix>.data-*
        if storage.exists(uri + ".index"):
            return "tf"
        raise ObjectNotFound(f"nothing at {uri}")
    top = [n for n in names if "/" not in n]
    for marker, fmt in _MARKERS:
        if marker in top:
            return fmt
    kinds = {format_from_name(n) for n in top} - {None}
    if len(kinds) == 1:
        return kinds.pop()  # type: ignore[return-value]
    if not kinds and any(n.endswith(".__metadata__") or "/" in n for n in names):
        return "cs-s3"
    raise UnsupportedFormat(
        f"cannot tell the format of the directory {uri} (found {', '.join(sorted(top)[:8])})",
        hint="point at the checkpoint file or its index file, or name the format with --from",
    )


def _format_from_magic(head: bytes) -> str | None:
    if head.startswith(HDF5_MAGIC):
        return "cs-h5"
    if head.startswith(b"PK\x03\x04"):
        return "torch"
    if head[:1] == b"\x80" and len(head) > 1 and head[1] in (2, 3, 4, 5):
        return "torch"
    if looks_like_header(head):
        return "safetensors"
    return None


def target_format_from_name(uri: str) -> str | None:
    fmt = format_from_name(uri)
    return fmt if fmt in FORMATS else None


def open_source(uri: str, format: str | None = None, **options: Any) -> TensorSource:
    """Open the checkpoint at ``uri`` (format detected when not given). Reads metadata only."""
    storage = open_storage(uri)
    uri = normalize_uri(uri)
    fmt = check_format(format) if format else detect_source_format(storage, uri)
    cls = source_class(fmt)
    return cls(storage, uri, **{k: v for k, v in options.items() if v is not None})
