"""Reads of a checkpoint's objects that all see one version of each object.

A conversion reads an object many times: its header when the checkpoint is opened, then every
tensor with a ranged GET of its own, minutes or hours later. An object replaced in between (a
training job writing its latest checkpoint under the same key) would otherwise give the header of
one version and tensors of the next, possibly some of each, while the manifest names the first
version's ETag. :class:`PinnedReads` remembers the version of each object it met first (the ETag of
its first answer, or of a HEAD before a first read that has none) and makes every later read of it
conditional on that version (``If-Match``): a replaced object fails the read with a typed error
(``corrupt_checkpoint``: convert again once nothing writes the source), and nothing is published.

One view per opened checkpoint (``ckptconv.formats.detect.open_source``), shared by the threads
that read it; the storage instances behind it are shared by every job of the process and know
nothing of versions. :meth:`PinnedReads.pin` takes versions recorded elsewhere: the processes of a
fanned-out job read the versions the job's plan read. Only object stores have versions to pin;
local files are read as they are.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, BinaryIO

from ckptconv.storage.base import STREAM_PART_SIZE, ObjectInfo, RangeReader, Storage, Writer
from ckptconv.storage.ranges import replaced


def pin_reads(storage: Storage) -> Storage:
    """``storage`` whose reads keep to the first version of each object (object stores only)."""
    return PinnedReads(storage) if storage.scheme == "s3" and not isinstance(storage, PinnedReads) else storage


class PinnedReads(Storage):
    """``inner`` whose reads of an object are all of the version first met (see the module docstring)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.scheme = inner.scheme
        self.read_parallelism = inner.read_parallelism
        self.coalesce_bytes = inner.coalesce_bytes
        self._versions: dict[str, ObjectInfo] = {}
        self._lock = threading.Lock()

    # --- versions

    def pin(self, uri: str, etag: str) -> None:
        """Read ``uri`` as version ``etag`` from now on: an object already met as another version
        is refused at once."""
        with self._lock:
            known = self._versions.get(uri)
        if known is None:
            info = self.inner.stat(uri)
            known = self._remember(info)
        if known.etag != etag:
            raise replaced(uri, f"since the job first read it (its ETag is {known.etag}, not {etag})")

    def _remember(self, info: ObjectInfo) -> ObjectInfo:
        with self._lock:
            return self._versions.setdefault(info.uri, info)

    def _version(self, uri: str) -> ObjectInfo:
        with self._lock:
            known = self._versions.get(uri)
        return known if known is not None else self._remember(self.inner.stat(uri))

    def _etag(self, uri: str) -> dict[str, str]:
        etag = self._version(uri).etag
        return {"etag": etag} if etag else {}

    # --- reads, each of the version pinned

    def stat(self, uri: str) -> ObjectInfo:
        return self._version(uri)

    def read_range(self, uri: str, offset: int, length: int) -> bytes:
        return self.inner.read_range(uri, offset, length, **self._etag(uri))

    def read_into(self, uri: str, offset: int, buf: bytearray | memoryview) -> None:
        self.inner.read_into(uri, offset, buf, **self._etag(uri))

    def read_scattered(self, uri: str, offset: int, bufs: Sequence[memoryview]) -> None:
        self.inner.read_scattered(uri, offset, bufs, **self._etag(uri))

    def read_head(self, uri: str, length: int, *, offset: int = 0) -> tuple[bytes, ObjectInfo]:
        with self._lock:
            known = self._versions.get(uri)
        if known is None:  # the first answer tells the version
            data, info = self.inner.read_head(uri, length, offset=offset)
            first = self._remember(info)
            if first.etag != info.etag:  # two first reads raced and met two versions
                raise replaced(uri, f"while it was being read (ETag {first.etag}, then {info.etag})")
            return data, first
        version = {"etag": known.etag} if known.etag else {}
        data, _ = self.inner.read_head(uri, length, offset=offset, **version)
        return data, known

    def open_reader(self, uri: str) -> BinaryIO:
        # Read through this view, so that every block is of the pinned version.
        return io.BufferedReader(RangeReader(self, uri, self._version(uri).size), buffer_size=64 << 10)  # type: ignore[return-value]

    # --- everything else, as the storage does it

    def exists(self, uri: str) -> bool:
        return self.inner.exists(uri)

    def open_writer(self, uri: str, *, overwrite: bool = False, part_size: int = STREAM_PART_SIZE) -> Writer:
        return self.inner.open_writer(uri, overwrite=overwrite, part_size=part_size)

    def write_bytes(self, uri: str, data: bytes, *, overwrite: bool = False) -> ObjectInfo:
        return self.inner.write_bytes(uri, data, overwrite=overwrite)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, uri: str) -> None:
        self.inner.delete(uri)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(prefix)

    def publish(self, pairs: Iterable[tuple[str, str]], *, overwrite: bool = False, owner: str | None = None) -> None:
        self.inner.publish(pairs, overwrite=overwrite, owner=owner)

    def join(self, base: str, *parts: str) -> str:
        return self.inner.join(base, *parts)

    def backend(self, uri: str) -> Storage:
        return self.inner.backend(uri)

    def local_path(self, uri: str) -> Any:
        return self.inner.local_path(uri)

    def __getattr__(self, name: str) -> Any:
        # A backend's own capabilities (read_part_size, user_metadata, ...), as it has them.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def hold_versions(storage: Storage, versions: Iterable[tuple[str, str | None]]) -> None:
    """Read each ``(uri, etag)`` of ``versions`` through ``storage`` as that version only (where
    ``storage`` pins versions and the ETag is known): an object replaced since is refused now, or
    at its first read."""
    if isinstance(storage, PinnedReads):
        for uri, etag in versions:
            if etag:
                storage.pin(uri, etag)
