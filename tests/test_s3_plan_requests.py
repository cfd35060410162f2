"""Planning over S3, and staging and publishing to it, cost few requests, as the S3 server's own
request log counts them.

Object stores charge latency (and money) per request: a plan over a checkpoint of many shards
should need about one request per shard (its header, whose ranged GET also tells the shard's
size), and an H5 file's scattered metadata should come in a few large reads. A small object
(a manifest, a record) is read with one GET and written with one check and one PUT; publication
checks each file once. The counts are read from moto's access log, so every request is seen,
whichever part of the code sent it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from s3_access_log import AccessLoggedS3, aws_environ
from safetensors.torch import save

from ckptconv.core.errors import ObjectNotFound, TargetExists
from ckptconv.engine.convert import convert, plan_conversion
from ckptconv.storage.s3 import S3Storage


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("plan-requests")
    s3 = AccessLoggedS3(tmp / "s3-access.log")
    try:
        with aws_environ(s3.endpoint):
            bucket = f"plan-{uuid.uuid4().hex[:10]}"
            client = boto3.client("s3", endpoint_url=s3.endpoint)
            client.create_bucket(Bucket=bucket)
            yield {"s3": s3, "bucket": bucket, "client": client, "tmp": tmp}
    finally:
        s3.stop()


def _requests_of(logged: dict[str, Any], run: Any) -> list[tuple[str, str]]:
    """(method, key) of every request the server logged while ``run()`` ran."""
    s3: AccessLoggedS3 = logged["s3"]
    since = s3.offset()
    run()
    return [(method, key) for method, bucket, key, _ in s3.requests(since) if bucket == logged["bucket"]]


def _sharded(logged: dict[str, Any], prefix: str, shards: int) -> str:
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"layers.{i}.w{j}": torch.randn(64, 64, generator=g) for j in range(20)}
        logged["client"].put_object(Bucket=logged["bucket"], Key=f"{prefix}/{name}", Body=save(tensors))
        weight_map.update(dict.fromkeys(tensors, name))
    index = json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}).encode()
    key = f"{prefix}/model.safetensors.index.json"
    logged["client"].put_object(Bucket=logged["bucket"], Key=key, Body=index)
    return f"s3://{logged['bucket']}/{key}"


def test_a_plan_over_shards_needs_one_request_per_shard(logged: dict[str, Any]) -> None:
    shards = 6
    uri = _sharded(logged, "st", shards)
    plans: list[dict[str, Any]] = []
    seen = _requests_of(logged, lambda: plans.append(plan_conversion(uri, to="cs-h5")))
    assert plans[0]["ok"], plans[0]
    shard_requests = [(m, k) for m, k in seen if k.endswith(".safetensors")]
    # One ranged GET per shard: its Content-Range tells the size, so no HEAD goes with it.
    assert sorted(shard_requests) == sorted(
        ("GET", f"st/model-{i:05d}-of-{shards:05d}.safetensors") for i in range(1, shards + 1)
    ), seen
    # The index: its format sniffed, found (HEAD) and read with one GET.
    assert len(seen) <= shards + 3, seen


def test_a_plan_over_one_safetensors_file_is_three_requests(logged: dict[str, Any]) -> None:
    key = "single/model.safetensors"
    logged["client"].put_object(Bucket=logged["bucket"], Key=key, Body=save({"w": torch.zeros(256, 256)}))
    plans: list[dict[str, Any]] = []
    seen = _requests_of(logged, lambda: plans.append(plan_conversion(f"s3://{logged['bucket']}/{key}", to="cs-h5")))
    assert plans[0]["ok"], plans[0]
    # Its format sniffed from its first bytes, found, and its header read (with its size: no HEAD).
    assert seen == [("GET", key), ("HEAD", key), ("GET", key)], seen


@pytest.mark.parametrize("layout", ["chunked", "contiguous"])
def test_a_plan_over_an_h5_file_reads_its_metadata_in_few_requests(logged: dict[str, Any], layout: str) -> None:
    g = torch.Generator().manual_seed(4)
    tensors = {f"layers.{i}.w": torch.randn(256, 1024, generator=g) for i in range(40)}  # 1 MiB each
    tmp: Path = logged["tmp"]
    st = tmp / f"{layout}.safetensors"
    st.write_bytes(save(tensors))
    if layout == "chunked":  # the local default: object headers between the datasets
        local = tmp / f"{layout}.mdl"
        convert(str(st), str(local), to="cs-h5")
        key = f"h5/{layout}.mdl"
        logged["client"].put_object(Bucket=logged["bucket"], Key=key, Body=local.read_bytes())
    else:  # the S3 default, written by ckptconv straight to the store
        key = f"h5/{layout}/model.mdl"
        convert(str(st), f"s3://{logged['bucket']}/{key}", to="cs-h5")
    plans: list[dict[str, Any]] = []
    seen = _requests_of(
        logged, lambda: plans.append(plan_conversion(f"s3://{logged['bucket']}/{key}", to="safetensors"))
    )
    assert plans[0]["ok"], plans[0]
    assert {m for m, _ in seen} == {"GET"}, seen  # the size comes with the first GET
    if layout == "contiguous":  # every object header at the front
        assert len(seen) <= 3, seen
    else:  # one small read per object header found between the datasets, none for the data
        assert len(seen) <= len(tensors) + 2, seen


def test_a_small_object_is_read_whole_with_one_get(logged: dict[str, Any]) -> None:
    storage = S3Storage()
    key = "small/manifest.json"
    logged["client"].put_object(Bucket=logged["bucket"], Key=key, Body=b'{"files": []}')
    got: list[bytes] = []
    seen = _requests_of(logged, lambda: got.append(storage.read_all(f"s3://{logged['bucket']}/{key}")))
    assert got == [b'{"files": []}']
    assert seen == [("GET", key)], seen  # its size comes with its bytes: no HEAD
    with pytest.raises(ObjectNotFound):
        storage.read_all(f"s3://{logged['bucket']}/small/absent.json")


def test_a_small_object_is_written_with_one_check_and_one_put(logged: dict[str, Any]) -> None:
    storage = S3Storage()
    key = "small/record.json"
    uri = f"s3://{logged['bucket']}/{key}"
    infos = []
    seen = _requests_of(logged, lambda: infos.append(storage.write_bytes(uri, b"[1, 2]")))
    assert seen == [("HEAD", key), ("PUT", key)], seen  # checked absent, then put create-only
    assert infos[0].size == 6 and infos[0].etag == storage.stat(uri).etag
    with pytest.raises(TargetExists):
        storage.write_bytes(uri, b"[3]")
    assert logged["client"].get_object(Bucket=logged["bucket"], Key=key)["Body"].read() == b"[1, 2]"


def test_a_conversion_to_s3_checks_each_object_once_per_step(logged: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(5)
    st = logged["tmp"] / "publish.safetensors"
    st.write_bytes(save({f"layers.{i}.w": torch.randn(64, 64, generator=g) for i in range(4)}))
    target = f"s3://{logged['bucket']}/published/model.mdl"
    seen = _requests_of(logged, lambda: convert(str(st), target, to="cs-h5"))
    assert logged["client"].head_object(Bucket=logged["bucket"], Key="published/model.mdl")["ContentLength"] > 0
    heads = [k for m, k in seen if m == "HEAD"]
    # The target and the manifest name beside it, before any work; the staged file by its sink
    # (before any work) and by its put; the staged manifest by its put (each put's own check, none
    # before or after it); publication: the target (is it this job's already?) and, by the copy of
    # each file, its source and target once each. Reading the staged manifest back is a GET,
    # without a HEAD.
    assert len(heads) <= 10, seen
    assert len(seen) <= 23, seen


def test_waiting_for_the_parts_of_a_fan_out_lists_their_records(logged: dict[str, Any]) -> None:
    # The job's worker waits for its parts' records: one request per poll (a listing of the
    # records), not a request per part per poll, which at hundreds of parts would be over a
    # thousand requests a second against the target's prefix. Each record is looked for by its
    # part before it runs and checked by the put that writes it, then read once by the commit.
    parts = 6
    g = torch.Generator().manual_seed(6)
    st = logged["tmp"] / "fanned.safetensors"
    st.write_bytes(save({f"layers.{i}.w": torch.randn(1024, 1024, generator=g) for i in range(12)}))
    target = f"s3://{logged['bucket']}/fanned/model.mdl"
    s3: AccessLoggedS3 = logged["s3"]
    since = s3.offset()
    convert(str(st), target, to="cs-h5", parallelism=parts)
    seen = [(m, k, q) for m, b, k, q in s3.requests(since) if b == logged["bucket"]]
    records = [(m, k) for m, k, _ in seen if re.search(r"/\.fanout/part-\d+\.json$", k)]
    heads = [k for m, k in records if m == "HEAD"]
    assert len(set(heads)) == parts and len(heads) == 2 * parts, records
    reads = [k for m, k in records if m == "GET"]
    assert len(reads) == len(set(reads)) == parts, records
    listings = [q for m, k, q in seen if m == "GET" and "list-type" in q and "part-" in q.get("prefix", [""])[0]]
    assert 1 <= len(listings) <= parts + 1, listings
