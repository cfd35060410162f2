"""Fanned-out jobs (``parallelism`` > 1) on real worker processes, real Redis and a moto S3 server.

Promises checked: the parts spread over the workers and the committed output is the single-worker
output byte for byte; a part worker killed with SIGKILL mid-part is redone and the job still
commits correct bytes; a cancel mid-fan-out leaves nothing at the target, no staging and no
multipart upload; duplicate deliveries of the job's and the parts' messages run nothing twice and
publish once.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import test_e2e_service as e2e
import torch
from safetensors.torch import save
from test_e2e_service import Service, listing, wait_for

from ckptconv.core.settings import Settings
from ckptconv.engine.plan import identity_plan
from ckptconv.engine.run import run_plan
from ckptconv.formats.detect import open_source
from ckptconv.storage import open_storage
from ckptconv.storage.digests import holds_output
from worker.celery_app import make_celery

bucket = e2e.bucket


def _checkpoint(bucket: str, key: str, n: int, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(n)
    tensors = {f"layers.{i}.weight": torch.randn(*shape, generator=g) for i in range(n)}
    tensors["layers.0.bias"] = torch.arange(shape[1], dtype=torch.int64)
    tensors["layers.1.step"] = torch.tensor(3)
    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=save(tensors))


@pytest.fixture(scope="module")
def source(bucket: str) -> str:
    """A 24 MiB checkpoint (several upload parts per fanned-out part) that tests only read."""
    _checkpoint(bucket, "team/fan-src/model.safetensors", 24, (512, 512))
    return f"s3://{bucket}/team/fan-src/model.safetensors"


@pytest.fixture(scope="module")
def single_worker(bucket: str, tmp_path_factory: pytest.TempPathFactory):
    """The sha256s of a conversion in this process (no fan-out) of ``source`` to ``to``, on S3 or a
    local disk, to a target called ``name``: converted once per module, whichever test asks first."""
    tmp = tmp_path_factory.mktemp("single")
    done: dict[tuple[str, str, str, str], list[str]] = {}

    def sha256s(source: str, to: str, where: str, name: str) -> list[str]:
        key = (source, to, where, name)
        if key not in done:
            base = f"s3://{bucket}/team/single/{len(done)}" if where == "s3" else f"{tmp}/{len(done)}"
            done[key] = _single_worker_sha256(source, f"{base}/{name}", to)
        return done[key]

    return sha256s


def _single_worker_sha256(source: str, target: str, to: str) -> list[str]:
    src = open_source(source)
    try:
        result = run_plan(identity_plan(src.entries(), src.spec), src, to=to, target=target)
    finally:
        src.close()
    return [hashlib.sha256(open_storage(o.uri).read_all(o.uri)).hexdigest() for o in result.outputs]


def _sha256s(job: dict) -> list[str]:
    return [hashlib.sha256(open_storage(o["uri"]).read_all(o["uri"])).hexdigest() for o in job["result"]["outputs"]]


def _uploads(bucket: str) -> list[dict]:
    return boto3.client("s3").list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _logs(svc: Service) -> str:
    return "".join(Path(p.log_path).read_text() for p in svc.procs[1:])


def _pid(token: str | None) -> int | None:
    return int(token.split(":")[1]) if token else None


@pytest.fixture(scope="module")
def service(redis_url: str, bucket: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("fanout")
    # parallelism "auto": one part per 8 MiB of output here (2 GiB by default).
    auto = {"CKPTCONV_AUTO_PARALLELISM_PART_BYTES": str(8 << 20), "CKPTCONV_AUTO_PARALLELISM_MAX": "3"}
    svc = Service(redis_url, bucket, tmp, prefixes=[f"s3://{bucket}/team/", f"{tmp}/out/"], env=auto, workers=2)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.mark.parametrize(
    ("to", "name", "where"),
    [
        ("cs-h5", "model.mdl", "s3"),
        ("safetensors", "x", "local"),
        ("torch", "model.bin", "s3"),
        ("tf", "ckpt", "local"),
    ],
)
def test_two_workers_commit_the_single_worker_bytes(
    service: Service, source: str, single_worker, to: str, name: str, where: str
) -> None:
    b = service.bucket
    base = f"s3://{b}/team/fan-{to}-out" if where == "s3" else f"{service.tmp}/out/fan-{to}"
    with service.client() as c:
        job = c.submit(source, f"{base}/two/{name}", to=to, options={"parallelism": 2})
        job = c.wait(job["id"], timeout=300)
    assert job["state"] == "succeeded" and job["attempts"] == 1, job.get("error")
    assert job["result"]["extras"]["parallelism"] == 2
    assert _sha256s(job) == single_worker(source, to, where, name)
    # Each output's recorded checksum (an S3 file's is its block digest) is its bytes'.
    assert all(holds_output(open_storage(o["uri"]).read_all(o["uri"]), o) for o in job["result"]["outputs"])
    assert job["progress"]["stage"] == "done"
    assert "ckptconv.run_part[" in _logs(service)
    assert not listing(b, "team/.ckptconv-staging") and _uploads(b) == []


def test_auto_parallelism_follows_the_output_size_and_the_settings_cap(
    service: Service, source: str, single_worker
) -> None:
    b = service.bucket
    # 24 MiB of output: 4 parts of 8 MiB, capped at 3.
    with service.client() as c:
        job = c.submit(source, f"{service.tmp}/out/fan-auto/x", to="safetensors", options={"parallelism": "auto"})
        job = c.wait(job["id"], timeout=300)
        assert job["state"] == "succeeded", job.get("error")
        assert job["result"]["extras"]["parallelism"] == 3
        assert _sha256s(job) == single_worker(source, "safetensors", "local", "x")
        # An object per key: the parts are objects, split by bytes.
        job = c.submit(source, f"s3://{b}/team/fan-auto/cs", to="cs-s3", options={"parallelism": "auto"})
        job = c.wait(job["id"], timeout=300)
    assert job["state"] == "succeeded", job.get("error")
    assert job["result"]["extras"]["parallelism"] == 3
    objects = sorted(o["uri"].rsplit("/", 1)[-1] for o in job["result"]["outputs"])
    single = single_worker(source, "cs-s3", "s3", "cs")
    assert sorted(_sha256s(job)) == sorted(single) and len(objects) == 27
    assert not listing(b, "team/.ckptconv-staging") and _uploads(b) == []


def _slow_service(redis_url: str, bucket: str, s3_server: str, tmp: Path, proxy) -> Service:
    # Every S3 request of the workers delayed by 30 ms: a part of a few hundred tensors (one ranged
    # read each) runs for seconds, long enough to be killed or cancelled in the middle.
    proxy.on_request = lambda *_: time.sleep(0.03)
    return Service(
        redis_url,
        bucket,
        tmp,
        prefixes=[f"s3://{bucket}/team/", f"{tmp}/out/"],
        env={"AWS_ENDPOINT_URL": proxy.url},
        workers=2,
    )


def _part_wrote(svc: Service, job_id: str, index: int) -> None:
    """Wait until part ``index`` of the job's first attempt has written bytes."""
    counters = f"{svc.prefix}fanout:{job_id}:1"
    wait_for(lambda: int(svc.redis.hget(counters, f"bytes:{index}") or 0) > 0, timeout=120)


