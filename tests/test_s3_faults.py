"""S3 faults: the real S3 server (moto) behind a loopback proxy that injects 500s, lost answers,
connection resets mid-body, bodies without a length and stalled responses (bench/faultproxy.py).

Promises checked: every storage call retries per one policy; a broken ranged read asks only for
the rest of its range; a job either succeeds or fails with ``storage_error`` (never an untyped
error); whatever happens, nothing stays in staging, no multipart upload is left open, and nothing
appears at a target without its manifest.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import save

from bench.faultproxy import FaultProxy
from ckptconv import jobs
from ckptconv.core.errors import CkptconvError, StorageError
from ckptconv.storage.s3 import S3Storage

MiB = 1 << 20


@pytest.fixture
def direct(s3_server: str, s3_bucket: str) -> S3Storage:
    """Storage that talks to the server without faults: set-up and checks."""
    return S3Storage(s3_server)


def faulty_env(monkeypatch: pytest.MonkeyPatch, proxy: FaultProxy, attempts: int) -> None:
    """Point every storage opened from now on at the proxy, with a short stall timeout."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("CKPTCONV_S3_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("CKPTCONV_STORAGE_BACKOFF_S", "0.01")
    monkeypatch.setenv("CKPTCONV_STORAGE_BACKOFF_MAX_S", "0.05")
    monkeypatch.setenv("CKPTCONV_STORAGE_ATTEMPTS", str(attempts))


@pytest.fixture
def proxy_factory(s3_server: str) -> Iterator[Any]:
    started: list[FaultProxy] = []

    def make(**kwargs: Any) -> FaultProxy:
        p = FaultProxy(s3_server, **kwargs)
        p.start()
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


def tensors(n: int = 12, dim: int = 256) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    out = {f"layers.{i}.weight": torch.randn(dim, dim, generator=g) for i in range(n)}
    out["layers.0.bias"] = torch.arange(dim, dtype=torch.int64)
    return out


def run_job(source: str, target: str, to: str) -> dict[str, Any]:
    """One conversion job through the job layer, classified as the worker classifies it."""
    ctx = jobs.context_from_request(
        {"kind": "convert", "source": {"uri": source}, "target": {"uri": target, "format": to}},
        uuid.uuid4().hex,
    )
    try:
        return {"state": "succeeded", "result": jobs.handler(ctx.kind).run(ctx)}
    except CkptconvError as e:
        return {"state": "failed", "code": e.code, "message": str(e)}
    except Exception as e:  # what the worker records as internal_error
        return {"state": "failed", "code": "internal_error", "message": f"{type(e).__name__}: {e}"}


def leftovers(direct: S3Storage, bucket: str) -> dict[str, list[str]]:
    staged = [o.uri for o in direct.list(f"s3://{bucket}/") if "/.ckptconv-staging/" in o.uri]
    uploads = direct.client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return {"staging": staged, "uploads": [u["Key"] for u in uploads]}


CONVERSIONS = [
    ("src/model.safetensors", "safetensors", "out/model.mdl", "cs-h5"),
    ("out/model.mdl", "cs-h5", "out/st", "safetensors"),
]


def test_conversions_succeed_through_faults_at_5_percent(direct, s3_bucket, proxy_factory, monkeypatch):
    expected = tensors()
    direct.write_bytes(f"s3://{s3_bucket}/src/model.safetensors", save(expected))
    proxy = proxy_factory(rate=0.05, stall_s=1.5, seed=5)
    faulty_env(monkeypatch, proxy, attempts=8)
    for src, _fmt, dst, to in CONVERSIONS:
        job = run_job(f"s3://{s3_bucket}/{src}", f"s3://{s3_bucket}/{dst}", to)
        assert job["state"] == "succeeded", job
    assert sum(proxy.counts.values()) >= 3, proxy.counts  # the faults did happen

    from safetensors.torch import load

    (shard,) = [o.uri for o in direct.list(f"s3://{s3_bucket}/out/st/") if o.uri.endswith(".safetensors")]
    got = load(direct.read_all(shard))
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert leftovers(direct, s3_bucket) == {"staging": [], "uploads": []}


