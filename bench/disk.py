"""The local disk in a benchmark: its page cache dropped, how busy it was, what it does alone.

A local conversion reads every byte of its checkpoint and writes as many. On a virtual disk that is
what sets its pace, and ``cp`` is a poor yardstick for it: ``cp`` copies inside the kernel
(``copy_file_range``, the bytes never in its memory) through the page cache, whose cost on a
virtual machine varies with the host (3 GB copied in 4.8 s, then in 19.4 s with 18 s of system
time, minutes apart on one machine; 2.6 s on another day), while ckptconv reads every byte into
its memory to convert and hash it, around the page cache. So the benchmarks print two more facts
beside ``cp``:

- the *disk alone*: the same files copied by ``dd`` with ``O_DIRECT`` on both sides (no page cache),
  one ``dd`` per file, all at once: the device moving the same bytes with nothing else to do. A
  baseline, not a floor: each ``dd`` waits for its read before its write and the reverse, where
  ckptconv keeps reads and writes in flight together, and is faster than it on this machine's
  disk (3 GB in 4.7-6.8 s against 5.9 s for four ``dd`` streams, 8.4 s for six);
- how *busy* the device was during each case (the share of the wall time with a request in
  flight, from ``/proc/diskstats``), and the bytes it read and wrote: a case near 100% cannot go
  faster on this disk, whatever runs it, and more processes (fanned-out workers) only share it.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from shlex import quote

DISKSTATS = Path("/proc/diskstats")
SECTOR = 512  # /proc/diskstats counts 512-byte sectors whatever the device's own block size


def drop_caches() -> bool:
    """Write dirty pages back and drop the page cache (root only); False where not allowed."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class DiskUse:
    """What the device did between two readings of its counters."""

    read_bytes: int
    written_bytes: int
    busy_s: float  # time with at least one request in flight

    def busy(self, wall: float) -> float:
        """The share of ``wall`` seconds the device was busy."""
        return min(self.busy_s / wall, 1.0) if wall > 0 else 0.0


class Disk:
    """The block device a directory lives on, as ``/proc/diskstats`` counts it (its partition's
    line where it is a partition). Where there is none (tmpfs, overlay, no procfs) every reading
    is None."""

    def __init__(self, path: Path) -> None:
        dev = os.stat(path).st_dev
        self.key = (os.major(dev), os.minor(dev))

    def counters(self) -> tuple[int, int, int] | None:
        """(sectors read, sectors written, milliseconds busy) so far."""
        try:
            lines = DISKSTATS.read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            f = line.split()
            if len(f) >= 13 and (int(f[0]), int(f[1])) == self.key:
                return int(f[5]), int(f[9]), int(f[12])
        return None

    def since(self, before: tuple[int, int, int] | None) -> DiskUse | None:
        after = self.counters()
        if before is None or after is None:
            return None
        return DiskUse((after[0] - before[0]) * SECTOR, (after[1] - before[1]) * SECTOR, (after[2] - before[2]) / 1e3)


def direct_io_works(directory: Path) -> bool:
    """Whether ``dd`` can write a file in ``directory`` with ``O_DIRECT`` (tmpfs and some network
    filesystems refuse it)."""
    probe = directory / ".direct-probe"
    try:
        done = subprocess.run(
            ["dd", "if=/dev/zero", f"of={probe}", "bs=4096", "count=1", "oflag=direct", "status=none"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return done.returncode == 0
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def direct_copy_command(files: list[Path], dest: Path) -> list[str]:
    """A command that copies ``files`` into the directory ``dest`` with ``dd``, ``O_DIRECT`` reads
    and writes, one ``dd`` per file, all at once: the disk alone (see :func:`direct_io_works`)."""
    dds = " ".join(
        f"dd if={quote(str(f))} of={quote(str(dest / f.name))} bs=16M iflag=direct oflag=direct status=none &"
        ' pids="$pids $!";'
        for f in files
    )
    # Every dd's exit status counts: a copy that failed must not pass for a fast one.
    return ["sh", "-c", f"mkdir -p {quote(str(dest))} && pids=''; {dds} for p in $pids; do wait $p || exit 1; done"]


__all__ = ["Disk", "DiskUse", "direct_copy_command", "direct_io_works", "drop_caches"]
