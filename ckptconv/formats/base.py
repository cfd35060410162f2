"""The reader/writer protocol every checkpoint format implements.

A checkpoint is an ordered list of :class:`Entry` (one per flat key) plus an optional
:class:`~ckptconv.formats.tree.TreeSpec` saying how the flat keys nest. Every conversion is
``source -> entries -> sink``; there are no pairwise converters.

Call order and guarantees:

- ``TensorSource``: ``entries()`` and ``spec`` come from metadata only (headers, indexes, H5
  attributes) and never read tensor data. ``read(key)`` materializes exactly one value; the caller
  drops it before asking for the next, so memory is bounded by the largest tensor. ``read`` may be
  called in any order, and more than once. Sources are not thread-safe unless they say so.
- ``TensorSink``: ``begin(entries, spec)`` announces everything before any data (a safetensors
  header is computed from it), then ``write(key, value)`` is called once per non-link entry in the
  announced order, then ``commit()`` publishes atomically and returns the files written, or
  ``abort()`` leaves nothing at the target. Nothing is visible at the target before ``commit``.
  :class:`TensorSink` itself enforces that order (one :class:`~ckptconv.core.errors.SinkProtocolError`
  for every breach); a format implements ``_begin``/``_write``/``_commit``/``_abort``.

Values in flight:

- ``tensor`` and ``array`` entries travel as CPU ``torch.Tensor`` (``array`` marks a value that was
  a numpy array in its source, which Cerebras H5 keeps distinct), or as :class:`RawTensor` (its
  bytes, dtype and shape) when the reader asked the source for them (``TensorSource.raw_reads``)
  and hands them only to sinks that take them (``TensorSink.accepts_raw``);
- ``value`` entries are plain Python scalars, strings or None, known from metadata
  (``Entry.value``);
- ``object`` entries are :class:`OpaqueObject` (bytes a source could not or would not decode);
- ``link`` entries alias ``Entry.target`` (tied weights); sinks that cannot link write a copy.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ckptconv.core.dtypes import dtype_size
from ckptconv.core.errors import CorruptCheckpoint, SinkProtocolError, UnsupportedDtype, UnsupportedValue
from ckptconv.storage.base import streaming_buffer_bytes
from ckptconv.storage.digests import ALGORITHM, digest_facts, entry_digests
from ckptconv.storage.local import check_free_space

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ckptconv.formats.layout import FileLayout
    from ckptconv.formats.tree import TreeSpec
    from ckptconv.storage.base import ObjectInfo, Storage

EntryKind = Literal["tensor", "array", "value", "object", "link"]


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UnsupportedDtype(f"unknown dtype {name!r}")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def given_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options a caller set: those whose value is None stand for "not set", so a source or
    sink keeps its own default for them."""
    return {k: v for k, v in (options or {}).items() if v is not None}


class RawTensor:
    """A tensor as its bytes: ``data`` (a 1-D uint8 numpy array, C order, little-endian), the
    ckptconv ``dtype`` name and the ``shape``.

    Why: a conversion that only moves bytes (safetensors <-> Cerebras H5, keys renamed or not)
    has no use for torch, whose import costs about 2 s of CPU in every process, before the first
    byte moves. Sources that can return these when asked (``TensorSource.raw_reads``); sinks that
    take them say so (``TensorSink.accepts_raw``); :meth:`torch` is the same memory as a tensor for
    everything else (a transform, a sink that needs torch).
    """

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> None:
        self.data = data
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)  # plain ints: the shape is part of the value's digest

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def torch(self) -> torch.Tensor:
        """The tensor over the same memory (it keeps ``data`` alive)."""
        import torch

        tdtype = torch_dtype(self.dtype)
        if self.data.size == 0:
            return torch.empty(self.shape, dtype=tdtype)
        return torch.from_numpy(self.data).view(tdtype).view(self.shape)


def as_torch(value: Any) -> Any:
    """``value``, with a :class:`RawTensor` turned into its torch tensor (same memory)."""
    return value.torch() if isinstance(value, RawTensor) else value


def check_bool_bytes(key: str, dtype: str, data: Any) -> None:
    """A bool tensor's bytes (``data``: a buffer or a numpy array), as read, must each be 0 or 1:
    numpy, torch and a cast keep any other byte as it is (a "True" equal to neither True nor
    False), and ckptconv's own readers refuse it in the files written from it. CorruptCheckpoint
    naming ``key`` otherwise; nothing to check for other dtypes."""
    if dtype != "bool":
        return
    import numpy as np

    raw = data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    if raw.size and raw.max() > 1:
        raise CorruptCheckpoint(f"{key!r}: bool tensor holds values other than 0 and 1")


def value_dtype(value: Any) -> str:
    """The ckptconv dtype name of a tensor value (``torch.Tensor`` or :class:`RawTensor`)."""
    return value.dtype if isinstance(value, RawTensor) else dtype_name(value.dtype)


