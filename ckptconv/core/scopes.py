"""URI scopes: which storage locations an API key may touch, and the canonical form URIs are checked in.

This is the one home of the confinement rules. The API checks a request's URIs with them (an early
403), key creation normalises prefixes with them, and the storage layer
(:mod:`ckptconv.storage.confined`) checks every URI a job reads, writes, lists or probes, including
URIs that come out of files (configs, index files, checkpoint indexes).

Rules:

- A prefix names a bucket or a directory and always ends with ``/`` (key creation appends it), so a
  prefix matches on segment boundaries: ``s3://b/team/`` covers ``s3://b/team/x`` but never
  ``s3://b/team2/x``, the object ``s3://b/team`` or the bucket ``s3://b-x/``.
- URIs are compared in canonical form: scheme in lowercase, ``file://`` URIs as plain paths,
  local paths normalised and absolute. A URI whose meaning could change between the check and the
  store is refused instead of normalised: ``.``/``..`` segments, empty segments inside an S3 key
  (``a//b``), backslashes, percent-encoded dots, slashes, backslashes or NULs (some S3-compatible
  stores and proxies decode them), control characters (NUL, newline, escape and the rest of C0, and
  DEL), and bucket names S3 would not accept (uppercase).
- Local paths are also resolved through symlinks: a link inside a prefix that points outside it
  does not grant what it points to.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.errors import Forbidden, InvalidRequest, PathEscape
from ckptconv.core.uri import local_path_of, scheme_of

# %2e '.', %2f '/', %5c '\', %00 NUL: decoded by some stores and proxies before the key is used.
_ENCODED = re.compile(r"%(2e|2f|5c|00)", re.IGNORECASE)
# C0 controls and DEL: legal in S3 keys and Linux file names, but a newline or an escape sequence in
# a URI forges lines in logs and terminals that print it, and no checkpoint needs one.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# The characters of S3 bucket names (lowercase letters, digits, dots and hyphens, at most 63): a
# bucket is compared as written, so a spelling a store might fold (uppercase) is refused.
_BUCKET = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")


def canonical_uri(uri: str) -> str:
    """The form of ``uri`` that scopes are checked against (and that jobs record).

    ``s3://bucket/key``: scheme lowercased, bucket validated, key otherwise kept as written (S3 keys
    are opaque). Local paths (plain or ``file://``) must be absolute (a worker's working directory is
    not the caller's) and are normalised. Other schemes and ambiguous spellings (see the module
    docstring) are refused.
    """
    if not isinstance(uri, str) or not uri:
        raise InvalidRequest(f"empty URI {uri!r}", hint="use s3://bucket/key or an absolute local path")
    if _CONTROL.search(uri):
        raise InvalidRequest(
            f"URI contains a control character: {uri!r}", hint="rename the object or file without control characters"
        )
    if "\\" in uri:
        raise PathEscape(f"URI contains a backslash: {uri!r}", uri=uri)
    if _ENCODED.search(uri):
        raise PathEscape(f"URI contains a percent-encoded '.', '/', '\\' or NUL: {uri!r}", uri=uri)
    scheme = scheme_of(uri)
    if scheme == "s3":
        rest = uri[len("s3://") :]
        bucket, _, key = rest.partition("/")
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise InvalidRequest(
                f"invalid S3 bucket name {bucket!r} in {uri!r}",
                hint="bucket names are lowercase letters, digits, dots and hyphens",
            )
        segments = key.split("/")
        for i, seg in enumerate(segments):
            if seg in (".", ".."):
                raise PathEscape(f"URI has a {seg!r} segment: {uri!r}", uri=uri)
            if seg == "" and 0 < i < len(segments) - 1:
                raise PathEscape(f"URI has an empty segment ('//'): {uri!r}", uri=uri)
        if key.startswith("/"):
            raise PathEscape(f"URI has an empty segment ('//'): {uri!r}", uri=uri)
        return f"s3://{bucket}/{key}"
    if scheme == "file":
        path = local_path_of(uri)
        if not os.path.isabs(path):
            raise InvalidRequest(
                f"relative path {uri!r}: the service needs absolute paths (or s3:// URIs)",
                hint="write local locations as /absolute/path or file:///absolute/path",
            )
        if ".." in path.split("/"):
            raise PathEscape(f"path has a '..' segment: {uri!r}", uri=uri)
        normal = os.path.normpath(path)
        if normal.startswith("//"):  # POSIX leaves a leading '//' implementation-defined
            normal = "/" + normal.lstrip("/")
        return normal + "/" if path.endswith("/") and normal != "/" else normal
    raise InvalidRequest(
        f"unsupported URI scheme {scheme!r} in {uri!r}", hint="use s3://bucket/key or an absolute local path"
    )


def canonical_prefix(prefix: str) -> str:
    """A key's prefix in canonical form, ending with ``/`` so that it matches whole segments only."""
    if not isinstance(prefix, str) or not prefix.strip():
        raise InvalidRequest(
            "an empty prefix would grant every location",
            hint="name a bucket (s3://bucket/), an S3 prefix (s3://bucket/team/) or a directory (/data/team/)",
        )
    canonical = canonical_uri(prefix)
    return canonical if canonical.endswith("/") else canonical + "/"


