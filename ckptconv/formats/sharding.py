"""What the Hugging Face style formats (safetensors, PyTorch pickles) share.

- splitting: :func:`split_by_size` groups an ordered list into shards the way ``transformers``
  does (a new shard starts when the next item would exceed the limit; an item larger than the
  limit sits alone), keeping the input order so a sink only ever has one shard open;
- names: ``model-00001-of-00003.safetensors`` / ``pytorch_model-00001-of-00003.bin``;
- index files: ``{"metadata": {"total_size": B, ...}, "weight_map": {key: file}}``. Shard names
  read from an index are untrusted: they are joined under the index's directory only through
  ``Storage.join``, which refuses ``..``, absolute names and the like (PathEscape);
- the output side both sinks share: where the files go (:func:`sink_files`) and a set of streaming
  writers that hash what they write, commit each file once complete, and abort as a whole
  (:class:`OutputSet`);
- raw tensor bytes: a tensor's bytes as a buffer, and a byte range read straight into a tensor;
- the ``ckptconv`` record: what those formats cannot say themselves (nesting, values, links,
  arrays, opaque objects), kept as JSON beside the tensors.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ckptconv.core.bounded import load_json
from ckptconv.core.errors import CorruptCheckpoint, InvalidRequest, ObjectNotFound
from ckptconv.core.sizes import parse_size
from ckptconv.core.uri import basename, parent
from ckptconv.formats.base import Entry, OutputFile, RawTensor, TensorSink
from ckptconv.formats.links import link_root
from ckptconv.storage.digests import new_hash
from ckptconv.storage.direct_io import ALIGN
from ckptconv.storage.direct_reads import read_file_into
from ckptconv.storage.part_upload import DEFAULT_CONCURRENCY, open_output_writer, upload_buffer_bytes

if TYPE_CHECKING:
    import torch

    from ckptconv.formats.layout import FileLayout
    from ckptconv.storage.base import ObjectInfo, Storage, Writer

T = TypeVar("T")

# Index files are JSON that is parsed whole; real ones are a few MB even for 100k tensors.
MAX_INDEX_BYTES = 256 << 20
INDEX_HEAD_READ = 4 << 20  # the first read of an index: all of nearly every real one


@dataclass(frozen=True)
class ShardNaming:
    """How one format names its files."""

    stem: str  # "model" / "pytorch_model"
    ext: str  # "safetensors" / "bin"

    @property
    def single(self) -> str:
        return f"{self.stem}.{self.ext}"

    @property
    def index(self) -> str:
        return f"{self.stem}.{self.ext}.index.json"

    def shard(self, i: int, n: int) -> str:
        """Name of shard ``i`` (1-based) of ``n``."""
        return f"{self.stem}-{i:05d}-of-{n:05d}.{self.ext}"

    def names(self, n: int, *, always_sharded: bool = False) -> list[str]:
        """File names for ``n`` shards: one plain file when ``n == 1`` (as ``save_pretrained`` does),
        unless ``always_sharded`` (``-00001-of-00001`` plus an index, as the Model Zoo writes)."""
        if n == 1 and not always_sharded:
            return [self.single]
        return [self.shard(i, n) for i in range(1, n + 1)]


SAFETENSORS = ShardNaming("model", "safetensors")
TORCH = ShardNaming("pytorch_model", "bin")
NAMING = {"safetensors": SAFETENSORS, "torch": TORCH}


def split_by_size(items: Iterable[T], size: Callable[[T], int], limit: int | None) -> list[list[T]]:
    """Split ``items`` (in order) into shards of at most ``limit`` bytes each.

    A new shard starts when adding the next item would exceed ``limit``; an item larger than
    ``limit`` gets a shard of its own. ``limit=None`` puts everything in one shard. Always returns
    at least one (possibly empty) shard. Unlike ``huggingface_hub``, which sets an oversized item
    aside and keeps filling the current shard, the order is kept, so shards can be written one
    after another.
    """
    shards: list[list[T]] = [[]]
    current = 0
    for item in items:
        n = size(item)
        if limit is not None and shards[-1] and current + n > limit:
            shards.append([])
            current = 0
        shards[-1].append(item)
        current += n
    return shards


def tie_groups(entries: Iterable[Entry]) -> list[list[Entry]]:
    """Data entries in order, each followed by the links that alias it (they share its shard).

    Values, and links to values or to nothing, have no bytes to place and are left out.
    """
    entries = list(entries)
    by_key = {e.key: e for e in entries}
    groups: dict[str, list[Entry]] = {}
    order: list[list[Entry]] = []
    for e in entries:
        if e.is_data:
            groups[e.key] = [e]
            order.append(groups[e.key])
    for e in entries:
        if e.kind != "link":
            continue
        root = link_root(e.key, by_key)
        if root in groups:
            groups[root].append(e)
    return order


def plan_shards(
    entries: list[Entry], limit: int | None, fmt: str, *, always_sharded: bool = False
) -> list[tuple[str, list[str], int]]:
    """``[(file name, keys, bytes), ...]`` for writing ``entries`` in format ``fmt``.

    Links ride with their target; in safetensors (no aliasing) they cost a full copy, in torch
    pickles they share the target's storage and cost nothing.
    """
    copies_links = fmt == "safetensors"
    naming = NAMING[fmt]

    def group_size(group: list[Entry]) -> int:
        n = group[0].nbytes
        return n * len(group) if copies_links else n

    shards = split_by_size(tie_groups(entries), group_size, limit)
    names = naming.names(len(shards), always_sharded=always_sharded)
    return [
        (name, [e.key for g in groups for e in g], sum(group_size(g) for g in groups))
        for name, groups in zip(names, shards, strict=True)
    ]


# --- index files -----------------------------------------------------------------------------


@dataclass
class ShardIndex:
    """A parsed index file: which shard (by URI) holds each key, and the free-form metadata."""

    uri: str
    weight_map: dict[str, str]  # key -> shard URI (already confined under the index's directory)
    metadata: dict[str, Any] = field(default_factory=dict)
    file: ObjectInfo | None = None  # the index file's own size and ETag, learned as it was read

    @property
    def shards(self) -> list[str]:
        """Shard URIs, sorted by name (shard 1 first), each once."""
        return sorted(set(self.weight_map.values()))


def index_bytes(weight_map: dict[str, str], total_size: int, metadata: dict[str, Any] | None = None) -> bytes:
    """The JSON text of an index file (indent 2 and a trailing newline, as ``transformers`` writes)."""
    doc = {"metadata": {"total_size": total_size, **(metadata or {})}, "weight_map": weight_map}
    return (json.dumps(doc, indent=2) + "\n").encode()


def read_index(storage: Storage, uri: str) -> ShardIndex:
    """Parse and validate an index file; shard names are confined under its directory."""
    # One request for the usual index (its size comes with its first bytes); a larger one takes a second.
    raw, info = storage.read_head(uri, INDEX_HEAD_READ)
    size = info.size
    if size > MAX_INDEX_BYTES:
        raise CorruptCheckpoint(f"index file {uri} is {size} bytes, more than an index can be")
    if len(raw) < size:
        raw += storage.read_range(uri, len(raw), size - len(raw))
    doc = load_json(raw, what=f"index file {uri}", max_bytes=MAX_INDEX_BYTES)
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise CorruptCheckpoint(f"index file {uri} has no weight_map object")
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CorruptCheckpoint(f"index file {uri}: metadata is not an object")
    base = parent(uri)
    confined: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    for key, name in doc["weight_map"].items():
        if not isinstance(name, str):
            raise CorruptCheckpoint(f"index file {uri}: shard of {key!r} is not a file name")
        if name not in confined:
            confined[name] = storage.join(base, name)  # PathEscape for '../x', '/etc/x', ...
        weight_map[key] = confined[name]
    return ShardIndex(uri, weight_map, metadata, info)


def find_checkpoint(storage: Storage, uri: str, naming: ShardNaming, suffixes: tuple[str, ...]) -> str:
    """The file to open for a source URI: the URI itself, or inside a directory/prefix the index,
    else the single file, else the only file with one of ``suffixes``."""
    if storage.exists(uri):
        return uri
    base = uri.rstrip("/")
    for name in (naming.index, naming.single):
        candidate = storage.join(base, name)
        if storage.exists(candidate):
            return candidate
    prefix = base + "/"
    found = [
        info.uri for info in storage.list(prefix) if "/" not in info.uri[len(prefix) :] and info.uri.endswith(suffixes)
    ]
    indexes = [u for u in found if u.endswith(".index.json")]
    if len(indexes) == 1:
        return indexes[0]
    files = [u for u in found if not u.endswith(".index.json")]
    if len(files) == 1 and not indexes:
        return files[0]
    if not found:
        raise ObjectNotFound(f"no {naming.ext} checkpoint at {uri}")
    raise InvalidRequest(
        f"{uri} holds several {naming.ext} checkpoints: " + ", ".join(sorted(found)[:6]),
        hint="point at one file or at its index file",
    )


# --- writing ---------------------------------------------------------------------------------


@dataclass
class ShardFile:
    """One output file of a sink: its URI and the keys (data entries and their links) it holds."""

    uri: str
    keys: list[str]
    nbytes: int


def sink_files(
    storage: Storage,
    uri: str,
    entries: list[Entry],
    shard_size: int | str | None,
    fmt: str,
    file_suffixes: tuple[str, ...],
    *,
    always_sharded: bool = False,
) -> tuple[list[ShardFile], str | None]:
    """Where a sink writes ``entries``: the files (in writing order) and the index URI, if any.

    A URI ending in one of ``file_suffixes`` is the single output file; any other URI is a
    directory (or S3 prefix) that receives the standard names of :data:`NAMING` (shard names and
    an index even for one shard when ``always_sharded``).
    """
    limit = parse_size(shard_size) if shard_size is not None else None
    data = [e for e in entries if e.is_data or e.kind == "link"]
    if uri.endswith(file_suffixes):
        if limit is not None:
            raise InvalidRequest(
                # ``uri`` may be the job's staging copy of the target: name the file, not where it sits.
                f"the target {basename(uri)} names one file, but a shard size was given",
                hint="give a directory as the target to write shards",
            )
        planned = plan_shards(data, None, fmt)
        return [ShardFile(uri, planned[0][1], planned[0][2])], None
    base = uri.rstrip("/")
    planned = plan_shards(data, limit, fmt, always_sharded=always_sharded)
    files = [ShardFile(storage.join(base, name), keys, size) for name, keys, size in planned]
    index = storage.join(base, NAMING[fmt].index) if len(files) > 1 or always_sharded else None
    return files, index


def _concurrency(options: dict[str, Any]) -> int:
    """S3 upload parts in flight per output file, from a sink's options."""
    value = options.get("concurrency", DEFAULT_CONCURRENCY)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"concurrency must be a positive integer, not {value!r}")
    return value


