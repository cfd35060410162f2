"""URI scopes (ckptconv.core.scopes) and the confined storage every job runs through.

The rules: prefixes match whole segments; URIs are compared in canonical form and ambiguous
spellings are refused; local paths are resolved through symlinks; every storage operation a job
can make (reads, writes, probes, listings, deletes, publishes, local paths) is checked.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ckptconv.core.errors import Forbidden, InvalidRequest, PathEscape
from ckptconv.core.scopes import NOTHING, UNRESTRICTED, Scopes, canonical_prefix, canonical_uri, resolved_path
from ckptconv.storage import open_storage
from ckptconv.storage.confined import ConfinedStorage, current_scopes, scoped, set_default_scopes

TEAM = Scopes.of(["s3://b/team/", "/data/team/"])


@pytest.mark.parametrize(
    "uri",
    [
        "s3://b/team/x",
        "s3://b/team/a/b/c.safetensors",
        "S3://b/team/x",  # the scheme is case-insensitive
        "/data/team/x",
        "file:///data/team/x",
        "file://localhost/data/team/x",
        "/data/team/./x",
        "/data//team/x",
        "s3://b/team/",
    ],
)
def test_uris_under_a_prefix_are_allowed(uri: str) -> None:
    assert TEAM.allows(uri)


@pytest.mark.parametrize(
    ("uri", "error"),
    [
        ("s3://b/team2/x", Forbidden),  # segment boundaries: team is not team2
        ("s3://b/team", Forbidden),  # the object named like the prefix is outside it
        ("s3://b-x/team/x", Forbidden),  # another bucket that starts like this one
        ("s3://bb/team/x", Forbidden),
        ("s3://b/Team/x", Forbidden),  # S3 keys are case-sensitive
        ("s3://B/team/x", InvalidRequest),  # a bucket spelling a store might fold
        ("s3://b/team/../other/x", PathEscape),
        ("s3://b/team/%2e%2e/other/x", PathEscape),
        ("s3://b/team/%2E%2e/other/x", PathEscape),
        ("s3://b/team%2f..%2fother/x", PathEscape),
        ("s3://b/team/..%5cother", PathEscape),
        ("s3://b/team\\..\\other", PathEscape),
        ("s3://b/team//x", PathEscape),  # an empty segment some stores collapse
        ("s3://b//team/x", PathEscape),
        ("s3://b/team/./x", PathEscape),
        ("s3://b/team/x\x00", InvalidRequest),
        ("s3://b/team/x\nINFO forged log line", InvalidRequest),  # control characters, any of them
        ("s3://b/team/x\r", InvalidRequest),
        ("s3://b/team/\x1b[2Jx", InvalidRequest),
        ("s3://b/team/x\x7f", InvalidRequest),
        ("/data/team/x\ty", InvalidRequest),
        ("/data/team/../other/x", PathEscape),
        ("/data/team2/x", Forbidden),
        ("/data/teamx", Forbidden),
        ("//data/other", Forbidden),
        ("data/team/x", Forbidden),  # relative: resolved on the worker, outside every prefix
        ("file://otherhost/data/team/x", InvalidRequest),
        ("http://b/team/x", InvalidRequest),
        ("/etc/passwd", Forbidden),
    ],
)
def test_escapes_are_refused(uri: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        TEAM.check(uri)
    assert not TEAM.allows(uri)


def test_prefixes_are_normalised_to_whole_segments() -> None:
    assert canonical_prefix("s3://b/team") == "s3://b/team/"
    assert canonical_prefix("S3://b") == "s3://b/"
    assert canonical_prefix("file:///data/team") == "/data/team/"
    assert canonical_prefix("/data/team/") == "/data/team/"
    for bad in ("", " ", "relative/dir", "s3://b/a/../b", "s3://b/%2e%2e/", "http://x/"):
        with pytest.raises((InvalidRequest, PathEscape)):
            canonical_prefix(bad)
    assert Scopes.of(["s3://b/team"]).prefixes == ("s3://b/team/",)
    assert not Scopes.of(["s3://b/team"]).allows("s3://b/team2/x")


def test_canonical_uri_keeps_s3_keys_and_normalises_paths() -> None:
    assert canonical_uri("S3://b/team/a b/x") == "s3://b/team/a b/x"
    assert canonical_uri("file:///data/./team/x/") == "/data/team/x/"


def test_record_round_trip_and_fail_closed() -> None:
    assert Scopes.from_record(TEAM.to_record()) == TEAM
    assert Scopes.from_record(None) is UNRESTRICTED
    assert Scopes.from_record("not a list") is NOTHING
    assert not NOTHING.allows("s3://b/team/x")
    assert UNRESTRICTED.allows("/etc/passwd")


def test_listings_above_a_prefix_yield_only_what_the_scopes_allow(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    for name in ("team/a", "team2/b", "teamx"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
    with scoped(Scopes.of([f"{root}/team/"])):
        storage = open_storage(str(root))
        assert [i.uri for i in storage.list(f"{root}/team")] == [f"{root}/team/a"]
        with pytest.raises(Forbidden):
            list(storage.list(f"{root}/team2"))
        assert storage.delete_prefix(f"{root}/team") == 1
    assert (root / "team2/b").exists() and (root / "teamx").exists()


def test_a_symlink_inside_a_prefix_grants_nothing_outside(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    (root / "team").mkdir()
    (root / "secret").mkdir()
    (root / "secret/key").write_bytes(b"canary")
    os.symlink(root / "secret", root / "team/link")
    os.symlink(root / "secret/key", root / "team/key-link")
    with scoped(Scopes.of([f"{root}/team/"])):
        storage = open_storage(str(root))
        for uri in (f"{root}/team/link/key", f"{root}/team/key-link"):
            with pytest.raises(Forbidden, match="symlink"):
                storage.read_all(uri)
            with pytest.raises(Forbidden):
                storage.local_path(uri)


def test_local_paths_resolve_as_realpath_resolves_them(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    (root / "team/dir").mkdir(parents=True)
    (root / "team/file").write_bytes(b"")
    (root / "secret").mkdir()
    os.symlink(root / "secret", root / "team/abs-link")
    os.symlink("../secret", root / "team/rel-link")
    os.symlink("dir", root / "team/dir-link")
    os.symlink(root / "nowhere/x", root / "team/dangling")
    os.symlink("loop-b", root / "team/loop-a")
    os.symlink("loop-a", root / "team/loop-b")
    names = ["dir", "file", "abs-link", "rel-link", "dir-link", "dangling", "loop-a", "missing"]
    paths = [f"{root}/team/{a}" for a in names] + [f"{root}/team/{a}/{b}" for a in names for b in names]
    paths += [p + "/" for p in paths] + [f"{root}/team/missing/x/y/", "/", f"{root}/team/file/x/y"]
    for path in paths:
        assert resolved_path(path) == os.path.realpath(path), path
    team = Scopes.of([f"{root}/team/"])
    for name in ("abs-link", "rel-link", "dangling", "abs-link/missing/x"):
        with pytest.raises(Forbidden, match="symlink"):
            team.check(f"{root}/team/{name}")
    assert team.check(f"{root}/team/dir-link/missing/x") == f"{root}/team/dir-link/missing/x"


def test_every_operation_is_checked_on_s3(s3_bucket: str) -> None:
    outside = f"s3://{s3_bucket}/other/canary"
    unscoped = open_storage(outside)
    unscoped.write_bytes(outside, b"canary")
    inside = f"s3://{s3_bucket}/team/x"
    with scoped(Scopes.of([f"s3://{s3_bucket}/team/"])):
        storage = open_storage(inside)
        assert isinstance(storage, ConfinedStorage)
        with storage.open_writer(inside, metadata={"metadata": "{}"}) as w:  # a backend's own option
            w.write(b"mine")
        assert storage.backend(inside) is storage.inner
        buf = bytearray(4)
        storage.read_into(inside, 0, buf)
        assert buf == b"mine"
        calls = [
            lambda: storage.stat(outside),
            lambda: storage.exists(outside),
            lambda: storage.read_range(outside, 0, 1),
            lambda: storage.read_into(outside, 0, bytearray(1)),
            lambda: storage.read_all(outside),
            lambda: storage.open_reader(outside),
            lambda: storage.digest(outside),
            lambda: storage.open_writer(f"s3://{s3_bucket}/other/new"),
            lambda: storage.write_bytes(outside, b"x", overwrite=True),
            lambda: storage.delete(outside),
            lambda: storage.delete_prefix(f"s3://{s3_bucket}/other/"),
            lambda: list(storage.list(f"s3://{s3_bucket}/other/")),
            lambda: storage.publish([(inside, outside)], overwrite=True),
            lambda: storage.publish([(outside, f"s3://{s3_bucket}/team/stolen")]),
            lambda: storage.local_path(outside),
            lambda: storage.backend(outside),
            lambda: storage.user_metadata(outside),
        ]
        for call in calls:
            with pytest.raises(Forbidden):
                call()
        assert [i.uri for i in storage.list(f"s3://{s3_bucket}/")] == [inside]
    assert unscoped.read_all(outside) == b"canary"
    assert not unscoped.exists(f"s3://{s3_bucket}/other/new")
    assert not unscoped.exists(f"s3://{s3_bucket}/team/stolen")


def test_outside_a_scope_a_worker_process_reaches_nothing(tmp_path: Path) -> None:
    # Worker processes set this default at start: storage opened outside a job's scope, e.g. in a
    # helper thread that did not inherit the job's context, fails closed.
    (tmp_path / "f").write_bytes(b"x")
    seen: list[BaseException | None] = []
    set_default_scopes(NOTHING)
    try:
        with scoped(UNRESTRICTED):
            assert open_storage(str(tmp_path / "f")).read_all(str(tmp_path / "f")) == b"x"

            def helper() -> None:
                try:
                    open_storage(str(tmp_path / "f")).read_all(str(tmp_path / "f"))
                    seen.append(None)
                except Forbidden as e:
                    seen.append(e)

            t = threading.Thread(target=helper)
            t.start()
            t.join()
        with pytest.raises(Forbidden):
            open_storage(str(tmp_path / "f")).stat(str(tmp_path / "f"))
    finally:
        set_default_scopes(None)
    assert isinstance(seen[0], Forbidden)
    assert current_scopes() is None


def test_a_listing_above_a_prefix_asks_the_store_only_inside_it(tmp_path: Path) -> None:
    scopes = Scopes.of(["s3://b/team/", "s3://b/tea/", f"{tmp_path}/team/"])
    assert scopes.listing_starts("s3://b/team/x") == ["s3://b/team/x"]
    assert scopes.listing_starts("s3://b/te") == ["s3://b/team/", "s3://b/tea/"]
    assert scopes.listing_starts("s3://b") == ["s3://b/team/", "s3://b/tea/"]
    assert scopes.listing_starts(f"file://{tmp_path}/te") == [f"file://{tmp_path}/team/"]
    for outside in ("s3://b/other", "s3://b-x/", f"{tmp_path}/other", "relative"):
        with pytest.raises(Forbidden):
            scopes.listing_starts(outside)
