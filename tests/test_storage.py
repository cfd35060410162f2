"""Conformance suite for every storage backend (ckptconv.storage.base contract).

Each test runs against local paths, ``file://`` URIs and S3 (moto's real HTTP server). Backend-
specific behaviour (S3 part sizes, conditional writes, server-side multipart copy, error mapping)
is tested at the end.
"""

from __future__ import annotations

import io
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptconv.core.errors import (
    CorruptCheckpoint,
    InvalidRequest,
    ObjectNotFound,
    PathEscape,
    StorageError,
    TargetExists,
)
from ckptconv.core.scopes import Scopes
from ckptconv.storage import confine, is_s3, open_storage, split_s3
from ckptconv.storage.base import Storage
from ckptconv.storage.confined import ConfinedStorage, scoped

MiB = 1 << 20


@pytest.fixture(params=["local", "file-uri", "s3", "local-confined", "s3-confined"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Storage, str]]:
    """(storage, base URI of an empty area) for each backend; "-confined": opened in a job's scope
    that grants exactly the area (the confined storage meets the same contract inside its scopes)."""
    if request.param.startswith("s3"):
        bucket = request.getfixturevalue("s3_bucket")
        base = f"s3://{bucket}/area"
    elif request.param == "file-uri":
        base = (tmp_path / "area").as_uri()
    else:
        base = str(tmp_path.resolve() / "area")
    if not request.param.endswith("-confined"):
        yield open_storage(base), base
        return
    with scoped(Scopes.of([base + "/"])):
        storage = open_storage(base)
        assert isinstance(storage, ConfinedStorage)
        yield storage, base


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def uris(storage: Storage, prefix: str) -> list[str]:
    return [info.uri for info in storage.list(prefix)]


# --- write, commit, read ---------------------------------------------------------------------


def test_write_commit_stat_read(store):
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


def test_commit_returns_info_and_is_idempotent(store):
    storage, base = store
    w = storage.open_writer(storage.join(base, "a"))
    w.write(b"hello")
    info = w.commit()
    assert info.size == 5 and info.uri == storage.join(base, "a")
    assert w.commit() == info
    w.abort()  # after commit: no effect
    assert storage.read_all(info.uri) == b"hello"
    with pytest.raises(ValueError):
        w.write(b"more")


def test_empty_object(store):
    storage, base = store
    uri = storage.join(base, "empty")
    info = storage.write_bytes(uri, b"")
    assert info.size == 0
    assert storage.read_all(uri) == b""


def test_invisible_before_commit(store):
    storage, base = store
    uri = storage.join(base, "x/y.bin")
    w = storage.open_writer(uri)
    w.write(b"partial")
    assert not storage.exists(uri)
    assert uris(storage, base) == []
    w.commit()
    assert uris(storage, base) == [uri]


def test_abort_leaves_nothing(store, tmp_path):
    storage, base = store
    uri = storage.join(base, "aborted.bin")
    w = storage.open_writer(uri)
    w.write(payload(1000))
    w.abort()
    w.abort()  # idempotent
    assert not storage.exists(uri)
    assert uris(storage, base) == []
    with pytest.raises(ValueError):
        w.commit()
    if not is_s3(base):
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_exception_inside_with_aborts(store):
    storage, base = store
    uri = storage.join(base, "boom.bin")
    with pytest.raises(RuntimeError, match="boom"), storage.open_writer(uri) as w:
        w.write(b"abc")
        raise RuntimeError("boom")
    assert not storage.exists(uri)
    assert uris(storage, base) == []


def test_no_overwrite_refusal_and_overwrite(store):
    storage, base = store
    uri = storage.join(base, "target")
    storage.write_bytes(uri, b"first")
    with pytest.raises(TargetExists):
        storage.write_bytes(uri, b"second")
    assert storage.read_all(uri) == b"first"
    storage.write_bytes(uri, b"third!", overwrite=True)
    assert storage.read_all(uri) == b"third!"
    assert uris(storage, base) == [uri]


def test_two_writers_only_one_wins(store, tmp_path):
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
    if not is_s3(base):
        assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["race"]


def test_large_multipart_write(store):
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


# --- reading errors --------------------------------------------------------------------------


