"""Every storage backend against the shipped contract suite (:class:`ckptconv.testing.storage_tests.StorageTests`):
local paths, ``file://`` URIs and S3 (moto's real HTTP server), each also confined to a job's scope.
Backend-specific behaviour (S3 part sizes, conditional writes, server-side multipart copy, error
mapping) is tested after them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptconv.core.errors import (
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
from ckptconv.testing.storage_tests import StorageTests, uris

MiB = 1 << 20


class TestLocal(StorageTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> tuple[Storage, str]:
        base = str(tmp_path.resolve() / "area")
        return open_storage(base), base


class TestFileUri(StorageTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> tuple[Storage, str]:
        base = (tmp_path / "area").as_uri()
        return open_storage(base), base


class TestS3(StorageTests):
    """moto's real HTTP server (the ``s3_bucket`` fixture)."""

    on_local_disk = False

    @pytest.fixture
    def store(self, s3_bucket: str) -> tuple[Storage, str]:
        base = f"s3://{s3_bucket}/area"
        return open_storage(base), base


def _confined(base: str) -> Iterator[tuple[Storage, str]]:
    """Opened in a job's scope that grants exactly the area: confined storage meets the same contract."""
    with scoped(Scopes.of([base + "/"])):
        storage = open_storage(base)
        assert isinstance(storage, ConfinedStorage)
        yield storage, base


