"""The contract every container format meets (:mod:`ckptconv.formats.base`), as a test suite.

Used only by tests, never by ckptconv at run time (it imports pytest at the top; pytest comes with
the ``test`` extra). A format's test module subclasses :class:`FormatTests` and names the format;
everything else follows from its registry entry (:mod:`ckptconv.formats.registry`): which tests
apply (a read-only format skips the writing ones), the dtypes it must hold and refuse, whether
shards, links and opaque objects are checked::

    class TestSafetensors(FormatTests):
        format = "safetensors"
        attack_dir = ATTACKS  # hostile files, picked up by file-name prefix ("st_...")
        attack_prefix = "st_"
        attack_expected = make_tensor_attacks.EXPECTED  # name -> (error class name or None, "open" | "read")

The same class runs on S3 by overriding the ``base_uri`` fixture (an empty area to write under).
What it checks: the registry entry against the classes; every dtype the format holds round-trips
bit for bit, every dtype it cannot hold is refused before any data; the write order (one
:class:`~ckptconv.core.errors.SinkProtocolError` for each breach) and values unlike their
announcement; nothing readable before ``commit`` and nothing left after ``abort`` (finished shards
included); the engine's ``target_exists`` sees a written checkpoint; nesting, plain values and tied
weights survive; opaque objects are kept, or refused before any data where the format cannot keep
them; each hostile file is refused with its typed error (none of its payloads runs), also as a
conversion's source, leaving nothing behind; and a checkpoint goes through the engine to every
writable format and back unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from ckptconv.core.dtypes import DTYPE_SIZES
from ckptconv.core.errors import (
    CheckpointError,
    CkptconvError,
    SinkProtocolError,
    UnsupportedDtype,
    UnsupportedValue,
)
from ckptconv.engine.convert import convert
from ckptconv.formats import FORMATS, FormatSpec, sink_class, source_class, target_exists
from ckptconv.formats.base import Entry, OpaqueObject, OutputFile, TensorSink, TensorSource, dtype_name
from ckptconv.formats.tree import TreeSpec, flatten
from ckptconv.storage import open_storage
from ckptconv.storage.base import Storage

# Dtypes every writable format holds: what the engine round trip through all of them carries.
_COMMON_DTYPES = ("float32", "bfloat16", "float16", "int64", "int32", "uint8", "bool")
_SMALL_FILE = 50_000  # a hostile file is small: what it costs to read must not grow with its claims


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of random bits of ``dtype`` (every bit pattern, NaNs included; bools 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dt == torch.bool:
        raw = raw % 2
    return raw.view(dt).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same_tensor(a: Any, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


def tensor_entries(values: Mapping[str, torch.Tensor]) -> list[Entry]:
    return [Entry(k, "tensor", dtype_name(v.dtype), tuple(v.shape)) for k, v in values.items()]


def write_all(
    sink: TensorSink, entries: list[Entry], spec: TreeSpec | None, values: Mapping[str, Any]
) -> list[OutputFile]:
    """The whole sink protocol: begin, every non-link value in order, commit (abort on failure)."""
    try:
        sink.begin(entries, spec)
        for e in entries:
            if e.kind != "link":
                sink.write(e.key, values[e.key])
        return sink.commit()
    except BaseException:
        sink.abort()
        raise


def read_all(source: TensorSource) -> dict[str, Any]:
    return {e.key: source.read(e.key) for e in source.entries() if e.kind != "link"}


def names_under(storage: Storage, base: str) -> list[str]:
    return [info.uri[len(base) + 1 :] for info in storage.list(base + "/")]


class FormatTests:
    """The format contract; subclass it and set ``format`` (see the module docstring)."""

    format: ClassVar[str]
    target_name: ClassVar[str] = "ckpt"  # the checkpoint's name under ``base_uri``
    mismatch_error: ClassVar[type[CkptconvError]] = CheckpointError  # a value unlike its announcement
    attack_dir: ClassVar[Path | None] = None
    attack_prefix: ClassVar[str | None] = None
    attack_expected: ClassVar[Mapping[str, tuple[str | None, str]]] = {}
    attack_marker: ClassVar[str | None] = None  # the file a payload that ran would leave in the working directory

    # --- the subclass's parameters ------------------------------------------------------------

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "attack" in metafunc.fixturenames:
            metafunc.parametrize("attack", self.attack_names(), ids=str)
        if "other_format" in metafunc.fixturenames:
            metafunc.parametrize("other_format", [f.name for f in FORMATS.values() if f.write])

    def attack_names(self) -> list[str]:
        """The hostile files of this format: every name in ``attack_dir`` with ``attack_prefix``."""
        if self.attack_dir is None or self.attack_prefix is None:
            return []
        return sorted(p.name for p in self.attack_dir.iterdir() if p.name.startswith(self.attack_prefix))

    @pytest.fixture
    def base_uri(self, tmp_path: Path) -> str:
        """An empty area the tests write under (override for another backend)."""
        return str(tmp_path.resolve() / "area")

    @property
    def spec(self) -> FormatSpec:
        return FORMATS[self.format]

    def writable(self) -> None:
        if not self.spec.write:
            pytest.skip(f"{self.format} is read only")

    def sink(self, base: str, **options: Any) -> TensorSink:
        uri = f"{base}/{self.target_name}"
        return sink_class(self.format)(open_storage(uri), uri, **options)

    def source(self, base: str) -> TensorSource:
        uri = f"{base}/{self.target_name}"
        return source_class(self.format)(open_storage(uri), uri)

    # --- the registry entry ---------------------------------------------------------------------

    def test_registry_entry_matches_the_classes(self) -> None:
        spec = self.spec
        if spec.read:
            assert source_class(self.format).__name__ == spec.source
        if not spec.write:
            return
        cls = sink_class(self.format)
        assert cls.__name__ == spec.sink and cls.format == self.format
        assert cls.supports_links == spec.capabilities.links
        assert cls.supports_objects == spec.capabilities.objects
        refused = set()
        for dtype in DTYPE_SIZES:
            try:
                cls.check([Entry("x", "tensor", dtype, (1,))])
            except UnsupportedDtype:
                refused.add(dtype)
        assert refused == spec.capabilities.cannot_hold

    # --- what it holds and refuses --------------------------------------------------------------

    def test_every_dtype_it_holds_round_trips_bit_exactly(self, base_uri: str) -> None:
        self.writable()
        held = [d for d in DTYPE_SIZES if d not in self.spec.capabilities.cannot_hold]
        values = {f"t.{d}": sample(d, (3, 2), seed=i) for i, d in enumerate(held)}
        values |= {"scalar": sample("float32", ()), "empty": sample("float32", (0, 4))}
        entries = tensor_entries(values)
        write_all(self.sink(base_uri), entries, None, values)
        src = self.source(base_uri)
        if not self.spec.capabilities.keeps_order:
            entries.sort(key=lambda e: e.key)
        assert [(e.key, e.kind, e.dtype, e.shape) for e in src.entries()] == [
            (e.key, e.kind, e.dtype, e.shape) for e in entries
        ]
        for key, value in values.items():
            assert same_tensor(src.read(key), value), key

    def test_what_it_cannot_hold_is_refused_before_any_data(self, base_uri: str) -> None:
        self.writable()
        for dtype in sorted(self.spec.capabilities.cannot_hold):
            entries = [Entry("ok", "tensor", "float32", (2,)), Entry("bad", "tensor", dtype, (2,))]
            with pytest.raises(UnsupportedDtype):
                sink_class(self.format).check(entries)  # also without a sink: dry runs check plans
            sink = self.sink(base_uri)
            with pytest.raises(UnsupportedDtype):
                sink.begin(entries, None)
            sink.abort()
            assert names_under(open_storage(base_uri), base_uri) == []

    # --- the write contract ---------------------------------------------------------------------

    def test_writes_follow_the_announced_order(self, base_uri: str) -> None:
        self.writable()
        values = {"a": sample("float32", (2,)), "b": sample("float32", (2,), 1)}
        sink = self.sink(base_uri)
        with pytest.raises(SinkProtocolError, match="before begin"):
            sink.write("a", values["a"])
        sink.begin(tensor_entries(values), None)
        with pytest.raises(SinkProtocolError, match="begin\\(\\) after begin"):
            sink.begin(tensor_entries(values), None)
        with pytest.raises(SinkProtocolError, match="expected 'a'"):
            sink.write("b", values["b"])
        sink.write("a", values["a"])
        with pytest.raises(SinkProtocolError, match="expected 'b'"):
            sink.write("a", values["a"])  # once each
        with pytest.raises(SinkProtocolError, match="after 1 of 2 writes"):
            sink.commit()
        sink.write("b", values["b"])
        with pytest.raises(SinkProtocolError, match="expected None"):
            sink.write("c", values["b"])  # nothing more was announced
        sink.commit()
        with pytest.raises(SinkProtocolError, match="after commit"):
            sink.commit()
        assert all(same_tensor(v, values[k]) for k, v in read_all(self.source(base_uri)).items())

    def test_a_value_unlike_its_announcement_is_refused(self, base_uri: str) -> None:
        self.writable()
        entries = [Entry("a", "tensor", "float32", (2,)), Entry("b", "tensor", "float32", (2,))]
        for wrong in (torch.zeros(3), torch.zeros(2, dtype=torch.int32)):  # other shape; same size, other dtype
            sink = self.sink(base_uri)
            sink.begin(entries, None)
            with pytest.raises(self.mismatch_error):
                sink.write("a", wrong)
            sink.abort()
        assert names_under(open_storage(base_uri), base_uri) == []

    def test_nothing_readable_before_commit_and_abort_leaves_nothing(self, base_uri: str) -> None:
        self.writable()
        values = {f"w{i}": sample("float32", (16,), i) for i in range(4)}
        sink = self.sink(base_uri)
        sink.begin(tensor_entries(values), None)
        for key in list(values)[:3]:
            sink.write(key, values[key])
        with pytest.raises(CkptconvError):
            self.source(base_uri).entries()
        sink.abort()
        sink.abort()  # harmless when repeated
        with pytest.raises(SinkProtocolError, match="after abort"):
            sink.write("w3", values["w3"])
        assert names_under(open_storage(base_uri), base_uri) == []

    def test_abort_removes_finished_shards(self, base_uri: str) -> None:
        self.writable()
        if not self.spec.capabilities.shard_size:
            pytest.skip(f"{self.format} has no shard_size")
        values = {f"w{i}": sample("float32", (16,), i) for i in range(4)}  # 64 bytes each
        sink = self.sink(base_uri, shard_size=64)
        sink.begin(tensor_entries(values), None)
        for key in list(values)[:3]:
            sink.write(key, values[key])
        storage = open_storage(base_uri)
        sink.abort()
        assert names_under(storage, base_uri) == []

    def test_a_written_checkpoint_is_a_taken_target(self, base_uri: str) -> None:
        self.writable()
        uri = f"{base_uri}/{self.target_name}"
        storage = open_storage(uri)
        assert not target_exists(storage, uri, self.format)
        values = {"w": sample("float32", (4,))}
        write_all(self.sink(base_uri), tensor_entries(values), None, values)
        assert target_exists(storage, uri, self.format)

    def test_nesting_values_and_ties_survive(self, base_uri: str) -> None:
        self.writable()
        w = sample("float32", (2, 3))
        leaves, spec = flatten({"model": {"w": w, "tied": w}, "step": 10, "name": "héllo"})
        assert [k for k, _ in leaves] == ["model.w", "model.tied", "step", "name"]
        entries = [
            Entry("model.w", "tensor", "float32", (2, 3)),
            Entry("model.tied", "link", target="model.w"),
            Entry("step", "value", value=10),
            Entry("name", "value", value="héllo"),
        ]
        write_all(self.sink(base_uri), entries, spec, {"model.w": w, "step": 10, "name": "héllo"})
        src = self.source(base_uri)
        got = {e.key: e for e in src.entries()}
        assert list(got) == [e.key for e in entries]
        assert src.spec is not None and src.spec.keys() == spec.keys()
        assert got["step"].value == 10 and got["name"].value == "héllo"
        assert same_tensor(src.read("model.w"), w)
        if self.spec.capabilities.links:
            assert got["model.tied"].kind == "link" and got["model.tied"].target == "model.w"
        else:  # written as a copy
            assert same_tensor(src.read("model.tied"), w)

    def test_opaque_objects_are_kept_or_refused_before_any_data(self, base_uri: str) -> None:
        self.writable()
        blob = OpaqueObject(b"\x80\x04K\x01.", encoding="dill")  # a pickle of 1, never decoded
        entries = [
            Entry("w", "tensor", "float32", (2,)),
            Entry("blob", "object", meta={"nbytes": 5, "encoding": "dill"}),
        ]
        values = {"w": sample("float32", (2,)), "blob": blob}
        if not self.spec.capabilities.objects:
            with pytest.raises(UnsupportedValue):
                sink_class(self.format).check(entries)
            return
        write_all(self.sink(base_uri), entries, None, values)
        got = self.source(base_uri).read("blob")
        assert isinstance(got, OpaqueObject) and got.payload == blob.payload and got.encoding == "dill"

    # --- hostile input ------------------------------------------------------------------------

    def test_every_hostile_file_has_an_expectation(self) -> None:
        if self.attack_dir is None:
            pytest.skip(f"no hostile corpus for {self.format} here")
        names = self.attack_names()
        assert sorted(k for k in self.attack_expected if k in names) == names
        prefix = self.attack_prefix or ""
        assert all(k in names for k in self.attack_expected if k.startswith(prefix)), "an expectation without its file"

    def test_hostile_file_is_refused_typed_and_never_runs(
        self, attack: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)  # a payload that ran would leave its marker here
        assert self.attack_dir is not None
        path = self.attack_dir / attack
        error, when = self.attack_expected[attack]
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        assert sum(p.stat().st_size for p in files) < _SMALL_FILE
        storage = open_storage(str(path))
        if error is None:
            self.check_harmless_read(attack, read_all(source_class(self.format)(storage, str(path))))
        elif when == "open":
            with pytest.raises(CkptconvError) as info:
                source_class(self.format)(storage, str(path)).entries()
            assert type(info.value).__name__ == error, info.value
        else:
            src = source_class(self.format)(storage, str(path))
            with pytest.raises(CkptconvError) as info:
                read_all(src)
            assert type(info.value).__name__ == error, info.value
        if self.attack_marker is not None:
            assert not (tmp_path / self.attack_marker).exists()

    def test_hostile_file_as_a_conversion_source_leaves_nothing(
        self, attack: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        error = self.attack_expected[attack][0]
        if error is None:
            pytest.skip(f"{attack} is read without error")
        assert self.attack_dir is not None
        monkeypatch.chdir(tmp_path)
        to = next(f.name for f in FORMATS.values() if f.write and f.name != self.format)
        target = tmp_path / "out"
        with pytest.raises(CkptconvError) as info:
            convert(str(self.attack_dir / attack), str(target), to=to, source_format=self.format)
        assert type(info.value).__name__ == error, info.value
        assert not target.exists()
        assert not [p for p in tmp_path.rglob("*") if p.is_file()]

    def check_harmless_read(self, attack: str, values: dict[str, Any]) -> None:
        """What a hostile file that reads without error gives (override to say more)."""
        assert values, attack

    # --- through the engine -------------------------------------------------------------------

    def test_round_trip_through_the_engine(self, other_format: str, base_uri: str) -> None:
        """This format -> ``other_format`` -> this format, each step a verified engine conversion."""
        self.writable()
        values = {f"layer.{i}.{d}": sample(d, (4, 3), seed=i) for i, d in enumerate(_COMMON_DTYPES)}
        write_all(self.sink(base_uri), tensor_entries(values), None, values)
        first = f"{base_uri}/{self.target_name}"
        there = f"{base_uri}/there/{FORMATS[other_format].name}"
        back = f"{base_uri}/back/{self.target_name}"
        assert convert(first, there, to=other_format, source_format=self.format).verify["ok"]
        assert convert(there, back, to=self.format, source_format=other_format).verify["ok"]
        got = read_all(source_class(self.format)(open_storage(back), back))
        assert list(got) == list(values)
        assert all(same_tensor(got[k], v) for k, v in values.items())


__all__ = ["FormatTests", "read_all", "same_tensor", "sample", "tensor_entries", "write_all"]
