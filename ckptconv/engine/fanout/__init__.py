"""One conversion fanned out across several workers: parts cut by output bytes, one commit.

Formats whose byte layout is known before any value is read (safetensors; Cerebras H5 with
contiguous datasets; torch zip archives, whose members are stored; TensorFlow data files; the
objects of a cs-s3 checkpoint, see
:mod:`ckptconv.formats.layout`) can be written by several processes at once, each its own byte
ranges. A zip's CRC fields are spans of the value they check; its central directory, which holds
every CRC, is the file's *tail*, and a bundle's index a *late file*, both written by the commit
from the checksums the parts record (:mod:`ckptconv.engine.fanout.tail`). The
flow (all of it inside the job's staging area, under the attempt that runs it, see
:mod:`ckptconv.engine.run`):

1. **prepare** (the job's own worker): build the plan and the layout of every output file: the sink
   runs with every value that has a place in a file *reserved* and the rest (values, pickled
   objects, 0-d tensors) written, which leaves each file's *gap* bytes (headers, H5 metadata). A
   local file is created preallocated with its gaps in place; an S3 file gets a multipart upload.
   The bytes of all files are cut into ``parallelism`` parts balanced by bytes (on S3 along the
   upload's part grid, so each upload part has one writer; locally along the blocks of the
   file's block digest, so each block has one writer), never by file or tensor names.
   ``.fanout/layout.json`` records files, gaps, uploads and the parts' byte ranges.
2. **parts** (any worker; the job's own worker runs the parts nobody claims): a part reads the
   values whose spans meet its ranges (a value cut by a part boundary is read by both parts),
   checks each against the hash of its source as read (the executor's xxh3 digests), writes its
   bytes with positioned writes (a preallocated file) or as upload parts, and records
   ``.fanout/part-NNNNN.json``: its ranges, the value digests, the
   BLAKE3 of each block it wrote (locally each block it wrote whole, hashed right after writing
   it; on S3 each block of its upload parts, hashed as they are sent, the block size being the
   grid's part size) and its upload parts' ETags. A part whose record
   exists is never run again; a record or layout of an earlier version (block hashes in sha256)
   is refused, never merged; a part is deterministic (same ranges, same bytes), so a
   redelivered or taken-over part rewrites identical bytes. The job's worker waits for the
   records with one listing of their names per poll and one question to Redis for the leases of
   the parts it might take, whatever the number of parts; it polls five times a second at first,
   down to once a second while nothing changes.
3. **commit** (the job's worker, fenced by its attempt): read every part record *from storage*
   (never from a task result), check their count and that their ranges tile every file, merge the
   digests (two parts that computed one value must agree) and compare them with the source's;
   write each file's tail from the CRCs the parts recorded; complete the uploads (create-only).
   Every file's checksum is its block digest (``blake3_blocks``,
   :mod:`ckptconv.storage.digests`), composed from the block hashes of the parts and of the tail
   without reading it back (``verify: full`` reads it back for its digest and checks the stored
   blocks). Then
   stage the manifest and publish as a single-worker run does (the manifest last). A commit run
   twice publishes once: the published manifest carries the job id.

A failure or cancellation stops the parts, waits for them to let go, and removes the staging area
with its incomplete multipart uploads: nothing reaches the target before the commit.

**Takeover** (the job's own worker died; a new attempt runs the job, see :mod:`.run`): the new
attempt stops the earlier attempts' parts and waits until none holds its lease; then it *adopts*
the newest earlier fan-out whose plan key (plan, source files, format, options, parts, version)
equals its own and whose files are intact (gaps and side files there, local files whole, uploads
still open): ``.fanout/adopted.json`` in its own staging area names that attempt, whose staging
area its parts and its commit then use, so recorded parts are not run again. Every other earlier
staging area is removed with its uploads. A stale attempt writes no layout, part record or staged
manifest (all fenced) and, once it has written its layout, leaves its staging area to its successor.
"""

from __future__ import annotations

from ckptconv.engine.fanout.auto import AutoParallelism, resolve_parallelism
from ckptconv.engine.fanout.part import run_part
from ckptconv.engine.fanout.run import FANOUT_FORMATS, run_fanout
from ckptconv.engine.fanout.runner import InlineRunner, PartRunner
from ckptconv.engine.fanout.split import split_parts

__all__ = [
    "FANOUT_FORMATS",
    "AutoParallelism",
    "InlineRunner",
    "PartRunner",
    "resolve_parallelism",
    "run_fanout",
    "run_part",
    "split_parts",
]