@dataclass(frozen=True)
class Entry:
    """One flat key of a checkpoint, described without reading its data."""

    key: str
    kind: EntryKind = "tensor"
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    value: Any = None  # for kind "value": the Python value itself
    target: str | None = None  # for kind "link": the key this one aliases
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # format-specific extras

    @property
    def is_data(self) -> bool:
        """True when the entry has bytes to move (tensor, array, object)."""
        return self.kind in ("tensor", "array", "object")

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0

    @property
    def nbytes(self) -> int:
        if self.kind in ("tensor", "array") and self.dtype is not None and self.shape is not None:
            return self.numel * dtype_size(self.dtype)
        if self.kind == "object":
            return int(self.meta.get("nbytes", 0))
        return 0

    def with_dtype(self, dtype: str) -> Entry:
        return replace(self, dtype=dtype)


@dataclass(frozen=True)
class OpaqueObject:
    """A payload kept as bytes (e.g. a dill pickle inside a Cerebras H5 file).

    ``value`` holds the decoded object when it consisted only of plain data types; otherwise it is
    None and only the bytes travel, unchanged and never executed.
    """

    payload: bytes
    encoding: str = "dill"
    value: Any = None
    decoded: bool = False


@dataclass(frozen=True)
class OutputFile:
    uri: str
    size: int
    # The file's hex digest (``algorithm``: ckptconv.storage.digests), or None for a file written out
    # of order, whose digest would need a second read.
    digest: str | None = None
    role: str = "data"  # data | index | config | manifest
    # The block digest ({"block_size", <algorithm>}) of a file written out of order.
    blocks: dict[str, Any] | None = None
    # The hash of both: this version's, or an earlier one's in a manifest it published.
    algorithm: str = ALGORITHM

    def facts(self) -> dict[str, Any]:
        """The file as a job result or manifest entry records it: uri, size, role and its digests."""
        return {
            "uri": self.uri,
            "size": self.size,
            "role": self.role,
            **digest_facts(self.digest, self.blocks, self.algorithm),
        }

    @classmethod
    def from_facts(cls, entry: dict[str, Any]) -> OutputFile:
        """The file a manifest entry describes (written by this version or an earlier one)."""
        algorithm, digest, blocks = entry_digests(entry)
        return cls(entry["uri"], entry["size"], digest, entry.get("role", "data"), blocks, algorithm)


class Extent(NamedTuple):
    """A value's bytes in a file: ``nbytes`` from ``offset`` of ``uri``."""

    uri: str
    offset: int
    nbytes: int


