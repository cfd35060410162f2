"""Reads of a checkpoint's objects that all see one version of each object.

A conversion reads an object many times: its header when the checkpoint is opened, then every
tensor with a ranged GET of its own, minutes or hours later. An object replaced in between (a
training job writing its latest checkpoint under the same key) would otherwise give the header of
one version and tensors of the next, possibly some of each, while the manifest names the first
version's ETag. :class:`PinnedReads` remembers the version of each object it met first (the ETag of
its first answer, or of a HEAD before a first read that has none) and makes every later read of it
conditional on that version (``If-Match``): a replaced object fails the read with a typed error
(``corrupt_checkpoint``: convert again once nothing writes the source), and nothing is published.

One view per opened checkpoint (``ckptconv.formats.detect.open_source``; the components of a model
whose Hugging Face side is several directories share one), shared by the threads that read it;
the storage instances behind it are shared by every job of the process and know nothing of
versions. :meth:`PinnedReads.pin` takes versions recorded elsewhere: the processes of a
fanned-out job read the versions the job's plan read, each checked at its first read (no request of
its own). Only object stores have versions to pin; local files are read as they are, and a weak
ETag (a proxy's) pins nothing.
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
        self._versions: dict[str, ObjectInfo] = {}  # uri -> the version met first
        self._expected: dict[str, str] = {}  # uri -> the ETag it must have, not met yet (pin)
        self._lock = threading.Lock()

    # --- versions

    def pin(self, uri: str, etag: str) -> None:
        """Read ``uri`` as version ``etag`` only: an object met as another version is refused now,
        one not met yet at its first read (that read asks for ``etag``), at no request of its own."""
        with self._lock:
            known = self._versions.get(uri)
            if known is None:
                self._expected[uri] = etag
                return
        if known.etag != etag:
            raise replaced(uri, f"since the job first read it (its ETag is {known.etag}, not {etag})")

    def _known(self, uri: str) -> tuple[ObjectInfo | None, str | None]:
        """The version met first, else the ETag a first read must ask for (either may be None)."""
        with self._lock:
            known = self._versions.get(uri)
            return known, (known.etag if known is not None else self._expected.get(uri))

    def _learn(self, info: ObjectInfo) -> ObjectInfo:
        """The version of ``info.uri`` met first: ``info`` unless an earlier answer (or a pin) met
        another version, which is refused (two first reads raced across a replacement)."""
        with self._lock:
            first = self._versions.get(info.uri)
            want = first.etag if first is not None else self._expected.get(info.uri)
            if want is not None and info.etag != want:
                raise replaced(info.uri, f"while it was being read (ETag {want}, then {info.etag})")
            return self._versions.setdefault(info.uri, info)

    def _version(self, uri: str) -> ObjectInfo:
        known, _ = self._known(uri)
        return known if known is not None else self._learn(self.inner.stat(uri))

    def _condition(self, uri: str) -> dict[str, str]:
        """The ``etag`` argument of a read of ``uri``: the version met first, or the one pinned;
        none for a weak ETag (a proxy's, not the object's bytes) or a store that gives none."""
        known, etag = self._known(uri)
        if known is None and etag is None:
            etag = self._version(uri).etag
        return if_match(etag)

    # --- reads, each of the version pinned

    def stat(self, uri: str) -> ObjectInfo:
        return self._version(uri)

    def read_range(self, uri: str, offset: int, length: int) -> bytes:
        return self.inner.read_range(uri, offset, length, **self._condition(uri))

    def read_into(self, uri: str, offset: int, buf: bytearray | memoryview) -> None:
        self.inner.read_into(uri, offset, buf, **self._condition(uri))

    def read_scattered(self, uri: str, offset: int, bufs: Sequence[memoryview]) -> None:
        self.inner.read_scattered(uri, offset, bufs, **self._condition(uri))

    def read_head(self, uri: str, length: int, *, offset: int = 0) -> tuple[bytes, ObjectInfo]:
        known, etag = self._known(uri)
        data, info = self.inner.read_head(uri, length, offset=offset, **if_match(etag))
        return data, known if known is not None else self._learn(info)

    def user_metadata(self, uri: str) -> dict[str, str]:
        """The object's user metadata (an object store's), from the version read first: one
        conditional HEAD, which tells the version when it is the first request for ``uri``."""
        known, etag = self._known(uri)
        info, metadata = self.inner.described(uri, **if_match(etag))  # type: ignore[attr-defined]
        if known is None:
            self._learn(info)
        return metadata

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
        # A backend's own capabilities (read_part_size, read_concurrency, ...), as it has them.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def if_match(etag: str | None) -> dict[str, str]:
    """The ``etag`` argument that makes a read conditional on that version (passed on only when
    there is one: only object stores take it); none for a weak ETag (``W/...``: a proxy's, which
    says nothing of the bytes) or a store that gave none."""
    return {"etag": etag} if etag and not etag.startswith("W/") else {}


def hold_versions(storage: Storage, versions: Iterable[tuple[str, str | None]]) -> None:
    """Read each ``(uri, etag)`` of ``versions`` through ``storage`` as that version only (where
    ``storage`` pins versions and the ETag is known): an object replaced since is refused now, or
    at its first read."""
    if isinstance(storage, PinnedReads):
        for uri, etag in versions:
            if etag:
                storage.pin(uri, etag)
