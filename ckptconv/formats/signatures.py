"""What the first bytes of a file, or the names under a prefix, say about its format.

The registry (:mod:`ckptconv.formats.registry`) names one of these per format; detection calls
them. They read only the bytes or names given and import nothing heavy, so the registry stays
free to import.
"""

from __future__ import annotations

import struct

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
ZIP_MAGIC = b"PK\x03\x04"
SAFETENSORS_MAX_HEADER = 100 * 1000 * 1000  # the limit the safetensors library enforces
JSON_WHITESPACE = b" \t\n\r"  # the only padding JSON allows around the header object
# How many bytes detection reads from the head of a file for the sniffs below.
HEAD_BYTES = 64


def hdf5(head: bytes) -> bool:
    """An HDF5 file (superblock at offset 0, as h5py and cstorch write it)."""
    return head.startswith(HDF5_MAGIC)


def torch_pickle(head: bytes) -> bool:
    """A PyTorch checkpoint: a zip archive (torch >= 1.6) or a bare pickle of protocol 2-5."""
    if head.startswith(ZIP_MAGIC):
        return True
    return head[:1] == b"\x80" and len(head) > 1 and head[1] in (2, 3, 4, 5)


def safetensors_header(head: bytes) -> bool:
    """A safetensors length prefix and the start of its header.

    ``head`` holds at least 9 bytes; when all of the header it shows is whitespace padding, the
    start cannot be seen and the answer is yes if the length is plausible.
    """
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    if not 2 <= n <= SAFETENSORS_MAX_HEADER:
        return False
    shown = head[8 : 8 + n].lstrip(JSON_WHITESPACE)
    return shown[:1] == b"{" or (not shown and len(head) - 8 < n)


def object_per_key(names: list[str]) -> bool:
    """Names under a prefix that look like a Cerebras object-per-key checkpoint without its
    ``__METADATA__`` yet: per-key records, or keys nested in "directories"."""
    return any(n.endswith(".__metadata__") or "/" in n for n in names)