def test_short_read_is_corrupt_checkpoint(store):
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


def test_missing_object(store):
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


def test_directory_is_not_an_object(store):
    storage, base = store
    storage.write_bytes(storage.join(base, "d/f"), b"x")
    with pytest.raises(ObjectNotFound):
        storage.stat(storage.join(base, "d"))
    assert not storage.exists(storage.join(base, "d"))


# --- listing and deleting --------------------------------------------------------------------


def test_list_is_a_sorted_string_prefix(store):
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


def test_delete_and_delete_prefix(store):
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


def test_publish_moves_in_order(store):
    storage, base = store
    staging = [storage.join(base, f".staging/{n}") for n in ("model.bin", "manifest.json")]
    final = [storage.join(base, f"out/{n}") for n in ("model.bin", "manifest.json")]
    for i, uri in enumerate(staging):
        storage.write_bytes(uri, f"content {i}".encode())
    storage.publish(zip(staging, final, strict=True))
    assert uris(storage, base) == sorted(final)
    assert [storage.read_all(u) for u in final] == [b"content 0", b"content 1"]


def test_publish_refuses_existing_target_before_moving_anything(store):
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


def test_open_reader_behaves_like_a_file(store):
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
def test_join_refuses_escaping_names(store, bad):
    storage, base = store
    with pytest.raises(PathEscape):
        storage.join(base, bad)
    with pytest.raises(PathEscape):
        storage.join(base, "ok", bad)


def test_join_accepts_nested_names(store):
    storage, base = store
    uri = storage.join(base, "sub/model-00001-of-00002.safetensors")
    assert uri == base + "/sub/model-00001-of-00002.safetensors"
    assert storage.join(base, "a", "b.c", "..d") == base + "/a/b.c/..d"
    storage.write_bytes(uri, b"x")
    assert uris(storage, base) == [uri]


def test_names_with_spaces_and_unicode_round_trip(store):
    storage, base = store
    uri = storage.join(base, "with space/ü.bin")
    storage.write_bytes(uri, b"x")
    assert uris(storage, base) == [uri]
    assert storage.read_all(uri) == b"x"
    # Cutting a suffix off a URI and joining it again gives the same URI (no re-encoding).
    assert storage.join(base, uri[len(base) + 1 :]) == uri


def test_confine_helper():
    assert confine("s3://b/ckpt", "layer.0/weight") == "s3://b/ckpt/layer.0/weight"
    assert confine("s3://b/ckpt/", "w") == "s3://b/ckpt/w"
    assert confine("/data", "w") == "/data/w"
    assert confine("file:///data", "a b") == "file:///data/a b"  # file URIs are literal paths
    assert confine("", "w") == "w"
    for bad in ("../w", "/etc/passwd", "a/../../w"):
        with pytest.raises(PathEscape):
            confine("/data", bad)


# --- choosing a backend ----------------------------------------------------------------------


def test_open_storage_by_scheme(tmp_path, s3_server):
    local = open_storage(str(tmp_path))
    assert local.scheme == "file"
    assert open_storage(tmp_path.as_uri()) is local
    assert open_storage("relative/path") is local
    s3 = open_storage("s3://bucket/key")
    assert s3.scheme == "s3"
    assert open_storage("s3://other") is s3
    assert local.local_path(str(tmp_path / "f")) == tmp_path / "f"
    assert s3.local_path("s3://bucket/key") is None
    for bad in ("gs://bucket/key", "http://host/x", "s3://", "s3:///key", "file://otherhost/x"):
        with pytest.raises(InvalidRequest):
            open_storage(bad)


def test_split_s3():
    assert split_s3("s3://bucket/a/b/c") == ("bucket", "a/b/c")
    assert split_s3("s3://bucket") == ("bucket", "")
    assert split_s3("s3://bucket/") == ("bucket", "")
    assert is_s3("S3://Bucket/k") and not is_s3("/s3://x")
    with pytest.raises(InvalidRequest):
        split_s3("/local/path")


# --- local specifics -------------------------------------------------------------------------