class ShardedSink(TensorSink):
    """What the Hugging Face style sinks share: a target that is one file or a directory of
    shards (``shard_size``; ``always_sharded`` writes shard names and an index even for one)."""

    @classmethod
    def remote_buffer_bytes(cls, options: dict[str, Any]) -> int:
        """One output file at a time, through :func:`open_output_writer`'s concurrent part upload
        (``concurrency`` parts in flight: a memory budget may ask for fewer)."""
        return upload_buffer_bytes(concurrency=_concurrency(options))

    def __init__(
        self,
        storage: Storage,
        uri: str,
        *,
        shard_size: int | str | None = None,
        always_sharded: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(storage, uri, shard_size=shard_size, always_sharded=always_sharded, **options)
        self.shard_size = shard_size
        self.always_sharded = always_sharded
        self._outputs = OutputSet(storage, concurrency=_concurrency(options))
        self._skeletons: list[str] = []  # preallocated files _lay_out created (abort removes them)

    def shard_files(self, entries: list[Entry], suffixes: tuple[str, ...]) -> tuple[list[ShardFile], str | None]:
        """Where this sink writes ``entries`` (see :func:`sink_files`)."""
        return sink_files(
            self.storage, self.uri, entries, self.shard_size, self.format, suffixes, always_sharded=self.always_sharded
        )

    # A skeleton (ckptconv.formats.layout): the files others write the values of, and the index.

    def _lay_out(
        self, files: list[tuple[FileLayout, bytes]], heads: list[bytes], index: tuple[str, bytes] | None
    ) -> list[tuple[FileLayout, bytes]]:
        """Create each local output file of ``files`` preallocated, its ``heads`` bytes in place,
        for the processes that write the rest; write the index (when sharded) whole."""
        try:
            create_local_skeletons(self.storage, [f for f, _ in files], heads, self._skeletons)
            if index is not None:
                uri, text = index
                self._outputs.create(uri, role="index").write(text)
            self._outputs.commit()
        except BaseException:
            self.abort()
            raise
        return files

    def side_files(self) -> list[OutputFile]:
        return [f for f in self._outputs.done if f.role != "data"]

    def _abort(self) -> None:
        self._outputs.abort()
        skeletons, self._skeletons = self._skeletons, []
        for uri in skeletons:
            self.storage.delete(uri)


def create_local_skeletons(storage: Storage, files: list[FileLayout], heads: list[bytes], created: list[str]) -> None:
    """Create each local file of ``files`` preallocated at its size with its ``heads`` bytes first,
    for the processes that write the rest (ckptconv.engine.fanout); each one's URI is appended to
    ``created`` at once (what an abort removes)."""
    for layout, head in zip(files, heads, strict=True):
        if storage.local_path(layout.uri) is not None:
            with open_output_writer(storage, layout.uri, layout.size) as writer:
                writer.write(head)
            created.append(layout.uri)


# Writes at least this large are hashed on another thread while they are written: the hash and the
# write both release the GIL, so on two cores a tensor costs max(hash, write) instead of their sum.
BESIDE_HASH_BYTES = 1 << 20
# A larger write to a local file goes out in pieces of this size, each hashed while it is
# written: the write and the hash read each piece from the caches, where a whole tensor (up to
# hundreds of MB) is read from memory twice, and single writes that large into the page cache
# cost more system time per byte (3 GB cs-h5 -> safetensors: about 1 s of CPU less). 1 MiB, not
# 4: a piece must stay in the caches between the write's copy and the hash; 4 MiB pieces tripled
# the system time of that conversion again (5.0-6.4 s against 1.7-1.8 s; 256 KiB: 2.6-2.8 s).
WRITE_PIECE_BYTES = 1 << 20


class HashingWriter:
    """A storage writer that computes the digest (``ckptconv.storage.digests``) and size of what
    passes through it.

    ``hasher``: a one-thread pool that hashes large writes while the storage writes them;
    ``piece_bytes``: the most handed to the storage at once (a local file's writes), or None.
    """

    def __init__(
        self, writer: Writer, role: str, hasher: ThreadPoolExecutor | None = None, piece_bytes: int | None = None
    ) -> None:
        self.writer = writer
        self.role = role
        self.hash = new_hash()
        self.size = 0
        self._hasher = hasher
        self._piece = piece_bytes

    @property
    def uri(self) -> str:
        return self.writer.uri

    def write(self, data: bytes | bytearray | memoryview, each: Callable[[memoryview], None] | None = None) -> None:
        """Write ``data``; ``each(piece)``, when given, runs on this thread on every piece once it
        is written, while that piece's digest is computed on the other thread (a second checksum
        the format needs, a zip member's CRC-32: beside the digest instead of after it)."""
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        if self._hasher is None or n < BESIDE_HASH_BYTES:
            self.hash.update(data)
            self.writer.write(data)
            if each is not None:
                each(memoryview(data).cast("B"))
        else:
            view = memoryview(data).cast("B")
            step = self._piece or n
            for at in range(0, n, step):
                piece = view[at : at + step]
                hashed = self._hasher.submit(self.hash.update, piece)
                try:
                    self.writer.write(piece)
                    if each is not None:
                        each(piece)
                finally:
                    hashed.result()  # the caller may reuse ``data`` once we return; hashes stay in order
        self.size += n


class OutputSet:
    """The files of one sink, written one after another; :meth:`abort` removes them all.

    A file is committed as soon as it is complete (:meth:`close`), so an S3 upload's last part
    does not wait in memory for the other shards; the sink writes under a staging URI that the
    engine publishes later. A failure half way through removes every file already committed.
    """

    def __init__(self, storage: Storage, *, concurrency: int = DEFAULT_CONCURRENCY) -> None:
        self.storage = storage
        self.concurrency = concurrency
        self.open: list[HashingWriter] = []
        self.done: list[OutputFile] = []
        self._hasher: ThreadPoolExecutor | None = None

    def create(self, uri: str, role: str = "data", size: int | None = None) -> HashingWriter:
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="digest")
        writer = open_output_writer(self.storage, uri, size, concurrency=self.concurrency, bulk=role == "data")
        # Pieces for a local file only: an upload cuts its parts from whatever it is given.
        piece = WRITE_PIECE_BYTES if self.storage.local_path(uri) is not None else None
        w = HashingWriter(writer, role, self._hasher, piece)
        self.open.append(w)
        return w

    def _stop_hasher(self) -> None:
        hasher, self._hasher = self._hasher, None
        if hasher is not None:
            hasher.shutdown(wait=True)

    def close(self, w: HashingWriter) -> None:
        """Commit one complete file."""
        self.open.remove(w)
        try:
            w.writer.commit()
        except BaseException:
            self.abort()
            raise
        self.done.append(OutputFile(w.uri, w.size, w.hash.hexdigest(), w.role))

    def commit(self) -> list[OutputFile]:
        """Commit the files still open; every file written, in order."""
        for w in list(self.open):
            self.close(w)
        self._stop_hasher()
        return list(self.done)

    def abort(self) -> None:
        """Discard every file, committed or not; idempotent."""
        self._stop_hasher()
        writers, self.open = self.open, []
        for w in writers:
            w.writer.abort()
        done, self.done = self.done, []
        for f in done:
            self.storage.delete(f.uri)