@dataclass(frozen=True)
class Scopes:
    """The URI prefixes one caller may touch; ``prefixes=None`` means every location (development mode)."""

    prefixes: tuple[str, ...] | None
    _real: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, prefixes: Iterable[str] | None) -> Scopes:
        return cls(None if prefixes is None else tuple(canonical_prefix(p) for p in prefixes))

    @property
    def unrestricted(self) -> bool:
        return self.prefixes is None

    def to_record(self) -> list[str] | None:
        """What a job record stores (and :meth:`from_record` reads back)."""
        return None if self.prefixes is None else list(self.prefixes)

    @classmethod
    def from_record(cls, value: object) -> Scopes:
        """Scopes stored with a job; a record without any (written before scopes were stored) grants nothing."""
        if value is None:
            return UNRESTRICTED
        if isinstance(value, list | tuple) and all(isinstance(p, str) for p in value):
            return cls.of(value)
        return NOTHING

    def allows(self, uri: str) -> bool:
        """Whether ``uri`` lies under one of the prefixes. Ambiguous or malformed URIs are not allowed."""
        if self.prefixes is None:
            return True
        try:
            self.check(uri)
        except (Forbidden, InvalidRequest, PathEscape):
            return False
        return True

    def check(self, uri: str) -> str:
        """The canonical form of ``uri``; Forbidden unless it lies under one of the prefixes.

        Malformed and ambiguous URIs raise InvalidRequest / PathEscape (see :func:`canonical_uri`).
        """
        if self.prefixes is None:
            return uri
        if scheme_of(uri) == "file" and not os.path.isabs(local_path_of(uri)):
            raise self._forbidden(uri, "a relative path is resolved on the worker, outside every prefix")
        return self.check_canonical(canonical_uri(uri))

    def check_canonical(self, canonical: str) -> str:
        """:meth:`check` of a URI already in canonical form (as :func:`canonical_uri` returns it)."""
        if self.prefixes is None:
            return canonical
        # str.startswith with a tuple: any() over a generator cost more than the comparisons (hot path).
        if not canonical.startswith(self.prefixes):
            raise self._forbidden(canonical)
        if canonical.startswith("/"):  # a local path
            real = resolved_path(canonical)
            if not (real + "/").startswith(tuple(map(self._realpath, self.prefixes))):
                raise self._forbidden(canonical, f"it resolves through a symlink to {real}")
        return canonical

    def listing_starts(self, prefix: str) -> list[str]:
        """What to list for a listing of ``prefix`` (a plain string prefix) that stays in scope.

        ``[prefix]`` when it lies under a granted prefix; when it starts above some, those granted
        prefixes (spelled as ``prefix`` is spelled); Forbidden when it reaches none.
        """
        if self.prefixes is None:
            return [prefix]
        if scheme_of(prefix) == "file" and not os.path.isabs(local_path_of(prefix)):
            raise self._forbidden(prefix, "a relative path is resolved on the worker, outside every prefix")
        canonical = canonical_uri(prefix)
        if canonical.startswith(self.prefixes):
            return [prefix]
        # Local listings keep the caller's spelling (file:// or a path) so results start with its prefix.
        local = scheme_of(canonical) == "file"
        below = [prefix + p[len(canonical) :] if local else p for p in self.prefixes if p.startswith(canonical)]
        if not below:
            raise self._forbidden(canonical)
        return below

    def _realpath(self, prefix: str) -> str:
        real = self._real.get(prefix)
        if real is None:
            if scheme_of(prefix) != "file":
                real = prefix
            else:
                real = os.path.realpath(prefix)
                real = real if real.endswith("/") else real + "/"
            self._real[prefix] = real
        return real

    def _forbidden(self, uri: str, why: str | None = None) -> Forbidden:
        return Forbidden(
            f"this API key may not access {uri}" + (f" ({why})" if why else ""),
            hint="ask for a key whose prefixes cover this location; this key allows: "
            + (", ".join(self.prefixes or ()) or "(nothing)"),
            uri=uri,
        )


def resolved_path(path: str) -> str:
    """``os.path.realpath(path)`` for a canonical local path (absolute, normalised).

    The same answer for less: realpath looks at every component, even below one that does not
    exist, where nothing can be (a new target is usually a few of those). Here the first component
    found missing ends the walk, and a symbolic link anywhere hands the whole path to realpath.
    """
    resolved = ""
    names = path.split("/")
    for i, name in enumerate(names):
        if not name:
            continue
        candidate = resolved + "/" + name
        try:
            st = os.lstat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            # Nothing below a missing entry (or below a file) exists, so nothing there is a link.
            return "/".join([candidate, *(n for n in names[i + 1 :] if n)])
        except OSError:
            pass  # cannot be looked at: as realpath, taken as no link
        else:
            if stat.S_ISLNK(st.st_mode):
                return os.path.realpath(path)
        resolved = candidate
    return resolved or "/"


UNRESTRICTED = Scopes(None)
NOTHING = Scopes(())


def record_scopes(doc: Mapping[str, Any]) -> Scopes:
    """The scopes a job record or a dry-run payload carries (JSON in a record; ``None``: every location).

    One written without scopes (by an older API) grants nothing: confinement fails closed.
    """
    if "scopes" not in doc:
        return NOTHING
    value = doc["scopes"]
    return Scopes.from_record(json.loads(value) if isinstance(value, str) else value)
