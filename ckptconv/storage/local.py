"""Local filesystem storage: plain paths and ``file://`` URIs.

Guarantees on top of the :class:`~ckptconv.storage.base.Storage` contract:

- Writes go to ``<target>.<8 hex>.tmp`` in the target's directory (the name ``cstorch.save``
  uses too), are fsynced, then placed: ``os.replace`` when overwriting, otherwise ``os.link`` +
  ``unlink`` so that of two writers racing for the same name exactly one wins and the other gets
  :class:`~ckptconv.core.errors.TargetExists`. The directory is fsynced after placing, so a committed
  file survives a crash.
- Directories are not objects: ``stat`` of a directory is ObjectNotFound, ``list`` never yields
  one, and ``delete_prefix`` removes the directories it leaves empty. Temp files of writers in
  flight are not objects either: ``list`` skips them.
- Parent directories are created on demand (by writers and ``publish``); an aborted write may
  leave an empty directory behind, which is invisible to every other method.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import stat as stat_mod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ckptconv.core.errors import (
    CkptconvError,
    InvalidRequest,
    ObjectNotFound,
    SinkProtocolError,
    StorageError,
    TargetExists,
)
from ckptconv.core.uri import join as join_uri
from ckptconv.core.uri import local_path_of
from ckptconv.storage.base import STREAM_PART_SIZE, ObjectInfo, Storage, Writer
from ckptconv.storage.direct_io import DirectWrites, pwrite_all
from ckptconv.storage.direct_reads import read_file_into
from ckptconv.storage.ranges import check_range, short_read

# Temp files of writers in flight (and the ones cstorch leaves behind when a save fails).
_TEMP_NAME = re.compile(r"\.[0-9a-f]{8}\.tmp$")

# Filesystems that cannot hard-link (some FUSE and network mounts) answer with one of these.
_NO_HARDLINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}


@contextlib.contextmanager
def _os_errors(uri: str, *, reading: bool = True) -> Iterator[None]:
    """Translate OSError into the typed storage errors (missing paths are ObjectNotFound when reading)."""
    try:
        yield
    except CkptconvError:  # already typed (TargetExists is a FileExistsError, StorageError an OSError)
        raise
    except FileNotFoundError as e:
        if reading:
            raise ObjectNotFound(f"no such file: {uri}", uri=uri) from e
        raise StorageError(f"{uri}: a directory on the way does not exist ({e.strerror})", uri=uri) from e
    except (IsADirectoryError, NotADirectoryError, FileExistsError) as e:
        if reading:
            raise ObjectNotFound(f"not a file: {uri}", hint="name a file; directories are not objects", uri=uri) from e
        raise StorageError(
            f"{uri}: {e.strerror}", hint="a path component is a file, or the target is a directory", uri=uri
        ) from e
    except PermissionError as e:
        raise StorageError(
            f"permission denied: {uri}", hint="check the permissions of the file and its directories", uri=uri
        ) from e
    except OSError as e:
        hint = "free disk space, then retry" if e.errno in (errno.ENOSPC, errno.EDQUOT) else None
        raise StorageError(f"{uri}: {e.strerror or e}", hint=hint, uri=uri, errno=e.errno) from e


def _etag(st: os.stat_result) -> str:
    # Cheap and stable while the file is unchanged; any rewrite (new inode, new mtime or size) changes it.
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _info(uri: str, st: os.stat_result) -> ObjectInfo:
    return ObjectInfo(uri=uri, size=st.st_size, etag=_etag(st), mtime=st.st_mtime)


def _fsync_dir(path: str) -> None:
    # Makes a rename or link durable; some filesystems refuse to open or fsync directories.
    try:
        fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def ensure_parent_dir(path: str) -> None:
    """Create the directory holding ``path``.

    Concurrent jobs share ``.ckptconv-staging/`` and each removes it once empty, so it can vanish
    between ``makedirs`` creating it and creating the job's own subdirectory: try again then.
    """
    parent = os.path.dirname(path) or "."
    for attempt in range(8):
        try:
            os.makedirs(parent, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == 7:
                raise


def _temp_name(path: str) -> str:
    return f"{path}.{secrets.token_hex(4)}.tmp"


def _place(src: str, dst: str, *, overwrite: bool, uri: str) -> None:
    """Move ``src`` to ``dst`` on one filesystem; refuse an existing ``dst`` unless ``overwrite``."""
    if overwrite:
        os.replace(src, dst)
        return
    try:
        # link() fails atomically when dst exists, which rename() cannot do portably.
        os.link(src, dst)
    except FileExistsError:
        raise TargetExists(f"{uri} already exists", uri=uri) from None
    except OSError as e:
        if e.errno not in _NO_HARDLINKS:
            raise
        # No hard links here: check, then rename. A concurrent writer could slip in between.
        if os.path.lexists(dst):
            raise TargetExists(f"{uri} already exists", uri=uri) from None
        os.rename(src, dst)
        return
    os.unlink(src)


def _copy_then_place(src: str, dst: str, *, overwrite: bool, uri: str) -> None:
    """Cross-filesystem move: copy next to ``dst`` (streamed, fsynced), place it, then drop ``src``."""
    tmp = _temp_name(dst)
    try:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        _place(tmp, dst, overwrite=overwrite, uri=uri)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    os.unlink(src)


class LocalWriter(Writer):
    """Streams into a temp file next to the target; see the module docstring for how commit places it.

    Once the file is announced as bulk data (:meth:`preallocate` with its size, or
    :meth:`stream_direct`), its bytes go around the page cache and land behind the caller
    (:mod:`ckptconv.storage.direct_io`); :meth:`commit` waits for them."""

    def __init__(self, uri: str, path: str, *, overwrite: bool) -> None:
        self.uri = uri
        self._path = path
        self._overwrite = overwrite
        self._written = 0
        self._state = "open"
        self._info: ObjectInfo | None = None
        with _os_errors(uri, reading=False):
            ensure_parent_dir(path)
            # Early refusal saves writing gigabytes that commit would refuse anyway.
            if not overwrite and os.path.lexists(path):
                raise TargetExists(f"{uri} already exists", uri=uri)
            self._tmp = _temp_name(path)
            self._file = open(self._tmp, "xb")  # noqa: SIM115 - closed by commit/abort
        self._direct: DirectWrites | None = None

    @property
    def bytes_written(self) -> int:
        return self._written

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._state != "open":
            raise SinkProtocolError(f"write to a {self._state} writer for {self.uri}")
        with _os_errors(self.uri, reading=False):
            if self._direct is not None:
                view = memoryview(data)
                self._direct.write_at(self._written, view)
                n = view.nbytes
            else:
                n = self._file.write(data)
        self._written += n
        return n

    def preallocate(self, size: int) -> None:
        """Reserve the file's ``size`` bytes now (one extent instead of growth write by write; a full
        disk fails here, before any data moves). Sequential writes then fill it from the start."""
        with _os_errors(self.uri, reading=False):
            self._file.flush()
            try:
                os.posix_fallocate(self._file.fileno(), 0, size)
            except OSError as e:  # filesystems without fallocate (some FUSE mounts): a sparse file
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                os.ftruncate(self._file.fileno(), size)
        self.stream_direct()

    def stream_direct(self) -> None:
        """The rest of this file is bulk data (an output's tensors): around the page cache. A
        writer holds up to 48 MiB of staging buffers from then on until it is committed, so only
        a writer that is the one being filled should be told."""
        if self._direct is not None:
            return
        with _os_errors(self.uri, reading=False):
            self._file.flush()
        self._direct = DirectWrites(self._tmp, self._file.fileno())

    def write_at(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Place ``data`` at ``offset`` of the temp file (a positioned write; the stream position stays)."""
        if self._state != "open":
            raise SinkProtocolError(f"write to a {self._state} writer for {self.uri}")
        with _os_errors(self.uri, reading=False):
            if self._direct is not None:
                self._direct.write_at(offset, memoryview(data))
                return
            self._file.flush()
            pwrite_all(self._file.fileno(), memoryview(data), offset)

    def commit(self) -> ObjectInfo:
        if self._state == "committed":
            assert self._info is not None
            return self._info
        if self._state != "open":
            raise SinkProtocolError(f"commit of an aborted writer for {self.uri}")
        try:
            with _os_errors(self.uri, reading=False):
                if self._direct is not None:
                    self._direct.close()
                self._file.flush()
                os.fsync(self._file.fileno())
                st = os.fstat(self._file.fileno())
                self._file.close()
                _place(self._tmp, self._path, overwrite=self._overwrite, uri=self.uri)
                _fsync_dir(os.path.dirname(self._path))
        except BaseException:
            self.abort()
            raise
        self._state = "committed"
        self._info = _info(self.uri, st)
        return self._info

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        if self._direct is not None:
            self._direct.close(write_pending=False)
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


class LocalPatch:
    """Positioned writes into an existing file (several processes filling one preallocated output,
    each its own byte ranges). Never creates the file: a writer that comes late, after its output
    was discarded, fails instead of leaving a file behind.

    ``path`` is the file when it is not the one ``uri`` names (a writer's temp file beside its
    target); errors name ``uri`` either way. With ``direct``, bulk data goes around the page cache
    and lands behind the caller (:mod:`ckptconv.storage.direct_io`): :meth:`flush` and
    :meth:`close` wait for it and raise its failure."""

    def __init__(self, uri: str, path: str | None = None, *, direct: bool = False) -> None:
        self.uri = uri
        target = local_path_of(uri) if path is None else path
        with _os_errors(uri, reading=False):
            self._fd = os.open(target, os.O_WRONLY)
        self._direct = DirectWrites(target, self._fd) if direct else None

    @property
    def direct_bytes(self) -> int:
        """Bytes written around the page cache so far."""
        return self._direct.direct_bytes if self._direct is not None else 0

    def write_at(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        with _os_errors(self.uri, reading=False):
            if self._direct is not None:
                self._direct.write_at(offset, memoryview(data))
            else:
                pwrite_all(self._fd, memoryview(data), offset)

    def flush(self) -> None:
        """Every byte written so far is in the file (typed errors for the writes that failed)."""
        if self._direct is not None:
            with _os_errors(self.uri, reading=False):
                self._direct.flush()

    def close(self, *, sync: bool = True) -> None:
        """Flush, fsync when ``sync``, close."""
        if self._fd < 0:
            return
        try:
            self.flush()
            if sync:
                with _os_errors(self.uri, reading=False):
                    os.fsync(self._fd)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close without waiting for what is not written yet, and without raising (the output is
        being discarded)."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            if self._direct is not None:
                self._direct.close(write_pending=False)
        finally:
            os.close(fd)


_NO_SPACE_HINT = "free disk space on that filesystem, or choose a target (or staging directory) on another one"


def check_free_space(path: str, nbytes: int, uri: str) -> None:
    """Refuse, before a byte is written, files of up to ``nbytes`` that the filesystem holding
    ``path`` (a directory, or one still to be created: its nearest existing one is asked) has no
    room for: a typed error now instead of a full disk halfway."""
    while path not in ("", "/") and not os.path.isdir(path):
        path = os.path.dirname(path)
    with _os_errors(uri, reading=False):
        st = os.statvfs(path or ".")
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise StorageError(
            f"{uri}: not enough free space: needs up to {nbytes} bytes, {free} free",
            hint=_NO_SPACE_HINT,
            uri=uri,
            errno=errno.ENOSPC,
        )


_FALLOC_FL_KEEP_SIZE = 1
_fallocate: Any = None


def reserve_space(fd: int, nbytes: int, uri: str) -> bool:
    """Allocate the disk blocks of the first ``nbytes`` of ``fd``'s file without changing its size
    (``fallocate(FALLOC_FL_KEEP_SIZE)``), so that writes inside them cannot fail for want of space.

    For writers that must not meet a full disk halfway: HDF5 (h5py) crashes the process once
    a write of its own has failed. False where the call is not available (not Linux, or a
    filesystem without it); the blocks are given back by :func:`release_reserve`.
    """
    global _fallocate
    if _fallocate is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.fallocate
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
            _fallocate = fn
        except (OSError, AttributeError):
            _fallocate = False
    if not _fallocate or nbytes <= 0:
        return False
    if _fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSPC, errno.EDQUOT):
        raise StorageError(
            f"{uri}: not enough free space for up to {nbytes} bytes ({os.strerror(err)})",
            hint=_NO_SPACE_HINT,
            uri=uri,
            errno=err,
        )
    return False  # EOPNOTSUPP and the like: written without a reservation


def release_reserve(path: str) -> None:
    """Give back the blocks :func:`reserve_space` allocated past the end of the finished file:
    truncating a file to its own size frees them (tmpfs, ext4, XFS)."""
    with _os_errors(path, reading=False):
        os.truncate(path, os.path.getsize(path))


class LocalStorage(Storage):
    """Files on this machine. Stateless, hence safe to share between threads."""

    scheme = "file"

    def stat(self, uri: str) -> ObjectInfo:
        with _os_errors(uri):
            st = os.stat(local_path_of(uri))
        if not stat_mod.S_ISREG(st.st_mode):
            raise ObjectNotFound(f"not a regular file: {uri}", hint="name a file; directories are not objects", uri=uri)
        return _info(uri, st)

    def read_range(self, uri: str, offset: int, length: int) -> bytes:
        check_range(uri, offset, length)
        with _os_errors(uri), open(local_path_of(uri), "rb") as f:
            f.seek(offset)
            # A buffered read loops until it has `length` bytes or hits the end of the file.
            data = f.read(length)
            if len(data) != length:
                raise short_read(uri, offset, length, len(data), os.fstat(f.fileno()).st_size)
        return data

    def read_into(self, uri: str, offset: int, buf: bytearray | memoryview) -> None:
        view = memoryview(buf).cast("B")
        check_range(uri, offset, len(view))
        with _os_errors(uri), open(local_path_of(uri), "rb", buffering=0) as f:
            done = read_file_into(f.fileno(), offset, view)
            if done < len(view):
                raise short_read(uri, offset, len(view), done, os.fstat(f.fileno()).st_size)

    def open_reader(self, uri: str) -> BinaryIO:
        with _os_errors(uri):
            f = open(local_path_of(uri), "rb")  # noqa: SIM115 - the caller owns it
        if not stat_mod.S_ISREG(os.fstat(f.fileno()).st_mode):
            f.close()
            raise ObjectNotFound(f"not a regular file: {uri}", uri=uri)
        return f

    def open_writer(self, uri: str, *, overwrite: bool = False, part_size: int = STREAM_PART_SIZE) -> Writer:
        """A :class:`LocalWriter`; ``part_size`` does not apply to files and is ignored."""
        return LocalWriter(uri, local_path_of(uri), overwrite=overwrite)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Regular files whose URI starts with ``prefix`` (string prefix), sorted by URI.

        Directory symlinks are not followed (no cycles, no wandering out of the prefix's tree);
        file symlinks are listed.
        """
        path = local_path_of(prefix)
        found: list[ObjectInfo] = []
        for full, st in self._matching_files(path):
            uri = prefix + full[len(path) :]
            found.append(_info(uri, st))
        found.sort(key=lambda info: info.uri)
        yield from found

    def _matching_files(self, path: str) -> Iterator[tuple[str, os.stat_result]]:
        for full, is_dir in self._matching_entries(path):
            if is_dir:
                for root, _dirs, files in os.walk(full, followlinks=False):
                    for name in files:
                        yield from self._file_entry(root + "/" + name, name)
            else:
                yield from self._file_entry(full, os.path.basename(full))

    @staticmethod
    def _file_entry(full: str, name: str) -> Iterator[tuple[str, os.stat_result]]:
        if _TEMP_NAME.search(name):
            return
        try:
            st = os.stat(full)
        except OSError:  # vanished meanwhile, or a dangling symlink
            return
        if stat_mod.S_ISREG(st.st_mode):
            yield full, st

    @staticmethod
    def _matching_entries(path: str) -> Iterator[tuple[str, bool]]:
        """Entries of the prefix's directory whose names start with the prefix's last component."""
        cut = path.rfind("/") + 1
        directory, name_prefix = path[:cut], path[cut:]
        try:
            entries = list(os.scandir(directory or "."))
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            raise StorageError(f"cannot list {directory or '.'}: {e.strerror}", uri=path) from e
        for entry in entries:
            if entry.name.startswith(name_prefix):
                yield directory + entry.name, entry.is_dir(follow_symlinks=False)

    def delete(self, uri: str) -> None:
        with _os_errors(uri, reading=False), contextlib.suppress(FileNotFoundError):
            os.unlink(local_path_of(uri))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every listed object under ``prefix``, then the directories that became empty.

        Refuses prefixes that name a filesystem root or the working directory as a whole.
        """
        path = local_path_of(prefix)
        if os.path.normpath(path) in ("/", ".", "//") or path == "":
            raise InvalidRequest(
                f"refusing to delete everything under {prefix!r}", hint="name a narrower prefix", uri=prefix
            )
        n = super().delete_prefix(prefix)
        for full, is_dir in list(self._matching_entries(path)):
            if not is_dir:
                continue
            for root, _dirs, _files in os.walk(full, topdown=False, followlinks=False):
                with contextlib.suppress(OSError):  # not empty (e.g. a writer's temp file): keep it
                    os.rmdir(root)
        return n

    def publish(self, pairs: Iterable[tuple[str, str]], *, overwrite: bool = False, owner: str | None = None) -> None:
        """Rename each staging file to its final name, in order.

        Every source is checked to exist, and (unless ``overwrite``) every target to be absent,
        before the first move, so a refused publish moves nothing. Across filesystems the file
        is copied (streamed) and then removed. ``owner`` is not recorded: a placed file keeps the
        staged file's inode (on one filesystem), which is what tells it from others' files.
        """
        pairs = list(pairs)
        for src, dst in pairs:
            self.stat(src)
            if not overwrite and os.path.lexists(local_path_of(dst)):
                raise TargetExists(f"{dst} already exists", uri=dst)
        for src, dst in pairs:
            src_path, dst_path = local_path_of(src), local_path_of(dst)
            with _os_errors(dst, reading=False):
                ensure_parent_dir(dst_path)
                try:
                    _place(src_path, dst_path, overwrite=overwrite, uri=dst)
                except OSError as e:
                    if e.errno != errno.EXDEV:
                        raise
                    _copy_then_place(src_path, dst_path, overwrite=overwrite, uri=dst)
                _fsync_dir(os.path.dirname(dst_path))

    def local_path(self, uri: str) -> Path | None:
        return Path(local_path_of(uri))

    def join(self, base: str, *parts: str) -> str:
        return join_uri(base, *parts)
