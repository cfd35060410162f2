"""The contract every storage backend meets (:mod:`ckptconv.storage.base`), as a test suite.

Used only by tests, never by ckptconv at run time (it imports pytest at the top; pytest comes with
the ``test`` extra). A backend's test module subclasses :class:`StorageTests` and provides the
``store`` fixture: ``(storage, base URI of an empty area)``::

    class TestLocal(StorageTests):
        @pytest.fixture
        def store(self, tmp_path):
            base = str(tmp_path / "area")
            return open_storage(base), base

``on_local_disk`` says whether the area is a local directory under ``tmp_path``; then the suite
also checks that no temporary file stays behind.
"""

from __future__ import annotations

import hashlib
import io
import os
import random

import pytest

from ckptconv.core.errors import CorruptCheckpoint, ObjectNotFound, PathEscape, SinkProtocolError, TargetExists
from ckptconv.storage.base import Storage
from ckptconv.storage.digests import hex_digest

MiB = 1 << 20


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def uris(storage: Storage, prefix: str) -> list[str]:
    return [info.uri for info in storage.list(prefix)]


class StorageTests:
    """The storage contract; subclass it and give the ``store`` fixture (see the module docstring)."""

    on_local_disk: bool = True

    @pytest.fixture
    def store(self) -> tuple[Storage, str]:
        raise NotImplementedError("a StorageTests subclass provides the store fixture")

    # --- write, commit, read ---------------------------------------------------------------------

    def test_write_commit_stat_read(self, store):
        storage, base = store
        uri = storage.join(base, "dir/obj.bin")
        data = payload(100_000)
        with storage.open_writer(uri) as w:
            for i in range(0, len(data), 7_000):
                assert w.write(memoryview(data)[i : i + 7_000]) == len(data[i : i + 7_000])
            assert w.bytes_written == len(data)
        info = storage.stat(uri)
        assert info.uri == uri and info.size == len(data)
        assert storage.stat(uri).etag == info.etag  # stable while unchanged
        assert storage.read_range(uri, 12_345, 1_000) == data[12_345:13_345]
        assert storage.read_range(uri, len(data) - 5, 5) == data[-5:]
        assert storage.read_range(uri, 10, 0) == b""
        assert storage.read_all(uri) == data
        assert storage.exists(uri)

    def test_commit_returns_info_and_is_idempotent(self, store):
        storage, base = store
        w = storage.open_writer(storage.join(base, "a"))
        w.write(b"hello")
        info = w.commit()
        assert info.size == 5 and info.uri == storage.join(base, "a")
        assert w.commit() == info
        w.abort()  # after commit: no effect
        assert storage.read_all(info.uri) == b"hello"
        with pytest.raises(SinkProtocolError):
            w.write(b"more")

    def test_empty_object(self, store):
        storage, base = store
        uri = storage.join(base, "empty")
        info = storage.write_bytes(uri, b"")
        assert info.size == 0
        assert storage.read_all(uri) == b""

    def test_invisible_before_commit(self, store):
        storage, base = store
        uri = storage.join(base, "x/y.bin")
        w = storage.open_writer(uri)
        w.write(b"partial")
        assert not storage.exists(uri)
        assert uris(storage, base) == []
        w.commit()
        assert uris(storage, base) == [uri]

    def test_abort_leaves_nothing(self, store, tmp_path):
        storage, base = store
        uri = storage.join(base, "aborted.bin")
        w = storage.open_writer(uri)
        w.write(payload(1000))
        w.abort()
        w.abort()  # idempotent
        assert not storage.exists(uri)
        assert uris(storage, base) == []
        # Driving an aborted writer is the caller's fault: typed, and it leaves nothing either.
        with pytest.raises(SinkProtocolError):
            w.write(b"more")
        with pytest.raises(SinkProtocolError):
            w.commit()
        assert uris(storage, base) == []
        if self.on_local_disk:
            assert [p for p in tmp_path.rglob("*") if p.is_file()] == []

    def test_exception_inside_with_aborts(self, store):
        storage, base = store
        uri = storage.join(base, "boom.bin")
        with pytest.raises(RuntimeError, match="boom"), storage.open_writer(uri) as w:
            w.write(b"abc")
            raise RuntimeError("boom")
        assert not storage.exists(uri)
        assert uris(storage, base) == []

    def test_no_overwrite_refusal_and_overwrite(self, store):
        storage, base = store
        uri = storage.join(base, "target")
        storage.write_bytes(uri, b"first")
        with pytest.raises(TargetExists):
            storage.write_bytes(uri, b"second")
        assert storage.read_all(uri) == b"first"
        storage.write_bytes(uri, b"third!", overwrite=True)
        assert storage.read_all(uri) == b"third!"
        assert uris(storage, base) == [uri]

    def test_two_writers_only_one_wins(self, store, tmp_path):
        """A target that appears while a writer is open makes that writer's commit fail, leaving no trace."""
        storage, base = store
        uri = storage.join(base, "race")
        slow = storage.open_writer(uri)
        slow.write(b"slow writer")
        storage.write_bytes(uri, b"fast writer")
        with pytest.raises(TargetExists):
            slow.commit()
        assert storage.read_all(uri) == b"fast writer"
        assert uris(storage, base) == [uri]
        if self.on_local_disk:
            assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["race"]

    def test_large_multipart_write(self, store):
        """11 MiB through 5 MiB parts: two full parts and a short last one, written in odd-sized chunks."""
        storage, base = store
        uri = storage.join(base, "big.bin")
        data = os.urandom(11 * MiB + 123)
        with storage.open_writer(uri, part_size=5 * MiB) as w:
            view = memoryview(data)
            for start in range(0, len(data), 3 * MiB + 17):
                w.write(view[start : start + 3 * MiB + 17])
        assert storage.stat(uri).size == len(data)
        for offset in (0, 5 * MiB - 10, 10 * MiB - 1, len(data) - 50):
            assert storage.read_range(uri, offset, 50) == data[offset : offset + 50]
        assert storage.read_all(uri) == data
        # Over several blocks, the last one short: each read beside the hash of the one before.
        assert storage.digest(uri, block_size=2 * MiB) == hex_digest(data)
        assert storage.digest(uri) == hex_digest(data)
        # The hash an earlier version's manifest names, to check its outputs.
        assert storage.digest(uri, "sha256") == hashlib.sha256(data).hexdigest()

    def test_read_head_tells_the_size_with_the_first_bytes(self, store):
        storage, base = store
        uri = storage.join(base, "head")
        data = payload(1000)
        info = storage.write_bytes(uri, data)
        for offset, length, want in ((0, 10, data[:10]), (990, 64, data[990:]), (0, 4096, data), (1000, 8, b"")):
            got, head = storage.read_head(uri, length, offset=offset)
            assert got == want
            assert (head.uri, head.size, head.etag) == (uri, 1000, info.etag)
        got, head = storage.read_head(uri, 8, offset=5000)  # past the end: nothing, still the size
        assert (got, head.size) == (b"", 1000)
        empty = storage.join(base, "empty-head")
        storage.write_bytes(empty, b"")
        assert storage.read_head(empty, 8)[0] == b"" and storage.read_head(empty, 8)[1].size == 0
        with pytest.raises(ObjectNotFound):
            storage.read_head(storage.join(base, "no-head"), 8)

    # --- reading errors --------------------------------------------------------------------------

    def test_short_read_is_corrupt_checkpoint(self, store):
        storage, base = store
        uri = storage.join(base, "short")
        storage.write_bytes(uri, payload(100))
        with pytest.raises(CorruptCheckpoint, match="ends early"):
            storage.read_range(uri, 90, 20)
        with pytest.raises(CorruptCheckpoint):
            storage.read_range(uri, 200, 1)
        with pytest.raises(CorruptCheckpoint):
            storage.read_range(uri, -1, 5)
        with pytest.raises(CorruptCheckpoint):
            storage.read_range(uri, 0, -5)

    def test_missing_object(self, store):
        storage, base = store
        uri = storage.join(base, "nothing/here")
        for call in (
            lambda: storage.stat(uri),
            lambda: storage.read_range(uri, 0, 1),
            lambda: storage.read_all(uri),
            lambda: storage.open_reader(uri),
        ):
            with pytest.raises(ObjectNotFound):
                call()
        assert not storage.exists(uri)
        storage.delete(uri)  # deleting a missing object is not an error

    def test_directory_is_not_an_object(self, store):
        storage, base = store
        storage.write_bytes(storage.join(base, "d/f"), b"x")
        with pytest.raises(ObjectNotFound):
            storage.stat(storage.join(base, "d"))
        assert not storage.exists(storage.join(base, "d"))

    # --- listing and deleting --------------------------------------------------------------------

    def test_list_is_a_sorted_string_prefix(self, store):
        storage, base = store
        names = ["a/x", "a/y/z", "a-1", "ab", "a.txt", "b", "ba/c"]
        for i, name in enumerate(names):
            storage.write_bytes(storage.join(base, name), b"#" * i)

        def listed(prefix: str) -> list[str]:
            got = uris(storage, prefix)
            assert got == sorted(got)
            assert all(u.startswith(prefix) for u in got)
            return [u[len(base) + 1 :] for u in got]

        assert listed(base + "/") == sorted(names)
        assert listed(base + "/a") == ["a-1", "a.txt", "a/x", "a/y/z", "ab"]
        assert listed(base + "/a/") == ["a/x", "a/y/z"]
        assert listed(base + "/a/y") == ["a/y/z"]
        assert listed(base + "/b") == ["b", "ba/c"]
        assert listed(base + "/zzz") == []
        sizes = {info.uri[len(base) + 1 :]: info.size for info in storage.list(base)}
        assert sizes == {name: i for i, name in enumerate(names)}

    def test_delete_and_delete_prefix(self, store):
        storage, base = store
        for name in ["keep", "ckpt/a", "ckpt/sub/b", "ckpt2/c"]:
            storage.write_bytes(storage.join(base, name), b"1")
        storage.delete(storage.join(base, "keep"))
        assert not storage.exists(storage.join(base, "keep"))
        assert storage.delete_prefix(base + "/ckpt/") == 2
        assert uris(storage, base) == [storage.join(base, "ckpt2/c")]
        assert storage.delete_prefix(base + "/ckpt") == 1
        assert uris(storage, base) == []
        assert storage.delete_prefix(base + "/ckpt") == 0

    # --- publish ---------------------------------------------------------------------------------

    def test_publish_moves_in_order(self, store):
        storage, base = store
        staging = [storage.join(base, f".staging/{n}") for n in ("model.bin", "manifest.json")]
        final = [storage.join(base, f"out/{n}") for n in ("model.bin", "manifest.json")]
        for i, uri in enumerate(staging):
            storage.write_bytes(uri, f"content {i}".encode())
        storage.publish(zip(staging, final, strict=True))
        assert uris(storage, base) == sorted(final)
        assert [storage.read_all(u) for u in final] == [b"content 0", b"content 1"]

    def test_publish_refuses_existing_target_before_moving_anything(self, store):
        storage, base = store
        a, b = storage.join(base, "stage/a"), storage.join(base, "stage/b")
        fa, fb = storage.join(base, "final/a"), storage.join(base, "final/b")
        storage.write_bytes(a, b"A")
        storage.write_bytes(b, b"B")
        storage.write_bytes(fb, b"old B")
        with pytest.raises(TargetExists):
            storage.publish([(a, fa), (b, fb)])
        assert uris(storage, base) == sorted([a, b, fb])  # nothing moved
        storage.publish([(a, fa), (b, fb)], overwrite=True)
        assert uris(storage, base) == sorted([fa, fb])
        assert storage.read_all(fb) == b"B"
        with pytest.raises(ObjectNotFound):
            storage.publish([(a, storage.join(base, "final/c"))])

    # --- readers ---------------------------------------------------------------------------------

    def test_open_reader_behaves_like_a_file(self, store):
        storage, base = store
        uri = storage.join(base, "reader.bin")
        data = payload(300_000, seed=1)
        storage.write_bytes(uri, data)
        ref = io.BytesIO(data)
        rng = random.Random(2)
        with storage.open_reader(uri) as f:
            assert f.readable() and f.seekable()
            for _ in range(300):
                op = rng.choice(["set", "cur", "end", "read", "read", "readall"])
                if op == "set":
                    pos = rng.randrange(0, len(data) + 10)
                    assert f.seek(pos) == ref.seek(pos)
                elif op == "cur":
                    delta = rng.randrange(-min(ref.tell(), 5000), 5000)
                    assert f.seek(delta, io.SEEK_CUR) == ref.seek(delta, io.SEEK_CUR)
                elif op == "end":
                    delta = -rng.randrange(0, 10_000)
                    assert f.seek(delta, io.SEEK_END) == ref.seek(delta, io.SEEK_END)
                elif op == "read":
                    n = rng.choice([0, 1, 17, 4096, 70_000])
                    assert f.read(n) == ref.read(n)
                else:
                    f.seek(len(data) - 1000)
                    ref.seek(len(data) - 1000)
                    assert f.read() == ref.read()
                assert f.tell() == ref.tell()

    # --- names -----------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        "bad",
        ["../x", "/abs", "a/../../b", "a/..", "..", "", "a//b", "a/", "./a", "a\\b", "..\\x", "a\x00b"],
    )
    def test_join_refuses_escaping_names(self, store, bad):
        storage, base = store
        with pytest.raises(PathEscape):
            storage.join(base, bad)
        with pytest.raises(PathEscape):
            storage.join(base, "ok", bad)

    def test_join_accepts_nested_names(self, store):
        storage, base = store
        uri = storage.join(base, "sub/model-00001-of-00002.safetensors")
        assert uri == base + "/sub/model-00001-of-00002.safetensors"
        assert storage.join(base, "a", "b.c", "..d") == base + "/a/b.c/..d"
        storage.write_bytes(uri, b"x")
        assert uris(storage, base) == [uri]

    def test_names_with_spaces_and_unicode_round_trip(self, store):
        storage, base = store
        uri = storage.join(base, "with space/ü.bin")
        storage.write_bytes(uri, b"x")
        assert uris(storage, base) == [uri]
        assert storage.read_all(uri) == b"x"
        # Cutting a suffix off a URI and joining it again gives the same URI (no re-encoding).
        assert storage.join(base, uri[len(base) + 1 :]) == uri
