"""Confined storage: every URI a job touches is checked against its owner's prefixes, here.

A job names URIs in its request, but also reaches URIs that come out of files: a config's
``checkpoint_root``, entries of ``checkpoints_index.yaml``, a 1.x config's
``cerebras.save_iter_state_path``, shard maps and checkpoint indexes, staging and mirror paths.
Checking request fields one by one cannot cover those, so the check sits where every byte passes:
while a scope is active, :func:`ckptconv.storage.open_storage` hands out a
:class:`ConfinedStorage` that checks each URI (reads, writes, ``exists``/``stat`` probes,
listings, deletes, publishes, local paths) with :class:`ckptconv.core.scopes.Scopes` before the
backend sees it, and answers :class:`~ckptconv.core.errors.Forbidden` otherwise.

Where the scope comes from:

- ``with scoped(scopes): ...`` sets it for the code inside (a context variable: each thread of the
  worker's thread pool and each task has its own);
- :func:`set_default_scopes` sets what applies outside any ``scoped`` block in this process. Worker
  processes set it to *nothing* when they start, so storage opened outside a job's scope (a
  helper thread that did not inherit the context, say) fails closed instead of reaching everything.

The CLI and the API process set no scope: they act with the rights of whoever runs them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from ckptconv.core.scopes import Scopes
from ckptconv.storage.base import BLOCK_SIZE, STREAM_PART_SIZE, ObjectInfo, Storage, Writer
from ckptconv.storage.digests import ALGORITHM
from ckptconv.storage.pinned import if_match

_scopes: contextvars.ContextVar[Scopes | None] = contextvars.ContextVar("ckptconv_storage_scopes", default=None)
_default: Scopes | None = None


def set_default_scopes(scopes: Scopes | None) -> None:
    """Scopes for this process outside any :func:`scoped` block (None: unconfined)."""
    global _default
    _default = scopes


def current_scopes() -> Scopes | None:
    """The scopes storage opened now is confined to (None: unconfined)."""
    scopes = _scopes.get()
    return scopes if scopes is not None else _default


@contextlib.contextmanager
def scoped(scopes: Scopes) -> Iterator[None]:
    """Confine every storage opened inside the block (in this context) to ``scopes``."""
    token = _scopes.set(scopes)
    try:
        yield
    finally:
        _scopes.reset(token)


def confine_storage(storage: Storage) -> Storage:
    """``storage`` as the current scopes allow it: wrapped in :class:`ConfinedStorage` unless unconfined."""
    scopes = current_scopes()
    if scopes is None or scopes.unrestricted or isinstance(storage, ConfinedStorage):
        return storage
    return ConfinedStorage(storage, scopes)


class ConfinedStorage(Storage):
    """A backend whose every URI is checked against ``scopes`` first (see the module docstring).

    Listings may start above a granted prefix (``list("s3://b/te")`` with ``s3://b/team/`` granted):
    the granted prefixes below it are listed instead, so the store is never asked about anything
    outside the scopes.
    """

    def __init__(self, inner: Storage, scopes: Scopes) -> None:
        self.inner = inner
        self.scopes = scopes
        self.scheme = inner.scheme
        self.read_parallelism = inner.read_parallelism
        self.coalesce_bytes = inner.coalesce_bytes

    def _check(self, uri: str) -> None:
        self.scopes.check(uri)

    def stat(self, uri: str) -> ObjectInfo:
        self._check(uri)
        return self.inner.stat(uri)

    def exists(self, uri: str) -> bool:
        self._check(uri)
        return self.inner.exists(uri)

    # ``etag``: a version to read (ckptconv.storage.pinned).

    def read_range(self, uri: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        self._check(uri)
        return self.inner.read_range(uri, offset, length, **if_match(etag))

    def read_into(self, uri: str, offset: int, buf: bytearray | memoryview, *, etag: str | None = None) -> None:
        self._check(uri)
        self.inner.read_into(uri, offset, buf, **if_match(etag))

    def read_scattered(self, uri: str, offset: int, bufs: Sequence[memoryview], *, etag: str | None = None) -> None:
        self._check(uri)
        self.inner.read_scattered(uri, offset, bufs, **if_match(etag))

    def read_all(self, uri: str) -> bytes:
        self._check(uri)
        return self.inner.read_all(uri)

    def read_head(self, uri: str, length: int, *, offset: int = 0, etag: str | None = None) -> tuple[bytes, ObjectInfo]:
        self._check(uri)
        return self.inner.read_head(uri, length, offset=offset, **if_match(etag))

    def open_reader(self, uri: str) -> BinaryIO:
        self._check(uri)
        return self.inner.open_reader(uri)

    def digest(self, uri: str, algorithm: str = ALGORITHM, block_size: int = BLOCK_SIZE) -> str:
        self._check(uri)
        return self.inner.digest(uri, algorithm, block_size)

    def open_writer(
        self, uri: str, *, overwrite: bool = False, part_size: int = STREAM_PART_SIZE, **extra: Any
    ) -> Writer:
        # ``extra``: options of one backend (S3 user metadata), passed through unchanged.
        self._check(uri)
        return self.inner.open_writer(uri, overwrite=overwrite, part_size=part_size, **extra)

    def write_bytes(self, uri: str, data: bytes, *, overwrite: bool = False) -> ObjectInfo:
        self._check(uri)
        return self.inner.write_bytes(uri, data, overwrite=overwrite)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return iter(sorted(self._listed(prefix), key=lambda info: info.uri))

    def _listed(self, prefix: str) -> Iterator[ObjectInfo]:
        # A listing that starts above granted prefixes lists each of them instead (spelled as the
        # caller spelled its prefix), so the store is never asked for names outside the scopes.
        for start in self.scopes.listing_starts(prefix):
            yield from (info for info in self.inner.list(start) if self.scopes.allows(info.uri))

    def delete(self, uri: str) -> None:
        self._check(uri)
        self.inner.delete(uri)

    def delete_prefix(self, prefix: str) -> int:
        if self.scopes.allows(prefix):
            return self.inner.delete_prefix(prefix)
        # A prefix that starts above a granted one: delete only what the (confined) listing yields.
        n = 0
        for info in list(self.list(prefix)):
            self.inner.delete(info.uri)
            n += 1
        return n

    def publish(self, pairs: Iterable[tuple[str, str]], *, overwrite: bool = False, owner: str | None = None) -> None:
        pairs = list(pairs)
        for src, dst in pairs:
            self._check(src)
            self._check(dst)
        self.inner.publish(pairs, overwrite=overwrite, owner=owner)

    def local_path(self, uri: str) -> Path | None:
        # A local path lets a library (h5py, mmap) read the file directly: hand it out only in scope.
        self._check(uri)
        return self.inner.local_path(uri)

    def join(self, base: str, *parts: str) -> str:
        return self.inner.join(base, *parts)

    def backend(self, uri: str) -> Storage:
        self._check(uri)
        return self.inner.backend(uri)

    def __getattr__(self, name: str) -> Any:
        # Optional capabilities of one backend that take a URI first (S3 user metadata): checked too.
        if name not in _URI_CAPABILITIES:
            raise AttributeError(name)
        method = getattr(self.inner, name)  # AttributeError when this backend lacks it

        def checked(uri: str, *args: Any, **kwargs: Any) -> Any:
            self._check(uri)
            return method(uri, *args, **kwargs)

        return checked


_URI_CAPABILITIES = frozenset({"user_metadata", "described", "delete_owned"})