def test_local_temp_files_are_invisible_and_named_like_cstorch(tmp_path):
    storage = open_storage(str(tmp_path))
    uri = str(tmp_path / "model.mdl")
    w = storage.open_writer(uri)
    w.write(b"data")
    (tmp_name,) = os.listdir(tmp_path)
    assert tmp_name.startswith("model.mdl.") and tmp_name.endswith(".tmp") and len(tmp_name) == len("model.mdl.") + 12
    assert uris(storage, str(tmp_path)) == []
    w.commit()
    assert os.listdir(tmp_path) == ["model.mdl"]


def test_local_delete_prefix_prunes_empty_directories_and_refuses_roots(tmp_path):
    storage = open_storage(str(tmp_path))
    storage.write_bytes(str(tmp_path / "ckpt/a/b/c"), b"1")
    storage.write_bytes(str(tmp_path / "other"), b"1")
    assert storage.delete_prefix(str(tmp_path / "ckpt")) == 1
    assert sorted(os.listdir(tmp_path)) == ["other"]
    for root in ("/", "", ".", "file:///"):
        with pytest.raises(InvalidRequest):
            storage.delete_prefix(root)


# --- S3 specifics ----------------------------------------------------------------------------


def test_s3_multipart_with_part_checksums(s3_bucket):
    """The CRC32-per-part path boto3 uses on AWS (create with algorithm, checksums in complete)."""
    from ckptconv.storage.s3 import S3Storage

    storage = S3Storage(part_checksums=True)
    uri = f"s3://{s3_bucket}/crc.bin"
    data = os.urandom(6 * MiB)
    with storage.open_writer(uri, part_size=5 * MiB) as w:
        w.write(data)
    assert storage.read_all(uri) == data


def test_s3_part_sizes_grow_within_limits():
    from ckptconv.storage.s3 import MAX_PART_SIZE, MAX_PARTS, MIN_PART_SIZE, part_size_for

    assert part_size_for(1, 1) == MIN_PART_SIZE
    assert part_size_for(1, 64 * MiB) == part_size_for(1000, 64 * MiB) == 64 * MiB
    assert part_size_for(1001, 64 * MiB) == 128 * MiB
    assert part_size_for(MAX_PARTS, 64 * MiB) == MAX_PART_SIZE
    total = sum(part_size_for(n, 64 * MiB) for n in range(1, MAX_PARTS + 1))
    assert total >= 5 << 40  # S3's largest object fits in 10,000 parts


def test_s3_user_metadata_survives_multipart_and_publish(s3_bucket):
    from ckptconv.storage.s3 import S3Storage

    # Thresholds lowered so that publish takes the UploadPartCopy path with 3 parts.
    storage = S3Storage(multipart_copy_threshold=5 * MiB, copy_part_size=5 * MiB)
    small, big = f"s3://{s3_bucket}/stage/small", f"s3://{s3_bucket}/stage/big"
    meta = {"metadata": '{"__NUMPY__": true}'}
    with storage.open_writer(small, metadata=meta) as w:
        w.write(b"tiny")
    data = os.urandom(11 * MiB)
    with storage.open_writer(big, metadata=meta, part_size=5 * MiB) as w:
        w.write(data)
    assert storage.user_metadata(small) == meta == storage.user_metadata(big)
    final_small, final_big = f"s3://{s3_bucket}/out/small", f"s3://{s3_bucket}/out/big"
    storage.publish([(small, final_small), (big, final_big)])
    assert storage.read_all(final_big) == data
    assert storage.user_metadata(final_big) == meta == storage.user_metadata(final_small)
    assert uris(storage, f"s3://{s3_bucket}/") == [final_big, final_small]
    # The multipart copy refuses an existing target too, and leaves no upload behind.
    storage.write_bytes(big, data)
    with pytest.raises(TargetExists):
        storage.publish([(big, final_big)])
    assert storage.client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_s3_abort_removes_the_multipart_upload(s3_bucket):
    storage = open_storage(f"s3://{s3_bucket}/")
    w = storage.open_writer(f"s3://{s3_bucket}/k", part_size=5 * MiB)
    w.write(os.urandom(5 * MiB + 1))  # one part is on its way
    w.abort()
    assert storage.client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert uris(storage, f"s3://{s3_bucket}/") == []