class TestLocalConfined(StorageTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[tuple[Storage, str]]:
        yield from _confined(str(tmp_path.resolve() / "area"))


class TestS3Confined(StorageTests):
    on_local_disk = False

    @pytest.fixture
    def store(self, s3_bucket: str) -> Iterator[tuple[Storage, str]]:
        yield from _confined(f"s3://{s3_bucket}/area")


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


def test_s3_publish_names_its_owner_beside_the_objects_metadata_on_both_copy_paths(s3_bucket):
    from ckptconv.storage.base import OWNER_METADATA
    from ckptconv.storage.s3 import S3Storage

    storage = S3Storage(multipart_copy_threshold=5 * MiB, copy_part_size=5 * MiB)
    meta = {"metadata": '{"__NUMPY__": true}'}
    pairs = []
    for name, data in [("small", b"tiny"), ("big", os.urandom(11 * MiB))]:
        with storage.open_writer(f"s3://{s3_bucket}/stage/{name}", metadata=meta, part_size=5 * MiB) as w:
            w.write(data)
        pairs.append((f"s3://{s3_bucket}/stage/{name}", f"s3://{s3_bucket}/out/{name}"))
    content_type = storage.client.head_object(Bucket=s3_bucket, Key="stage/small").get("ContentType")
    storage.publish(pairs, owner="job-1")
    for _, final in pairs:
        assert storage.user_metadata(final) == {**meta, OWNER_METADATA: "job-1"}
    assert storage.client.head_object(Bucket=s3_bucket, Key="out/small").get("ContentType") == content_type


def test_s3_objects_written_in_a_jobs_attempt_name_it_and_publish_copies_them_as_they_are(s3_bucket):
    from ckptconv.core.fencing import Attempt, attempt_scope
    from ckptconv.storage.base import OWNER_METADATA
    from ckptconv.storage.part_upload import PartUpload
    from ckptconv.storage.s3 import S3Storage

    storage = S3Storage(multipart_copy_threshold=6 * MiB, copy_part_size=5 * MiB)
    meta = {"metadata": '{"__NUMPY__": true}'}
    big = os.urandom(11 * MiB)
    with attempt_scope(Attempt("job-1", 2, lambda: None)):
        storage.write_bytes(f"s3://{s3_bucket}/stage/put", b"tiny")  # one PutObject
        with storage.open_writer(f"s3://{s3_bucket}/stage/streamed", metadata=meta, part_size=5 * MiB) as w:
            w.write(big[: 5 * MiB + 1])  # a streamed multipart upload (two parts)
        upload = PartUpload(storage, f"s3://{s3_bucket}/stage/parts", part_size=5 * MiB, metadata=meta)
        upload.write_at(0, big)  # a positioned multipart upload, over the copy threshold
        upload.complete(len(big))
        small = PartUpload(storage, f"s3://{s3_bucket}/stage/small", part_size=5 * MiB, metadata=meta)
        small.write_at(0, b"abc")  # within one part: one PutObject
        small.complete(3)
    # Outside any attempt (the CLI), an object carries only the metadata it was given.
    storage.write_bytes(f"s3://{s3_bucket}/stage/cli", b"cli")
    assert storage.user_metadata(f"s3://{s3_bucket}/stage/cli") == {}
    names = {"put": {}, "streamed": meta, "parts": meta, "small": meta}
    for name, given in names.items():
        assert storage.user_metadata(f"s3://{s3_bucket}/stage/{name}") == {**given, OWNER_METADATA: "job-1"}
    copies = _recorded(storage.client, "copy_object")
    part_copies = _recorded(storage.client, "upload_part_copy")
    etags = {name: storage.stat(f"s3://{s3_bucket}/stage/{name}").etag for name in names}
    for name in names:
        storage.publish([(f"s3://{s3_bucket}/stage/{name}", f"s3://{s3_bucket}/out/{name}")], owner="job-1")
        assert storage.user_metadata(f"s3://{s3_bucket}/out/{name}") == {**names[name], OWNER_METADATA: "job-1"}
    assert storage.read_all(f"s3://{s3_bucket}/out/parts") == big
    # The staged objects named the job: plain copies, each still pinned to the object publish checked.
    assert [k.get("MetadataDirective") for k in copies] == [None] * 3
    assert [k["CopySourceIfMatch"] for k in copies] == [f'"{etags[n]}"' for n in ("put", "streamed", "small")]
    assert len(part_copies) == 3 and all(k["CopySourceIfMatch"] == f'"{etags["parts"]}"' for k in part_copies)


def test_s3_publish_names_the_owner_of_an_object_staged_outside_its_attempt(s3_bucket):
    from ckptconv.storage.base import OWNER_METADATA
    from ckptconv.storage.s3 import S3Storage

    storage = S3Storage()
    staged, final = f"s3://{s3_bucket}/stage/old", f"s3://{s3_bucket}/out/old"
    storage.write_bytes(staged, b"staged by a release that did not name the job")
    copies = _recorded(storage.client, "copy_object")
    storage.publish([(staged, final)], owner="job-1")
    assert storage.user_metadata(final) == {OWNER_METADATA: "job-1"}
    assert [k.get("MetadataDirective") for k in copies] == ["REPLACE"]


def test_s3_publish_copies_the_parts_of_a_large_object_concurrently(s3_bucket):
    import threading
    import time

    from botocore.exceptions import ClientError

    from ckptconv.core.errors import StorageError
    from ckptconv.storage.s3 import S3Storage

    storage = S3Storage(multipart_copy_threshold=5 * MiB, copy_part_size=5 * MiB, max_attempts=1)
    copy_part, lock = storage.client.upload_part_copy, threading.Lock()
    in_flight, most, fail_part = [0], [0], [0]

    def counted(**kwargs):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            time.sleep(0.2)  # long enough for the others to start, if they are going to
            if kwargs["PartNumber"] == fail_part[0]:
                raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "UploadPartCopy")
            return copy_part(**kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    storage.client.upload_part_copy = counted
    data = os.urandom(30 * MiB + 3)  # 7 parts
    staged, final = f"s3://{s3_bucket}/stage/big", f"s3://{s3_bucket}/out/big"
    storage.write_bytes(staged, data)
    storage.publish([(staged, final)])
    assert storage.read_all(final) == data
    assert most[0] > 1

    # One part failing fails the copy: no object, no upload left behind, the staged bytes kept.
    storage.write_bytes(staged, data)
    fail_part[0] = 4
    with pytest.raises(StorageError):
        storage.publish([(staged, f"s3://{s3_bucket}/out/other")])
    assert not storage.exists(f"s3://{s3_bucket}/out/other") and storage.exists(staged)
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


def _counted_hashes(monkeypatch, size: int) -> list[int]:
    """Count the block hashes of at least ``size`` bytes the block digests make."""
    from ckptconv.storage import digests

    calls: list[int] = []
    hex_digest = digests.hex_digest

    def counted(data, algorithm=digests.ALGORITHM):
        if len(memoryview(data)) >= size:
            calls.append(len(memoryview(data)))
        return hex_digest(data, algorithm)

    monkeypatch.setattr(digests, "hex_digest", counted)
    return calls


def _block_digest(data: bytes, block: int) -> str:
    import blake3

    from ckptconv.storage.digests import combine

    return combine([blake3.blake3(data[i : i + block]).hexdigest() for i in range(0, len(data), block)])


def test_s3_parts_signed_over_http_are_hashed_once_for_the_block_digest(s3_bucket, monkeypatch):
    """SigV4 over plain HTTP signs each part's sha256 (botocore's, for the protocol); the block
    digest is BLAKE3, so each part is hashed once more here, out of order as the parts go."""
    from ckptconv.storage.part_upload import PartUpload
    from ckptconv.storage.s3 import S3Storage

    storage = S3Storage()
    assert storage.endpoint_url.startswith("http://")
    calls = _counted_hashes(monkeypatch, MiB)
    data = os.urandom(13 * MiB)
    upload = PartUpload(storage, f"s3://{s3_bucket}/signed.bin", part_size=5 * MiB, concurrency=2)
    for start in (10 * MiB, 0, 5 * MiB):  # out of order, as an H5 file's parts go
        upload.write_at(start, data[start : start + 5 * MiB])
    upload.complete(len(data))
    assert storage.read_all(f"s3://{s3_bucket}/signed.bin") == data
    assert upload.blocks.digest(len(data)) == _block_digest(data, 5 * MiB)
    assert sorted(calls) == [3 * MiB, 5 * MiB, 5 * MiB]


def test_s3_parts_sent_unsigned_are_hashed_for_the_block_digest(s3_bucket, s3_server, monkeypatch):
    """A body sent without its sha256 (UNSIGNED-PAYLOAD, as over HTTPS) is hashed here too."""
    import boto3
    from botocore.config import Config

    from ckptconv.storage.part_upload import PartUpload
    from ckptconv.storage.s3 import S3Storage

    config = Config(
        s3={"addressing_style": "path", "payload_signing_enabled": False}, request_checksum_calculation="when_required"
    )
    storage = S3Storage(client=boto3.session.Session().client("s3", endpoint_url=s3_server, config=config))
    calls = _counted_hashes(monkeypatch, MiB)
    data = os.urandom(11 * MiB)
    upload = PartUpload(storage, f"s3://{s3_bucket}/unsigned.bin", part_size=5 * MiB, concurrency=2)
    upload.write_at(0, data)
    upload.complete(len(data))
    assert storage.read_all(f"s3://{s3_bucket}/unsigned.bin") == data
    assert upload.blocks.digest(len(data)) == _block_digest(data, 5 * MiB)
    assert sorted(calls) == [MiB, 5 * MiB, 5 * MiB]


def test_s3_a_file_written_front_to_back_gets_no_block_digest_of_its_parts(s3_bucket, s3_server, monkeypatch):
    """Its digest is computed as it is written: hashing every part again would cost CPU for nothing."""
    import boto3
    from botocore.config import Config

    from ckptconv.storage.part_upload import open_output_writer
    from ckptconv.storage.s3 import S3Storage

    config = Config(
        s3={"addressing_style": "path", "payload_signing_enabled": False}, request_checksum_calculation="when_required"
    )
    storage = S3Storage(client=boto3.session.Session().client("s3", endpoint_url=s3_server, config=config))
    calls = _counted_hashes(monkeypatch, 1)
    data = os.urandom(40 * MiB + 3)
    uri = f"s3://{s3_bucket}/front-to-back.bin"
    with open_output_writer(storage, uri, len(data)) as w:
        w.write(data)
    assert storage.read_all(uri) == data
    assert calls == []


def test_s3_part_buffers_are_reused_not_allocated_per_part(s3_bucket):
    """A part's buffer is reused for a later part once the part is sent: fresh memory is zeroed and
    faulted in page by page, which cost more than filling it. Every part still holds its own bytes."""
    import resource

    from ckptconv.formats.memory import bound_allocator
    from ckptconv.storage.part_upload import PartUpload
    from ckptconv.storage.s3 import S3Storage

    bound_allocator()  # as in a converting process: every block of a part's size is its own mapping
    storage = S3Storage()
    part, parts = 5 * MiB, 16
    data = os.urandom(parts * part + 123)
    upload = PartUpload(storage, f"s3://{s3_bucket}/reused.bin", part_size=part, concurrency=1)
    upload.write_at(0, data[:MiB])  # the first part and the upload's start, before counting
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for start in range(MiB, len(data), MiB):
        upload.write_at(start, data[start : start + MiB])
    faulted = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * resource.getpagesize()
    upload.complete(len(data))
    assert storage.read_all(f"s3://{s3_bucket}/reused.bin") == data
    # New buffers for every part would fault in all 80 MiB; reused ones, a few parts' worth.
    assert faulted < parts * part / 2


def test_a_persistent_block_tries_at_least_its_attempts_whatever_the_budget() -> None:
    # The cleanup after a job failed on storage errors must not give up at the job's small budget.
    from ckptconv.storage.retry import RetryPolicy, persistent

    policy = RetryPolicy(attempts=2, backoff_s=0.0, backoff_max_s=0.0)

    def failing(times: int):
        tries = []

        def call() -> str:
            tries.append(1)
            if len(tries) <= times:
                raise ConnectionError("reset")
            return "done"

        return call, tries

    call, tries = failing(3)
    with pytest.raises(ConnectionError):
        policy.run(call, transient=lambda e: True, what="x")
    assert len(tries) == 2
    call, tries = failing(3)
    with persistent(5):
        assert policy.run(call, transient=lambda e: True, what="x") == "done"
    assert len(tries) == 4
    call, tries = failing(3)  # outside the block, the budget again
    with pytest.raises(ConnectionError):
        policy.run(call, transient=lambda e: True, what="x")


def _recorded(client, operation: str) -> list[dict]:
    """The arguments of every call of ``operation`` on the boto3 ``client`` from now on (the calls go through)."""
    call, sent = getattr(client, operation), []

    def recorded(**kwargs):
        sent.append(kwargs)
        return call(**kwargs)

    setattr(client, operation, recorded)
    return sent


def test_s3_multipart_publish_copies_only_the_object_it_checked(s3_bucket):
    from ckptconv.storage.s3 import S3Storage

    storage = S3Storage(multipart_copy_threshold=5 * MiB, copy_part_size=5 * MiB, max_attempts=1)
    staged, final = f"s3://{s3_bucket}/stage/big", f"s3://{s3_bucket}/out/big"
    data = os.urandom(11 * MiB)
    storage.write_bytes(staged, data)
    etag = storage.stat(staged).etag
    sent = _recorded(storage.client, "upload_part_copy")
    storage.publish([(staged, final)])
    assert storage.read_all(final) == data and len(sent) == 3
    # Each part names the ETag publish checked: a store refuses the copy of an object replaced since.
    assert [k.get("CopySourceIfMatch") for k in sent] == [f'"{etag}"'] * 3


def test_s3_multipart_publish_refuses_a_staged_object_replaced_after_its_check(s3_bucket):
    from ckptconv.core.errors import VerificationFailed
    from ckptconv.storage.s3 import S3Storage

    storage = S3Storage(multipart_copy_threshold=5 * MiB, copy_part_size=5 * MiB, max_attempts=1)
    staged, final = f"s3://{s3_bucket}/stage/big", f"s3://{s3_bucket}/out/big"
    storage.write_bytes(staged, os.urandom(11 * MiB))
    head = storage._head  # publish checks the staged object with it

    def replaced_after(uri: str, bucket: str, key: str):
        answer = head(uri, bucket, key)
        if uri == staged:  # same size, other bytes
            storage.client.put_object(Bucket=s3_bucket, Key="stage/big", Body=os.urandom(11 * MiB))
        return answer

    storage._head = replaced_after
    with pytest.raises(VerificationFailed, match="changed"):
        storage.publish([(staged, final)])
    assert not storage.exists(final)
    assert storage.client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_s3_publish_copies_only_the_object_it_checked(s3_bucket):
    from ckptconv.storage.s3 import S3Storage

    storage = S3Storage(max_attempts=1)
    staged, final = f"s3://{s3_bucket}/stage/m", f"s3://{s3_bucket}/out/m"
    storage.write_bytes(staged, b"checkpoint bytes")
    etag = storage.stat(staged).etag
    sent = _recorded(storage.client, "copy_object")
    storage.publish([(staged, final)])
    assert storage.read_all(final) == b"checkpoint bytes" and len(sent) == 1
    # The copy names the ETag publish checked: a store refuses it for an object replaced since.
    assert sent[0].get("CopySourceIfMatch") == f'"{etag}"'


def _stubbed_copy_refused(target_present: bool):
    """An S3Storage whose client answers a one-object publish as a store does when the staged
    object was replaced after publish checked it (CopySourceIfMatch fails) or when another writer
    created the target meanwhile (If-None-Match fails): both are a 412, told apart by a HEAD of
    the target. moto ignores both preconditions on CopyObject, hence botocore's stub."""
    import datetime

    import boto3
    from botocore.stub import ANY, Stubber

    from ckptconv.storage.s3 import S3Storage

    client = boto3.client(
        "s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x", endpoint_url="http://s3.test"
    )
    stub = Stubber(client)
    checked = {"ContentLength": 5, "ETag": '"aaaa"', "LastModified": datetime.datetime.now(datetime.UTC)}
    stub.add_response("head_object", checked, {"Bucket": "b", "Key": "stage/m"})  # publish's stat
    # publish's check of the target (the create-only copy right after it sends none of its own)
    stub.add_client_error("head_object", "404", http_status_code=404, expected_params={"Bucket": "b", "Key": "out/m"})
    copy = {"Bucket": "b", "Key": "out/m", "CopySource": ANY, "CopySourceIfMatch": '"aaaa"', "IfNoneMatch": "*"}
    stub.add_client_error("copy_object", "PreconditionFailed", http_status_code=412, expected_params=copy)
    if target_present:
        stub.add_response("head_object", {**checked, "ETag": '"bbbb"'}, {"Bucket": "b", "Key": "out/m"})
    else:
        stub.add_client_error(
            "head_object", "404", http_status_code=404, expected_params={"Bucket": "b", "Key": "out/m"}
        )
    stub.activate()
    return S3Storage(client=client, max_attempts=1), stub


def test_s3_publish_refuses_a_staged_object_replaced_after_its_check() -> None:
    from ckptconv.core.errors import VerificationFailed

    storage, stub = _stubbed_copy_refused(target_present=False)
    with pytest.raises(VerificationFailed, match="changed after publication checked it"):
        storage.publish([("s3://b/stage/m", "s3://b/out/m")])
    stub.assert_no_pending_responses()


def test_s3_publish_refused_by_a_target_created_meanwhile_is_target_exists() -> None:
    storage, stub = _stubbed_copy_refused(target_present=True)
    with pytest.raises(TargetExists):
        storage.publish([("s3://b/stage/m", "s3://b/out/m")])
    stub.assert_no_pending_responses()


def test_s3_publish_that_placed_its_object_does_not_fail_on_the_staged_copys_removal(s3_bucket):
    # The engine removes only what a publish it saw succeed placed: a publish that raised after its
    # copy reached the target left that object there, without the job's manifest.
    from ckptconv.core.errors import StorageError
    from ckptconv.storage.s3 import S3Storage

    storage = S3Storage(max_attempts=1)
    staged, final = f"s3://{s3_bucket}/stage/m", f"s3://{s3_bucket}/out/m"
    storage.write_bytes(staged, b"checkpoint bytes")
    delete = storage.delete

    def failing(uri: str) -> None:
        if uri == staged:
            raise StorageError(f"S3 request for {uri} failed: reset", uri=uri)
        delete(uri)

    storage.delete = failing
    storage.publish([(staged, final)])
    assert storage.read_all(final) == b"checkpoint bytes"