# --- raw tensor bytes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where one tensor's bytes sit: an absolute byte range of one file, C order, little-endian."""

    uri: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def tensor_view(value: torch.Tensor | RawTensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor in C order, without copying when contiguous."""
    if isinstance(value, RawTensor):
        return memoryview(value.data).cast("B")
    import torch

    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def read_slot(storage: Storage, slot: Slot, fd: int | None = None, *, raw: bool = False) -> torch.Tensor | RawTensor:
    """One tensor from its byte range, read straight into the tensor's memory.

    ``fd`` (an open local file) reads with ``preadv`` and no intermediate copy, the tensor placed
    in phase with its offset so that its whole blocks go around the page cache
    (ckptconv.storage.direct_reads); otherwise one ranged read of exactly the tensor's bytes.
    ``raw``: a :class:`RawTensor`, without torch.
    """
    t, buf = _slot_buffer(slot, raw)
    if slot.nbytes == 0:
        return t
    if fd is not None:
        if read_file_into(fd, slot.offset, buf) < slot.nbytes:
            raise CorruptCheckpoint(f"{slot.uri} ends early: wanted {slot.nbytes} bytes at offset {slot.offset}")
    else:
        storage.read_into(slot.uri, slot.offset, buf)
    return t


def read_neighbours(storage: Storage, slots: list[Slot], *, raw: bool = False) -> list[torch.Tensor | RawTensor]:
    """Tensors whose byte ranges follow each other in one file, each in its own memory, read as
    the storage reads neighbouring ranges (``Storage.read_scattered``: one request on S3)."""
    first = slots[0]
    end = first.offset
    for slot in slots:
        if slot.uri != first.uri or slot.offset != end:
            raise ValueError(f"{slot.uri} at {slot.offset} does not follow the range before it (ends at {end})")
        end += slot.nbytes
    made = [_slot_buffer(slot, raw) for slot in slots]
    storage.read_scattered(first.uri, first.offset, [buf for _, buf in made])
    return [t for t, _ in made]


def _slot_buffer(slot: Slot, raw: bool) -> tuple[torch.Tensor | RawTensor, memoryview]:
    """An empty tensor for ``slot`` and its bytes as a writable view."""
    # Deferred: the buffer pool imports numpy, and the API process imports this module (shard
    # sizes) without numpy or torch.
    from ckptconv.formats.memory import empty_raw, empty_tensor

    # In phase with the file: its whole blocks are read around the page cache (storage.direct_reads).
    phase = slot.offset % ALIGN
    if raw:
        t = empty_raw(slot.shape, slot.dtype, phase=phase)
        return t, memoryview(t.data).cast("B")
    import torch

    tensor = empty_tensor(slot.shape, slot.dtype, phase=phase)
    if slot.nbytes == 0:
        return tensor, memoryview(bytearray())
    return tensor, memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


class LocalFiles:
    """File descriptors of local files, opened on first use (remote URIs get None)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._fds: dict[str, int | None] = {}
        self._lock = threading.Lock()  # readers on several threads open files on first use

    def fd(self, uri: str) -> int | None:
        with self._lock:
            if uri not in self._fds:
                path = self.storage.local_path(uri)
                self._fds[uri] = os.open(path, os.O_RDONLY) if path is not None else None
            return self._fds[uri]

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
