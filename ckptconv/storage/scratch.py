"""Local scratch directories: files a job needs on this machine for a while (an H5 file built
before its upload, a model copied for a library that only reads files).

A process killed with SIGKILL cannot clean up after itself, so every directory is named after
its owner: ``<host>--<pid>-<process start time>--<label>--<random>`` under
``$CKPTCONV_SCRATCH_DIR`` (default ``<system temp>/ckptconv-scratch``). :func:`sweep` removes the
directories of this host whose owning process is gone; it runs when a worker starts and whenever
a scratch directory is made (so a job taken over after its worker died removes that worker's
leftovers). A directory whose process still runs is never swept, nor one of another host sharing
the directory; the start time in the name tells a reused PID from its dead predecessor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_NAME = re.compile(r"^(?P<host>.+)--(?P<pid>\d+)-(?P<start>\d+)--")


def root() -> Path:
    return Path(os.environ.get("CKPTCONV_SCRATCH_DIR") or os.path.join(tempfile.gettempdir(), "ckptconv-scratch"))


def _host() -> str:
    return _SAFE.sub("_", socket.gethostname()) or "host"


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None if it does not exist.

    Where /proc is missing the answer is 0 for every live process (the PID alone decides).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name (field 2) may hold spaces and parentheses: count from its end.
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass
    return 0


def _owner_alive(pid: int, start: int) -> bool:
    now = _start_time(pid)
    return now is not None and (now == start or now == 0 or start == 0)


def make_dir(label: str) -> Path:
    """A fresh scratch directory of this process for ``label`` (e.g. a job id); sweeps dead ones first."""
    sweep()
    pid = os.getpid()
    name = f"{_host()}--{pid}-{_start_time(pid) or 0}--{_SAFE.sub('_', label)[:64]}--{secrets.token_hex(4)}"
    path = root() / name
    path.mkdir(parents=True, exist_ok=False)
    return path


@contextlib.contextmanager
def directory(label: str) -> Iterator[Path]:
    """A scratch directory for the ``with`` block, removed after it (whatever happens)."""
    path = make_dir(label)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sweep() -> int:
    """Remove the scratch directories of this host's dead processes; returns how many."""
    base = root()
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    host = _host()
    removed = 0
    for name in names:
        m = _NAME.match(name)
        if m is None or m["host"] != host or _owner_alive(int(m["pid"]), int(m["start"])):
            continue
        path = base / name
        size = _size(path)
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed += 1
            log.info("removed scratch directory %s (%d bytes) of a dead process", path, size)
    return removed


def _size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total
