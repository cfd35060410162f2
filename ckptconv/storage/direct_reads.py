"""Positioned reads of local files into the caller's buffer, around the page cache where they can be.

Why: a value read through the page cache costs the kernel a fresh page for every 4 KiB and a copy
out of it. On a virtual machine whose memory is lent back and forth with its hypervisor the fresh
pages cost several times the copy: ``perf`` of a 3 GB safetensors -> cs-h5 conversion, page cache
dropped, found the kernel's copy out of the page cache in 44% of all samples of both cores. An
``O_DIRECT`` read puts the bytes straight into the caller's buffer (``dd`` of 1 GB: 0.05 s of
system time direct, 0.15-0.82 s through the page cache). The seven 3 GB local conversions of
``make bench`` in alternating pairs, page cache dropped: every one of 14 faster, by 0.05-1.9 s,
with 0.5-0.9 s of system time instead of 1.2-4.1 s. (A version that read through an aligned
bounce buffer and copied from it saved the system time but not the wall time: the copy held the
GIL. Here nothing is copied.)

``O_DIRECT`` wants the buffer's address, the file offset and the length all multiples of
:data:`~ckptconv.storage.direct_io.ALIGN`. A buffer *in phase* with its file offset (its address
and the offset equal modulo ``ALIGN``: ckptconv.formats.memory hands out such buffers for values
of ``DIRECT_READ_BYTES`` or more stored at offsets aligned to their element) has every whole
block of its range at an aligned address: :func:`read_file_into` reads those blocks direct and
only the partial blocks at either end through the page cache. A buffer out of phase, a small
read, or a filesystem that refuses ``O_DIRECT`` (``EINVAL``: older tmpfs, some FUSE and network
mounts) is read through the page cache as before; ``CKPTCONV_DIRECT_IO=0`` does the same on
purpose. The bytes are the same either way: the kernel keeps direct reads coherent
with the page cache (it writes back dirty cached pages of the range first).
"""

from __future__ import annotations

import ctypes
import os

from ckptconv.storage.direct_io import ALIGN, direct_io_enabled

# Reads at least this long go direct (shorter ones are mostly partial blocks anyway).
DIRECT_READ_BYTES = 1 << 20


def address_of(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def direct_span(view: memoryview, offset: int) -> tuple[int, int] | None:
    """``[lo, hi)`` of ``view`` (filled from file offset ``offset``) that may be read with
    ``O_DIRECT``: its whole blocks, when the buffer is in phase with the offset; else None."""
    if len(view) < DIRECT_READ_BYTES or view.readonly or not view.c_contiguous:
        return None
    if (address_of(view) - offset) % ALIGN:
        return None
    lo = -offset % ALIGN
    hi = lo + (len(view) - lo) // ALIGN * ALIGN
    return (lo, hi) if hi > lo else None


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """``preadv`` until ``view`` is full or the file ends; the bytes read."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            break
        done += n
    return done


def read_file_into(fd: int, offset: int, view: memoryview) -> int:
    """Fill ``view`` from ``offset`` of the open file ``fd``; the bytes read (fewer where the file
    ends). Its whole blocks go around the page cache when they can (see the module's docstring)."""
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    span = direct_span(view, offset) if direct_io_enabled() else None
    if span is not None:
        lo, hi = span
        if _read_direct(fd, view[lo:hi], offset + lo):
            head = pread_full(fd, view[:lo], offset)
            if head < lo:
                return head
            return hi + pread_full(fd, view[hi:], offset + hi)
    return pread_full(fd, view, offset)


def _read_direct(fd: int, view: memoryview, offset: int) -> bool:
    """Read all of ``view`` with ``O_DIRECT`` from the file ``fd`` is open on; False when the file
    refuses it or ends inside the range (the caller reads it through the page cache instead)."""
    try:
        # The same open file, not its path again: the path may name another file by now.
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return pread_full(direct, view, offset) == len(view)
    except OSError:
        # EINVAL where the filesystem takes the open but not the read; any other error the read
        # through the page cache meets again, and reports as every read does.
        return False
    finally:
        os.close(direct)