def _running_part(svc: Service, job_id: str, index: int) -> int:
    """The pid of the worker running part ``index`` of the job's first attempt, once it wrote bytes."""
    _part_wrote(svc, job_id, index)
    pid = _pid(svc.redis.get(f"{svc.prefix}part:{job_id}:1:{index}"))
    assert pid is not None
    return pid


def test_a_part_worker_killed_mid_part_is_redone_and_the_job_commits(
    redis_url: str, bucket: str, s3_server: str, tmp_path: Path
) -> None:
    from bench.faultproxy import FaultProxy

    _checkpoint(bucket, "team/kill-part/model.safetensors", 320, (64, 128))  # 10 MiB in 32 KiB tensors
    source = f"s3://{bucket}/team/kill-part/model.safetensors"
    with FaultProxy(s3_server) as proxy:
        svc = _slow_service(redis_url, bucket, s3_server, tmp_path, proxy)
        try:
            with svc.client() as c:
                job = c.submit(source, f"{tmp_path}/out/two/model.mdl", to="cs-h5", options={"parallelism": 2})
                # The job's own worker runs the last part; the other worker the first one: kill that.
                coordinator = _pid(svc.redis.get(f"{svc.prefix}lease:{job['id']}"))
                victim = _running_part(svc, job["id"], 0)
                assert victim != coordinator and victim in [p.pid for p in svc.procs]
                os.kill(victim, signal.SIGKILL)
                next(p for p in svc.procs if p.pid == victim).wait()
                # Killed mid-part: what is proved from here on needs no slow requests.
                proxy.on_request = None
                svc.start_worker()
                job = c.wait(job["id"], timeout=300)
        finally:
            svc.stop()
    assert job["state"] == "succeeded" and job["attempts"] == 1, job.get("error")
    assert _sha256s(job) == _single_worker_sha256(source, f"{tmp_path}/out/one/model.mdl", "cs-h5")
    assert not (tmp_path / "out" / "two" / ".ckptconv-staging").exists()
    assert not (tmp_path / "out" / ".ckptconv-staging").exists()


