"""URI syntax: the name and the parent of S3 and local URIs, and joins under a base."""

from __future__ import annotations

import pytest

from ckptconv.core.errors import InvalidRequest, PathEscape
from ckptconv.core.uri import as_prefix, basename, join, parent


@pytest.mark.parametrize(
    ("uri", "name"),
    [
        ("s3://b/run/ckpt.mdl", "ckpt.mdl"),
        ("s3://b/run/ckpt/", "ckpt"),
        ("s3://b/run/ckpt//", "ckpt"),
        ("s3://b/ckpt", "ckpt"),
        ("s3://b", "b"),
        ("s3://b/", "b"),
        ("/data/run/model.safetensors", "model.safetensors"),
        ("/data/run/", "run"),
        ("model.safetensors", "model.safetensors"),
        ("run/model.bin", "model.bin"),
        ("file:///data/ckpt", "ckpt"),
        ("/", ""),
        ("", ""),
    ],
)
def test_basename(uri: str, name: str) -> None:
    assert basename(uri) == name


@pytest.mark.parametrize(
    ("uri", "up"),
    [
        ("s3://b/run/ckpt.mdl", "s3://b/run"),
        ("s3://b/run/ckpt/", "s3://b/run"),
        ("s3://b/a/b/c", "s3://b/a/b"),
        ("s3://b/ckpt", "s3://b"),
        ("s3://b/ckpt/", "s3://b"),
        ("/data/run/model.safetensors", "/data/run"),
        ("/data/run/", "/data"),
        ("/model.bin", "/"),
        ("model.bin", "."),
        ("run/model.bin", "run"),
        ("file:///data/ckpt", "file:///data"),
        ("file:///ckpt", "file:///"),
        ("file://localhost/data/ckpt/", "file://localhost/data"),
    ],
)
def test_parent(uri: str, up: str) -> None:
    assert parent(uri) == up


@pytest.mark.parametrize("uri", ["s3://b", "s3://b/", "s3://b//"])
def test_a_bucket_root_has_no_parent(uri: str) -> None:
    with pytest.raises(InvalidRequest, match="names a bucket"):
        parent(uri)


def test_a_uri_without_bucket_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="without a bucket"):
        parent("s3:///key")


@pytest.mark.parametrize(
    ("base", "parts", "joined"),
    [
        ("s3://b/run", ("ckpt", "model.safetensors"), "s3://b/run/ckpt/model.safetensors"),
        ("s3://b/run/", ("shard-1.bin",), "s3://b/run/shard-1.bin"),
        ("s3://b/", ("key",), "s3://b/key"),
        ("/data/run", ("a/b.bin",), "/data/run/a/b.bin"),
        ("/data/run/", ("x",), "/data/run/x"),
        ("", ("x",), "x"),
    ],
)
def test_join(base: str, parts: tuple[str, ...], joined: str) -> None:
    assert join(base, *parts) == joined
    assert parent(join(joined, "leaf")) == joined
    assert basename(joined) == basename(parts[-1])


@pytest.mark.parametrize("part", ["../up", "/abs", "a//b", "a/", ".", "a\\b"])
def test_join_refuses_names_that_escape(part: str) -> None:
    with pytest.raises(PathEscape):
        join("s3://b/run", part)


@pytest.mark.parametrize(
    ("uri", "prefix"),
    [
        ("s3://b/run", "s3://b/run/"),
        ("s3://b/run//", "s3://b/run/"),
        ("/data/run/", "/data/run/"),
        ("s3://b", "s3://b/"),
    ],
)
def test_as_prefix(uri: str, prefix: str) -> None:
    assert as_prefix(uri) == prefix
    assert not "s3://b/run-2/x".startswith(as_prefix("s3://b/run"))