def test_s3_missing_bucket_names_the_bucket(s3_server):
    storage = open_storage("s3://no-such-bucket-here/k")
    with pytest.raises(ObjectNotFound, match="no-such-bucket-here") as info:
        list(storage.list("s3://no-such-bucket-here/"))
    assert "no-such-bucket-here" in (info.value.hint or "")
    with pytest.raises(ObjectNotFound), storage.open_writer("s3://no-such-bucket-here/k", part_size=5 * MiB) as w:
        w.write(os.urandom(5 * MiB))


def test_s3_unreachable_endpoint_is_a_storage_error(s3_server):
    from ckptconv.storage.s3 import S3Storage

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    storage = S3Storage(f"http://127.0.0.1:{port}", max_attempts=1)
    with pytest.raises(StorageError, match="cannot reach") as info:
        storage.stat("s3://bucket/key")
    assert not isinstance(info.value, ObjectNotFound)
    assert "AWS_ENDPOINT_URL" in (info.value.hint or "")


def test_s3_bucket_uri_is_not_an_object(s3_bucket):
    storage = open_storage(f"s3://{s3_bucket}")
    with pytest.raises(ObjectNotFound):
        storage.stat(f"s3://{s3_bucket}")
    with pytest.raises(InvalidRequest):
        storage.open_writer(f"s3://{s3_bucket}/")
    with pytest.raises(InvalidRequest):
        storage.delete_prefix(f"s3://{s3_bucket}/")


def test_s3_conditional_write_refuses_a_target_that_appeared_after_the_check(s3_bucket):
    """The HEAD check can lose a race; the server's If-None-Match precondition still refuses."""
    from ckptconv.storage.s3 import S3Storage

    class LostRace(S3Storage):
        def exists(self, uri: str) -> bool:  # as if the other writer committed just after our HEAD
            return False

    storage = LostRace()
    uri = f"s3://{s3_bucket}/raced"
    storage.write_bytes(uri, b"winner")
    with pytest.raises(TargetExists):
        storage.write_bytes(uri, b"small loser")
    with pytest.raises(TargetExists), storage.open_writer(uri, part_size=5 * MiB) as w:
        w.write(os.urandom(6 * MiB))
    assert storage.read_all(uri) == b"winner"
    assert storage.client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_s3_failed_part_upload_surfaces_and_cleans_up(s3_bucket):
    from ckptconv.storage.s3 import S3Storage

    storage = S3Storage(max_attempts=1)  # moto answers 500 here, which botocore would retry for seconds
    uri = f"s3://{s3_bucket}/doomed"
    with pytest.raises(StorageError), storage.open_writer(uri, part_size=5 * MiB) as w:
        w.write(os.urandom(5 * MiB))  # first part goes out, the upload now exists
        # The upload vanishes server-side (e.g. a lifecycle rule): the next part fails.
        storage.client.abort_multipart_upload(Bucket=s3_bucket, Key="doomed", UploadId=w._upload_id)
        w.write(os.urandom(5 * MiB))
        w.write(b"tail")
    assert not storage.exists(uri)
    assert storage.client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


@pytest.mark.parametrize(
    ("code", "status", "expected", "in_hint"),
    [
        ("NoSuchBucket", 404, ObjectNotFound, "bkt"),
        ("NoSuchKey", 404, ObjectNotFound, None),
        ("AccessDenied", 403, StorageError, "credentials"),
        ("InvalidAccessKeyId", 403, StorageError, "AWS_ACCESS_KEY_ID"),
        ("PreconditionFailed", 412, TargetExists, None),
        ("NoSuchUpload", 404, StorageError, "retry"),
        ("SlowDown", 503, StorageError, None),
    ],
)
def test_s3_error_mapping(code, status, expected, in_hint):
    """Error responses S3 sends but moto cannot be made to send (e.g. 403 for bad credentials)."""
    from botocore.exceptions import ClientError

    from ckptconv.storage.s3.client import typed_error as _typed_error

    response = {"Error": {"Code": code, "Message": "msg"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    err = _typed_error(ClientError(response, "GetObject"), "s3://bkt/key")
    assert type(err) is expected
    if in_hint:
        assert in_hint in (err.hint or "")
    assert "s3://bkt/key" in str(err)