def test_cancel_mid_fan_out_leaves_nothing_and_no_upload(
    redis_url: str, bucket: str, s3_server: str, tmp_path: Path
) -> None:
    from bench.faultproxy import FaultProxy

    _checkpoint(bucket, "team/cancel-fan/model.safetensors", 400, (64, 128))  # 12.5 MiB
    with FaultProxy(s3_server) as proxy:
        svc = _slow_service(redis_url, bucket, s3_server, tmp_path, proxy)
        try:
            with svc.client() as c:
                job = c.submit(
                    f"s3://{bucket}/team/cancel-fan/model.safetensors",
                    f"s3://{bucket}/team/cancel-fan-out/model.mdl",
                    to="cs-h5",
                    options={"parallelism": 2},
                )
                # Only that the fan-out is under way matters here, not which worker runs the part (on a
                # loaded machine its lease may already be gone when it is read).
                _part_wrote(svc, job["id"], 0)
                assert _uploads(bucket), "the fan-out should have its multipart upload open by now"
                c.cancel(job["id"])
                job = c.wait(job["id"], timeout=120)
                # The parts stop too: no lease stays behind, nothing is written after the cancel.
                wait_for(lambda: not svc.redis.keys(f"{svc.prefix}part:{job['id']}:*"), timeout=30)
        finally:
            svc.stop()
    assert job["state"] == "cancelled", job
    left = listing(bucket, "team/cancel-fan-out")
    assert set(left) == {"team/cancel-fan-out/model.mdl.ckptconv-job.json"}, left
    assert not listing(bucket, "team/.ckptconv-staging")
    assert _uploads(bucket) == []


def test_duplicate_deliveries_run_nothing_twice_and_publish_once(service: Service, source: str) -> None:
    b = service.bucket
    target = f"s3://{b}/team/dup-fan-out/model.mdl"
    with service.client() as c:
        job = c.submit(source, target, to="cs-h5", options={"parallelism": 3})
        job_key = f"{service.prefix}job:{job['id']}"
        wait_for(lambda: service.redis.exists(f"{service.prefix}fanout:{job['id']}:1"), timeout=120)
        # The broker hands the job's message and every part's message out a second time.
        queue = f"{service.prefix}q:jobs"
        service.redis.lpush(queue, service.redis.hget(job_key, "message"))
        app = make_celery(
            Settings(
                environment="development", redis_url=service.env["CKPTCONV_REDIS_URL"], redis_prefix=service.prefix
            )
        )
        for index in range(3):
            app.send_task("ckptconv.run_part", args=[job["id"], 1, index], queue="jobs")
        job = c.wait(job["id"], timeout=300)
        manifest = boto3.client("s3").head_object(Bucket=b, Key="team/dup-fan-out/model.mdl.manifest.json")
        # A delivery after the end: the job is final, nothing runs, nothing is published again.
        service.redis.lpush(queue, service.redis.hget(job_key, "message"))
        wait_for(lambda: service.redis.llen(queue) == 0, timeout=60)
    assert job["state"] == "succeeded" and job["attempts"] == 1, job.get("error")
    again = boto3.client("s3").head_object(Bucket=b, Key="team/dup-fan-out/model.mdl.manifest.json")
    assert (again["ETag"], again["LastModified"]) == (manifest["ETag"], manifest["LastModified"])
    assert set(listing(b, "team/dup-fan-out")) == {
        "team/dup-fan-out/model.mdl",
        "team/dup-fan-out/model.mdl.manifest.json",
        "team/dup-fan-out/model.mdl.ckptconv-job.json",
    }
    assert not listing(b, "team/.ckptconv-staging") and _uploads(b) == []