def test_faults_past_the_budget_fail_as_storage_errors_and_leave_nothing(direct, s3_bucket, proxy_factory, monkeypatch):
    direct.write_bytes(f"s3://{s3_bucket}/src/model.safetensors", save(tensors()))
    direct.write_bytes(f"s3://{s3_bucket}/base/model.safetensors", save(tensors(4)))
    proxy = proxy_factory(rate=0.35, stall_s=1.5, seed=11)
    faulty_env(monkeypatch, proxy, attempts=2)
    outcomes = []
    for i in range(6):
        target = f"s3://{s3_bucket}/out{i}/model.mdl"
        job = run_job(f"s3://{s3_bucket}/src/model.safetensors", target, "cs-h5")
        outcomes.append(job["code"] if job["state"] == "failed" else "succeeded")
        present = [o.uri for o in direct.list(f"s3://{s3_bucket}/out{i}/")]
        if job["state"] == "succeeded":
            assert f"{target}.manifest.json" in present
        else:
            assert present == [], f"{job}: left {present} at the target"
    assert set(outcomes) <= {"succeeded", "storage_error"}, outcomes
    assert "storage_error" in outcomes, (outcomes, proxy.counts)
    assert leftovers(direct, s3_bucket) == {"staging": [], "uploads": []}


def test_a_reset_mid_body_rereads_only_the_rest_of_the_range(direct, s3_bucket, proxy_factory):
    data = os.urandom(12 * MiB)
    direct.write_bytes(f"s3://{s3_bucket}/blob", data)
    proxy = proxy_factory(rate=0.5, faults=("reset",), seed=3)
    ranges: list[str] = []
    proxy.on_request = lambda method, path, headers: ranges.append(headers.get("range", ""))
    storage = S3Storage(proxy.url, max_attempts=20)
    assert storage.read_range(f"s3://{s3_bucket}/blob", 1000, 10 * MiB) == data[1000 : 1000 + 10 * MiB]
    gets = [r for r in ranges if r]
    assert proxy.counts["reset"] >= 1 and len(gets) >= 2, (proxy.counts, gets)
    starts = [int(r.removeprefix("bytes=").split("-")[0]) for r in gets]
    assert starts[0] == 1000 and all(b > a for a, b in itertools.pairwise(starts)), gets
    assert {r.split("-")[1] for r in gets} == {str(1000 + 10 * MiB - 1)}


def test_missing_or_short_content_length_is_retried_never_a_key_error(direct, s3_bucket, proxy_factory):
    data = os.urandom(3 * MiB)
    direct.write_bytes(f"s3://{s3_bucket}/blob", data)
    proxy = proxy_factory(rate=0.5, faults=("nolength",), seed=7)
    storage = S3Storage(proxy.url, max_attempts=30)
    for _ in range(5):
        assert storage.stat(f"s3://{s3_bucket}/blob").size == len(data)
        assert storage.read_all(f"s3://{s3_bucket}/blob") == data
    assert proxy.counts["nolength"] >= 3
    always = proxy_factory(rate=1.0, faults=("nolength",))
    with pytest.raises(StorageError) as info:
        S3Storage(always.url, max_attempts=2).stat(f"s3://{s3_bucket}/blob")
    assert info.value.code == "storage_error"


def test_multipart_writes_and_publish_through_faults(direct, s3_bucket, proxy_factory, monkeypatch):
    """Lost answers to create-only writes are recognized as our own objects; nothing leaks."""
    monkeypatch.setenv("CKPTCONV_S3_READ_TIMEOUT_S", "1")
    proxy = proxy_factory(rate=0.3, stall_s=1.5, seed=2)
    storage = S3Storage(proxy.url, max_attempts=20)
    data = os.urandom(11 * MiB)
    for i in range(3):
        with storage.open_writer(f"s3://{s3_bucket}/stage/big{i}", part_size=5 * MiB) as w:
            w.write(data)
        storage.write_bytes(f"s3://{s3_bucket}/stage/small{i}", b"small %d" % i)
    storage.publish([(f"s3://{s3_bucket}/stage/big{i}", f"s3://{s3_bucket}/final/big{i}") for i in range(3)])
    assert proxy.counts["lost"] >= 1, proxy.counts
    for i in range(3):
        assert direct.read_all(f"s3://{s3_bucket}/final/big{i}") == data
        assert direct.read_all(f"s3://{s3_bucket}/stage/small{i}") == b"small %d" % i
    assert storage.delete_prefix(f"s3://{s3_bucket}/stage/") == 3
    assert leftovers(direct, s3_bucket)["uploads"] == []