class TensorSource(abc.ABC):
    """Reads one checkpoint, one value at a time. See the module docstring for the contract."""

    format: str = ""
    #: How many values ``read`` may be asked for at once, from as many threads. Sources whose
    #: reads are independent and thread-safe (positioned reads of known byte ranges) raise it to
    #: what their storage serves well (``Storage.read_parallelism``); the executor reads that many
    #: values ahead within its memory budget.
    read_parallelism: int = 1
    #: Set by a reader whose sink takes :class:`RawTensor` values: a source that can then returns
    #: its tensors as RawTensor, without importing torch. Only the formats that read tensors as
    #: plain bytes look at it; the others return ``torch.Tensor`` whatever it says.
    raw_reads: bool = False

    def __init__(self, storage: Storage, uri: str) -> None:
        self.storage = storage
        self.uri = uri

    @contextlib.contextmanager
    def reading_raw(self, raw: bool) -> Iterator[None]:
        """Within the block, ``raw_reads`` is ``raw``; afterwards what it was."""
        before, self.raw_reads = self.raw_reads, raw
        try:
            yield
        finally:
            self.raw_reads = before

    @abc.abstractmethod
    def entries(self) -> list[Entry]:
        """Every flat key in checkpoint order, from metadata only."""

    @property
    def spec(self) -> TreeSpec | None:
        """How the flat keys nest; None means a flat dict in ``entries()`` order."""
        return None

    @property
    def info(self) -> dict[str, Any]:
        """Format-level facts for `inspect` (e.g. Cerebras release, H5 format version)."""
        return {}

    @abc.abstractmethod
    def read(self, key: str) -> Any:
        """Materialize one value (see the module docstring for value types)."""

    def extent(self, key: str) -> Extent | None:
        """Where ``key``'s value lies as plain bytes in a file whose storage reads neighbouring
        ranges together (``Storage.coalesce_bytes``); None: the value is read on its own."""
        return None

    def read_neighbours(self, keys: list[str]) -> list[Any]:
        """The values of ``keys``, whose extents follow each other in one file in this order: read
        together (one request on object storage), each in its own memory. By default one by one."""
        return [self.read(k) for k in keys]

    def files(self) -> list[str]:
        """URIs of every file this checkpoint consists of (shards, index), for provenance."""
        return [self.uri]

    def file_info(self, uri: str) -> ObjectInfo:
        """Size and ETag of one of ``files()``: as learned while opening it (the ranged read of a
        header tells both), else asked of the storage."""
        known: dict[str, ObjectInfo] = self.__dict__.get("_file_infos", {})
        return known.get(uri) or self.storage.stat(uri)

    def learned(self, info: ObjectInfo | None) -> None:
        """Keep what reading a file told about it, so provenance need not ask the storage again."""
        if info is not None:
            self.__dict__.setdefault("_file_infos", {})[info.uri] = info

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class TensorSink(abc.ABC):
    """Writes one checkpoint, one value at a time. See the module docstring for the contract.

    The contract's order is enforced here, once, for every format: ``begin`` once, then ``write``
    for each announced non-link entry in the announced order, then ``commit`` once, each breach a
    :class:`~ckptconv.core.errors.SinkProtocolError`. A format implements ``_begin``, ``_write``
    (called only with the key that is due), ``_commit`` (called only once every write happened)
    and ``_abort`` (may be called in any state, and more than once).
    """

    format: str = ""
    supports_links: bool = False
    supports_objects: bool = True
    supported_dtypes: frozenset[str] | None = None  # None: every dtype in DTYPE_SIZES
    #: ``write`` takes tensors as :class:`RawTensor` as well as ``torch.Tensor``.
    accepts_raw: bool = False

    def __init__(self, storage: Storage, uri: str, **options: Any) -> None:
        self.storage = storage
        self.uri = uri
        self.options = options
        self._state: Literal["new", "open", "committed", "closed"] = "new"
        self._write_order: list[str] = []  # the keys write() receives, in the announced order
        self._writes_done = 0  # how many of them were written: the next one is due
        self._on_checked: Callable[[], None] | None = None  # see begin()

    @classmethod
    def remote_buffer_bytes(cls, options: dict[str, Any]) -> int:
        """Bytes this format's writers hold in upload buffers when the target is on S3, given the
        sink's ``options`` (memory budgets count them). By default one streaming writer at a time."""
        return streaming_buffer_bytes()

    @classmethod
    def unsplittable(cls, options: dict[str, Any]) -> str | None:
        """Why an output written with the sink's ``options`` cannot be cut into parts that several
        processes write (see :mod:`ckptconv.engine.fanout`), or None when it can."""
        return None

    @classmethod
    def check(cls, entries: Iterable[Entry]) -> None:
        """Refuse, before any data moves (and in dry runs), entries this format cannot hold.

        A classmethod so plans can be checked without creating a sink; formats with more rules
        override it (as a classmethod) and call ``super().check(entries)``.
        """
        for e in entries:
            if not e.key.isascii() and not _utf8(e.key):
                # Every container names its values in UTF-8 (JSON headers, HDF5, S3 keys, TF's
                # table): a key JSON escaped as a lone surrogate is refused before any work.
                raise UnsupportedValue(
                    f"{e.key!r} is not valid Unicode text (it holds a lone surrogate)",
                    key=e.key,
                    hint="rename the key in the source checkpoint",
                )
            if cls.supported_dtypes is None:
                continue
            if e.kind in ("tensor", "array") and e.dtype not in cls.supported_dtypes:
                raise UnsupportedDtype(
                    f"{cls.format} cannot store {e.key!r} of dtype {e.dtype}",
                    key=e.key,
                    dtype=e.dtype,
                )

    def begin(
        self, entries: list[Entry], spec: TreeSpec | None, *, on_checked: Callable[[], None] | None = None
    ) -> None:
        """Announce every entry (and how they nest) before any data.

        ``on_checked`` is called once, when the sink has made every check by which it refuses a job
        up front (a target already there, keys it cannot hold, too little free space), before the
        rest of its preparation: the executor starts reading the source there, so that a sink with
        a slow preparation (the cs-h5 skeleton) does not keep the source idle, and a refused job
        reads nothing. Sinks call it at the end of ``begin`` unless they call
        :meth:`_checks_passed` earlier.
        """
        self._require("begin()", allowed=("new",))
        entries = list(entries)
        self._state = "closed"  # a begin that fails leaves a sink fit only for abort()
        self._on_checked = on_checked
        try:
            self._begin(entries, spec)
            self._check_free_space()
            self._checks_passed()
        finally:
            self._on_checked = None  # a refused begin keeps no hold on the caller's objects
        self._write_order = [e.key for e in entries if e.kind != "link"]
        self._writes_done = 0
        self._state = "open"

    def planned_local_bytes(self) -> int:
        """What this sink's files take (known after ``_begin``: the sizes its plan lays out), for
        the free-space check of a local target; 0 where not known up front, or where the sink
        checks for itself (cs-h5, before HDF5 writes)."""
        return 0

    def _checks_passed(self) -> None:
        """Tell the caller of ``begin`` that this sink will refuse nothing more (once)."""
        on_checked, self._on_checked = self._on_checked, None
        if on_checked is not None:
            on_checked()

    def _check_free_space(self) -> None:
        # One check for every local output, before its first byte: a job that cannot fit fails at
        # once, not with a full disk after writing most of it (a later shard, an archive).
        nbytes = self.planned_local_bytes()
        path = self.storage.local_path(self.uri) if nbytes else None
        if path is not None:
            check_free_space(str(path), nbytes, self.uri)

    def write(self, key: str, value: Any) -> None:
        """Write the value of the next announced non-link entry."""
        self._require_due(f"write({key!r})", key)
        self._write(key, value)
        self._writes_done += 1

    def commit(self) -> list[OutputFile]:
        """Publish what was written (every announced entry); returns the files written."""
        self._require_all_written("commit()")
        self._state = "committed"
        return self._commit()

    # An output written by several processes (ckptconv.engine.fanout), for formats whose byte
    # layout is known before any value (see ckptconv.formats.layout): the sink writes everything but
    # the values of ``placed_keys()``, each of which is ``reserve``d in its turn instead of written;
    # ``finish_skeleton`` then returns each file's layout and gap bytes, for the processes that
    # write the values in place.

    def placed_keys(self) -> set[str]:
        """Entries whose bytes have a place known up front (after ``begin``); none by default."""
        return set()

    def reserve(self, key: str) -> None:
        """Stand for ``write(key, ...)`` of a placed entry whose bytes another process writes."""
        self._require_due(f"reserve({key!r})", key)
        if key not in self.placed_keys():
            raise SinkProtocolError(f"{self.format} sink: {key!r} has no place known up front", key=key)
        self._reserve(key)
        self._writes_done += 1

    def finish_skeleton(self) -> list[tuple[FileLayout, bytes]]:
        """Every entry written or reserved: each output file's layout and gap bytes."""
        self._require_all_written("finish_skeleton()")
        self._state = "committed"
        return self._finish_skeleton()

    def side_files(self) -> list[OutputFile]:
        """Files ``finish_skeleton`` wrote whole (an index), with their checksums."""
        return []

    def late_recipe(self) -> dict[str, Any] | None:
        """After ``finish_skeleton``: what :meth:`late_files` needs to write the files that hold
        the values' checksums (a TensorFlow bundle's index), as JSON; None when there are none."""
        return None

    @classmethod
    def late_files(cls, recipe: dict[str, Any], checksums: dict[str, int]) -> list[tuple[str, bytes, str]]:
        """``(uri, bytes, role)`` of each file written last, from ``recipe`` and the checksum of
        every value (by key, as ``FileLayout.checksum`` names it)."""
        return []

    def _reserve(self, key: str) -> None:
        raise SinkProtocolError(f"{self.format} sink: no value can be placed by another process")

    def _finish_skeleton(self) -> list[tuple[FileLayout, bytes]]:
        raise SinkProtocolError(f"{self.format} sink: the byte layout is not known up front")

    def _require_due(self, call: str, key: str) -> None:
        self._require(call)
        expected = self._write_order[self._writes_done] if self._writes_done < len(self._write_order) else None
        if key != expected:
            raise SinkProtocolError(
                f"{self.format} sink: {call} out of order; expected {expected!r}", key=key, expected=expected
            )

    def _require_all_written(self, call: str) -> None:
        self._require(call)
        if self._writes_done != len(self._write_order):
            raise SinkProtocolError(
                f"{self.format} sink: {call} after {self._writes_done} of {len(self._write_order)} writes; "
                f"{self._write_order[self._writes_done]!r} is still due",
                key=self._write_order[self._writes_done],
            )

    def abort(self) -> None:
        """Leave nothing at the target; harmless in any state and when repeated."""
        self._state = "closed"
        self._abort()

    def _require(self, call: str, allowed: tuple[str, ...] = ("open",)) -> None:
        if self._state in allowed:
            return
        why = {
            "new": "before begin()",
            "open": "after begin()",
            "committed": "after commit()",
            "closed": "after abort() or a failed begin()",
        }[self._state]
        raise SinkProtocolError(f"{self.format} sink: {call} {why}")

    @abc.abstractmethod
    def _begin(self, entries: list[Entry], spec: TreeSpec | None) -> None:
        """Validate and plan everything announced; may refuse before any data moves."""

    @abc.abstractmethod
    def _write(self, key: str, value: Any) -> None:
        """Store the value of ``key``, the entry that is due."""

    @abc.abstractmethod
    def _commit(self) -> list[OutputFile]:
        """Publish atomically; every announced entry has been written."""

    @abc.abstractmethod
    def _abort(self) -> None:
        """Remove everything written so far."""