# The request at which the job's own worker is killed, by stage: creating the upload (prepare),
# the second part's record (parts: one part recorded, the other written but not recorded),
# completing the upload (commit). The request is held until its sender is dead, then dropped.
KILL_AT = {
    "prepare": lambda method, path: method == "POST" and path.endswith("?uploads"),
    "parts": lambda method, path: method == "PUT" and "/.fanout/part-" in path,
    "commit": lambda method, path: method == "POST" and "uploadId=" in path and "/.ckptconv-staging/" in path,
}


@pytest.mark.parametrize(("stage", "reused"), [("prepare", 0), ("parts", 1), ("commit", 2)])
def test_the_jobs_own_worker_killed_is_taken_over_reusing_the_recorded_parts(
    stage: str, reused: int, redis_url: str, bucket: str, s3_server: str, tmp_path: Path, source: str, single_worker
) -> None:
    """SIGKILL of the worker that prepares and commits a fanned-out job: the next attempt carries on
    the same fan-out (its recorded parts are not run again), commits the single-worker bytes,
    and leaves no staging and no multipart upload behind."""
    import threading

    from bench.faultproxy import FaultProxy

    name = f"takeover-{stage}"  # the source: 24 MiB, 5 upload parts
    target = f"s3://{bucket}/team/{name}-out/two/model.mdl"
    held, release = threading.Event(), threading.Event()
    s3 = boto3.client("s3")
    recorded: list[int] = []

    def hold(method: str, path: str, headers: dict[str, str]) -> None:
        if held.is_set() or f"/team/{name}-out/" not in path or not KILL_AT[stage](method, path):
            return
        if stage == "parts" and not recorded:  # the first part's record goes through
            recorded.append(int(path.rsplit("part-", 1)[1].split(".")[0]))
            return
        held.set()
        release.wait(120)
        raise OSError("dropped: its sender was killed")

    with FaultProxy(s3_server) as proxy:
        proxy.on_request = hold
        svc = Service(
            redis_url,
            bucket,
            tmp_path,
            prefixes=[f"s3://{bucket}/team/"],
            env={"AWS_ENDPOINT_URL": proxy.url},
            workers=2,
        )
        try:
            with svc.client() as c:
                job = c.submit(source, target, to="cs-h5", options={"parallelism": 2})
                assert held.wait(180), f"the job never reached {stage}"
                # Both workers: the job's own one, and the sender of the held request when that is
                # the other (which runs which part depends on message prefetch; on a loaded
                # machine a lapsed lease may have moved the job already).
                for victim in svc.procs[1:]:
                    os.kill(victim.pid, signal.SIGKILL)
                    victim.wait()
                release.set()
                svc.start_worker()
                job = c.wait(job["id"], timeout=300)
                last = svc.redis.hgetall(f"{svc.prefix}fanout:{job['id']}:{job['attempts']}")
        finally:
            release.set()
            svc.stop()
    assert job["state"] == "succeeded" and job["attempts"] >= 2, job.get("error")
    # The last attempt ran exactly the parts no earlier attempt had recorded: at least those
    # recorded at the kill are reused (a redelivered part message of the first attempt may record
    # one more before the takeover).
    ran = sorted(int(k.split(":")[1]) for k in last if k.startswith("bytes:"))
    parts_reused = job["result"]["extras"].get("parts_reused", 0)
    assert parts_reused + len(ran) == 2 and parts_reused >= reused
    assert stage != "prepare" or parts_reused == 0 or job["attempts"] > 2
    assert _sha256s(job) == single_worker(source, "cs-h5", "s3", "model.mdl")
    assert not listing(bucket, "team/.ckptconv-staging") and not listing(bucket, f"team/{name}-out/two/.ckptconv")
    assert not [k for k in listing(bucket, f"team/{name}-out/") if ".ckptconv-staging" in k]
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix=f"team/{name}-out/").get("Uploads", []) == []
