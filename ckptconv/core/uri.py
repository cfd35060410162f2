"""URI parsing and key confinement shared by every storage backend.

ckptconv names bytes with two kinds of URI: ``s3://bucket/key`` and local paths (absolute,
relative, or ``file://`` URIs). This module knows their syntax and nothing else; it imports no
backend.

Confinement: names read from untrusted input (shard names in an index file, keys of the
object-per-key layout) are joined under a base URI only through :func:`confine` /
``Storage.join``, which refuses any name that could address something outside the base.
"""

from __future__ import annotations

import os
import re

from ckptconv.core.errors import InvalidRequest, PathEscape

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme_of(uri: str) -> str:
    """``"s3"``, ``"file"`` for local paths and ``file://`` URIs, or the URI's other scheme (lowercase)."""
    m = _SCHEME.match(uri)
    if m is None:
        return "file"
    return m.group(1).lower()


def is_s3(uri: str) -> bool:
    return scheme_of(uri) == "s3"


def is_local(uri: str) -> bool:
    return scheme_of(uri) == "file"


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/key`` -> ``("bucket", "some/key")``; the key may be empty.

    The key is taken verbatim (S3 keys are opaque strings: no normalisation, no percent-decoding).
    """
    if not is_s3(uri):
        raise InvalidRequest(f"not an s3:// URI: {uri!r}", hint="write S3 locations as s3://bucket/key")
    rest = uri[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise InvalidRequest(f"s3 URI without a bucket: {uri!r}", hint="write S3 locations as s3://bucket/key")
    return bucket, key


def s3_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def local_path_of(uri: str) -> str:
    """The filesystem path a local URI names.

    ``file://`` URIs are read literally (``file:///data/a b`` is the path ``/data/a b``): no
    percent-decoding, so that URIs built by joining names and cutting suffixes compose without
    double encoding. Only ``file:///path`` and ``file://localhost/path`` are accepted.
    """
    if not is_local(uri):
        raise InvalidRequest(f"not a local path: {uri!r}")
    if not _SCHEME.match(uri):
        return uri
    rest = uri[len("file://") :]
    host, slash, path = rest.partition("/")
    if host not in ("", "localhost"):
        raise InvalidRequest(
            f"file URI names another host: {uri!r}",
            hint="use file:///absolute/path (or a plain path) for local files",
        )
    return slash + path


def check_relative(name: str) -> list[str]:
    """Validate a relative key or path and return its ``/``-separated segments.

    Refused with :class:`~ckptconv.core.errors.PathEscape`: the empty name, absolute names, empty
    segments (``a//b``, a trailing ``/``), ``.`` and ``..`` segments, backslashes (a separator on
    Windows and for some tools) and NUL bytes. ``.`` is refused although harmless on S3 because on
    a filesystem ``a/./b`` and ``a/b`` are the same file while on S3 they are two keys.
    """
    if not isinstance(name, str) or not name:
        raise PathEscape(f"empty name {name!r}", name=name)
    if "\x00" in name:
        raise PathEscape(f"name contains a NUL byte: {name!r}", name=name)
    if "\\" in name:
        raise PathEscape(f"name contains a backslash: {name!r}", name=name)
    if name.startswith("/"):
        raise PathEscape(f"absolute name {name!r}", name=name)
    segments = name.split("/")
    for seg in segments:
        if seg in ("", ".", ".."):
            raise PathEscape(f"name {name!r} has a {seg or 'empty'!r} segment", name=name)
    return segments


def confine(base: str, relative: str) -> str:
    """``base`` + ``/`` + ``relative``, after checking that ``relative`` stays below ``base``.

    Works for every URI form (``s3://``, ``file://``, plain paths); ``relative`` may contain
    ``/`` separators. Raises :class:`~ckptconv.core.errors.PathEscape` for names :func:`check_relative`
    refuses.
    """
    check_relative(relative)
    if base == "" or base.endswith("/"):
        return base + relative
    return base + "/" + relative


def join(base: str, *parts: str) -> str:
    """Join several confined parts under ``base`` (each part is checked on its own)."""
    out = base
    for part in parts:
        out = confine(out, part)
    return out


def basename(uri: str) -> str:
    """The last name in ``uri``, trailing slashes ignored: ``s3://b/run/ckpt/`` -> ``ckpt``.

    A bucket root names its bucket (``s3://b`` -> ``b``); ``/`` and ``""`` have no name (``""``).
    """
    return uri.rstrip("/").rpartition("/")[2]


def parent(uri: str) -> str:
    """The directory or S3 prefix holding ``uri``, trailing slashes ignored, with none of its own.

    ``s3://b/run/ckpt`` -> ``s3://b/run``; ``s3://b/ckpt`` -> ``s3://b``; ``/data/ckpt`` ->
    ``/data``; ``/ckpt`` -> ``/``; ``file:///ckpt`` -> ``file:///``; a bare name ``ckpt`` -> ``.``.
    A bucket root has no parent: :class:`~ckptconv.core.errors.InvalidRequest`.
    """
    trimmed = uri.rstrip("/")
    if is_s3(uri):
        bucket, key = split_s3(trimmed)
        if not key:
            raise InvalidRequest(f"{uri} names a bucket, not an object", hint="use s3://bucket/some/key")
        head = key.rpartition("/")[0]
        return f"s3://{bucket}/{head}" if head else f"s3://{bucket}"
    scheme = _SCHEME.match(trimmed)
    prefix, path = "", trimmed
    if scheme is not None:  # file://[host]/path: keep the scheme and host, take the parent of the path
        host, slash, rest = trimmed[scheme.end() :].partition("/")
        prefix, path = trimmed[: scheme.end()] + host, slash + rest
    head, sep, _ = path.rpartition("/")
    if not sep:
        return prefix or "."
    return prefix + (head or "/")


def as_prefix(uri: str) -> str:
    """``uri`` as the prefix of what lies below it, with exactly one trailing slash:
    ``s3://b/run`` and ``s3://b/run//`` -> ``s3://b/run/`` (so a listing does not match ``run-2``)."""
    return uri.rstrip("/") + "/"


def normalize_uri(uri: str) -> str:
    """Local paths become absolute (staging and publishing compute siblings from them)."""
    if uri.startswith("s3://"):
        return uri
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    trailing = uri.endswith("/")
    path = os.path.abspath(uri)
    return path + "/" if trailing else path
