"""The whole service end to end: a real API process (uvicorn), real Celery worker processes, real
Redis, and a real S3 HTTP server (moto). Jobs convert real safetensors checkpoints to Cerebras H5.

Covers: submit -> follow -> checksummed, correct outputs and the mirrored record; a signed webhook
retried after a failure; dry runs and inspections answered by a worker; cancelling a running job;
``kill -9`` of the worker mid-job with a new worker taking over, while the target is watched so that
nothing partial is ever visible there.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
import redis

from bench.ports import free_port
from ckptconv.client import Client
from ckptconv.core.auth import hash_key
from ckptconv.core.errors import Forbidden, ObjectNotFound
from ckptconv.core.webhooks import verify

ROOT = Path(__file__).resolve().parent.parent
FAST = {
    # Short enough that a lost worker is noticed in seconds, not minutes; long enough that a worker
    # starved of CPU on a loaded machine keeps its lease (3 beats = 3 s) and its message (6 s).
    "CKPTCONV_HEARTBEAT_SECONDS": "1",
    "CKPTCONV_VISIBILITY_TIMEOUT_SECONDS": "6",
    "CKPTCONV_REAPER_INTERVAL_SECONDS": "1",
    "CKPTCONV_WEBHOOK_BACKOFF_SECONDS": "0.2",
    "CKPTCONV_WEBHOOK_ALLOW_PRIVATE_NETWORKS": "true",
}


class Service:
    """An API process and worker processes sharing one Redis prefix (their own queues and records)."""

    def __init__(
        self,
        redis_url: str,
        bucket: str,
        tmp: Path,
        prefixes: list[str] | None = None,
        env: dict[str, str] | None = None,
        workers: int = 0,
    ) -> None:
        """``workers`` worker processes start with the API, at once: each process spends seconds on
        its imports (torch above all), and started one after the other they would add up."""
        self.prefix = f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
        self.bucket = bucket
        self.tmp = tmp
        self.key = "ckc_e2e-" + uuid.uuid4().hex
        keys_file = tmp / "keys.yaml"
        allowed = json.dumps(prefixes or [f"s3://{bucket}/team/"])
        keys_file.write_text(f"keys:\n  - name: e2e\n    sha256: {hash_key(self.key)}\n    prefixes: {allowed}\n")
        self.env = {
            **os.environ,
            **FAST,
            "CKPTCONV_ENVIRONMENT": "development",
            "CKPTCONV_REDIS_URL": redis_url,
            "CKPTCONV_REDIS_PREFIX": self.prefix,
            "CKPTCONV_API_KEYS_FILE": str(keys_file),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self.procs: list[subprocess.Popen] = []
        self.url = self.start_api(workers=workers)

    def start_api(self, workers: int = 0, **env: str) -> str:
        """An API process on this Redis prefix (so served by these workers), with settings overridden by
        ``env``, and ``workers`` worker processes started beside it; returns its URL once the API
        answers and the workers are ready."""
        port = free_port()
        proc = self._spawn("api", ["serve", "--port", str(port), "--log-level", "warning"], env)
        url = f"http://127.0.0.1:{port}"
        try:
            started = [self._spawn_worker() for _ in range(workers)]
            self._wait_http(url, proc)
            for worker in started:
                self._wait_ready(worker)
        except BaseException:
            self.stop()
            raise
        return url

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptconv", *args],
            cwd=ROOT,
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def start_worker(self, *options: str) -> subprocess.Popen:
        return self.start_workers(1, *options)[0]

    def start_workers(self, count: int, *options: str) -> list[subprocess.Popen]:
        """``count`` worker processes started at once; returns them when every one is ready."""
        procs = [self._spawn_worker(*options) for _ in range(count)]
        for proc in procs:
            self._wait_ready(proc)
        return procs

    def _spawn_worker(self, *options: str) -> subprocess.Popen:
        return self._spawn("worker", ["worker", "--pool", "solo", "--loglevel", "info", *options])

    def _wait_ready(self, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 60
        while b"ready." not in Path(proc.log_path).read_bytes():  # type: ignore[attr-defined]
            assert proc.poll() is None, Path(proc.log_path).read_text()  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "worker did not start"
            time.sleep(0.1)

    def _wait_http(self, url: str, proc: subprocess.Popen) -> None:
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert proc.poll() is None, Path(proc.log_path).read_text()  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "API did not start"
            time.sleep(0.1)

    def client(self) -> Client:
        return Client(self.url, self.key)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        keys = list(self.redis.scan_iter(match=self.prefix + "*", count=1000))
        for i in range(0, len(keys), 500):
            self.redis.delete(*keys[i : i + 500])


@pytest.fixture(scope="module")
def bucket(s3_server: str) -> str:
    name = f"e2e-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def service(redis_url: str, bucket: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    # Two workers, so that a duplicate delivery would have somewhere to go.
    svc = Service(redis_url, bucket, tmp_path_factory.mktemp("service"), workers=2)
    try:
        yield svc
    finally:
        svc.stop()


def make_checkpoint(bucket: str, key: str, n: int, dim: int = 16) -> dict[str, Any]:
    """Upload a safetensors checkpoint of ``n`` tensors; returns the tensors by name."""
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(n)
    tensors = {f"layers.{i}.weight": torch.randn(dim, dim, generator=g) for i in range(n)}
    tensors["layers.0.bias"] = torch.arange(dim, dtype=torch.int64)
    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=save(tensors))
    return tensors


def listing(bucket: str, prefix: str) -> dict[str, int]:
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def check_outputs(job: dict[str, Any], bucket: str, expected: dict[str, Any], fmt: str = "cs-h5") -> None:
    """Every output is where the result says, with its size and digest, and holds the source's tensors."""

    import torch

    from ckptconv.formats.detect import open_source
    from ckptconv.storage.digests import holds_output

    s3 = boto3.client("s3")
    outputs = job["result"]["outputs"]
    assert outputs
    for o in outputs:
        key = o["uri"].removeprefix(f"s3://{bucket}/")
        assert holds_output(s3.get_object(Bucket=bucket, Key=key)["Body"].read(), o), o
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=job["result"]["manifest"].split("/", 3)[3])["Body"].read())
    assert manifest["job_id"] == job["id"]
    with open_source(job["target"]["uri"], fmt) as src:
        got = {e.key: src.read(e.key) for e in src.entries() if e.kind in ("tensor", "array")}
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


# --- the happy path, with a webhook ------------------------------------------------------------


class _Hooks(http.server.BaseHTTPRequestHandler):
    received: list[tuple[dict[str, str], bytes, int]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        status = 500 if not self.received else 204  # the first delivery fails: it must be retried
        self.received.append(({k.lower(): v for k, v in self.headers.items()}, body, status))
        self.send_response(status)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_submit_follow_and_get_checksummed_outputs_and_a_signed_webhook(service: Service) -> None:
    expected = make_checkpoint(service.bucket, "team/small/model.safetensors", 12)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hooks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    secret = "whsec_dGVzdC1zZWNyZXQtb2YtdGhpcy1ob29r"
    seen: list[dict[str, Any]] = []
    try:
        with service.client() as c:
            job = c.submit(
                f"s3://{service.bucket}/team/small/model.safetensors",
                f"s3://{service.bucket}/team/small-out/model.mdl",
                to="cs-h5",
                labels={"suite": "e2e"},
                webhook={"url": f"http://127.0.0.1:{server.server_port}/hook", "secret": secret},
            )
            assert job["state"] == "queued"
            job = c.wait(job["id"], timeout=120, on_progress=seen.append)
            assert job["state"] == "succeeded", job.get("error")
            assert job["attempts"] == 1 and job["done"] and job["finished_at"] >= job["started_at"]
            check_outputs(job, service.bucket, expected)
            assert {"converting", "verifying"} <= {j["progress"]["stage"] for j in seen if j.get("progress")}

            # The record is mirrored beside the outputs.
            mirror = boto3.client("s3").get_object(
                Bucket=service.bucket, Key="team/small-out/model.mdl.ckptconv-job.json"
            )
            assert json.loads(mirror["Body"].read())["result"] == job["result"]

            wait_for(lambda: len(_Hooks.received) >= 2, timeout=30)
            final = wait_for(lambda: (j := c.get(job["id"]))["webhook"]["delivered_at"] and j, timeout=10)
            assert final["webhook"]["attempts"] == 2 and final["webhook"]["last_status"] == 204
    finally:
        server.shutdown()
    (h1, b1, s1), (h2, b2, s2) = _Hooks.received[:2]
    assert (s1, s2) == (500, 204)
    assert h1["webhook-id"] == h2["webhook-id"]  # one event, two attempts: receivers deduplicate by id
    for headers, body in ((h1, b1), (h2, b2)):
        verify(secret, headers, body)
    event = json.loads(b2)
    assert event["type"] == "job.succeeded" and event["data"]["id"] == job["id"]
    assert event["data"]["result"]["outputs"] == job["result"]["outputs"]

    text = c_metrics = __import__("httpx").get(service.url + "/metrics").text
    assert 'ckptconv_jobs_finished_total{state="succeeded"} 1.0' in c_metrics, text
    assert "ckptconv_bytes_converted_total 0.0" not in text


def test_dry_run_and_inspect_through_a_worker(service: Service) -> None:
    make_checkpoint(service.bucket, "team/plan/model.safetensors", 3)
    with service.client() as c:
        plan = c.plan(
            f"s3://{service.bucket}/team/plan/model.safetensors", f"s3://{service.bucket}/team/plan-out.mdl", to="cs-h5"
        )
        assert plan["ok"] is True and plan["target_format"] == "cs-h5"
        view = c.inspect(f"s3://{service.bucket}/team/plan/model.safetensors")
        assert view["format"] == "safetensors" and view["tensors"] == 4
        with pytest.raises(ObjectNotFound):
            c.inspect(f"s3://{service.bucket}/team/plan/missing.safetensors")
        with pytest.raises(Forbidden):
            c.inspect(f"s3://{service.bucket}/elsewhere/model.safetensors")
    assert not listing(service.bucket, "team/plan-out")  # a dry run writes nothing


def test_a_job_longer_than_the_visibility_timeout_is_delivered_once(
    redis_url: str, bucket: str, s3_server: str, tmp_path: Path
) -> None:
    from bench.faultproxy import FaultProxy

    # Many small tensors, each one ranged S3 read, and every S3 request of the workers delayed by
    # 30 ms: the job outlasts the visibility timeout twice over however fast the machine is.
    make_checkpoint(bucket, "team/long/model.safetensors", 600)
    with FaultProxy(s3_server) as proxy:
        proxy.on_request = lambda *_: time.sleep(0.03)
        # Two workers: one idle, where a second delivery of the message would go.
        svc = Service(redis_url, bucket, tmp_path, env={"AWS_ENDPOINT_URL": proxy.url}, workers=2)
        try:

            def deliveries() -> int:
                lines = [line for p in svc.procs[1:] for line in Path(p.log_path).read_text().splitlines()]
                return sum(1 for line in lines if "ckptconv.run_job[" in line and line.rstrip().endswith("received"))

            with svc.client() as c:
                job = c.submit(
                    f"s3://{bucket}/team/long/model.safetensors", f"s3://{bucket}/team/long-out/model.mdl", to="cs-h5"
                )
                job = c.wait(job["id"], timeout=300)
            assert job["state"] == "succeeded" and job["attempts"] == 1
            ran = (_ms(job["finished_at"]) - _ms(job["started_at"])) / 1000
            assert ran > 2 * float(FAST["CKPTCONV_VISIBILITY_TIMEOUT_SECONDS"]), (
                f"job too short to prove anything ({ran:.1f} s)"
            )
            # The heartbeat kept the broker from handing the message to the idle second worker.
            assert deliveries() == 1
        finally:
            svc.stop()


def _ms(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000


def test_command_line_client_against_the_service(
    service: Service, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptconv.cli.main import main as cli

    make_checkpoint(service.bucket, "team/cli/model.safetensors", 3)
    env = {"CKPTCONV_URL": service.url, "CKPTCONV_API_KEY": service.key}
    # The submission runs in a process of its own, as a user runs it; the commands after it run
    # in this one (the same entry point, without seconds of imports for each).
    source, target = (
        f"s3://{service.bucket}/team/cli/model.safetensors",
        f"s3://{service.bucket}/team/cli-out/model.mdl",
    )
    out = subprocess.run(
        [sys.executable, "-m", "ckptconv", "submit", source, target, "--to", "cs-h5", "--label", "via=cli", "--wait"],
        cwd=ROOT,
        env={**service.env, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "state:    succeeded" in out.stdout
    # A streamed .mdl has a block digest, not a whole-file digest: either is printed, never "None".
    assert re.search(r"blake3(-blocks)?:[0-9a-f]{64}", out.stdout) and "None" not in out.stdout, out.stdout
    assert "converting" in out.stderr  # the progress bar

    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def ckptconv(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = cli(list(args))
        return (rc, *capsys.readouterr())

    listed = json.loads(ckptconv("jobs", "--label", "via=cli", "--json")[1])
    assert len(listed) == 1 and listed[0]["state"] == "succeeded"
    job_id = listed[0]["id"]
    assert json.loads(ckptconv("status", job_id, "--json")[1])["id"] == job_id
    rc, _, err = ckptconv("cancel", job_id)
    assert rc == 2 and "[conflict]" in err
    rc, _, err = ckptconv("status", "job_" + "0" * 32)
    assert rc == 2 and "[not_found]" in err


# --- cancellation --------------------------------------------------------------------------------


def test_cancel_a_running_job_stops_it_and_leaves_nothing(service: Service) -> None:
    make_checkpoint(service.bucket, "team/big/model.safetensors", 300)
    with service.client() as c:
        job = c.submit(
            f"s3://{service.bucket}/team/big/model.safetensors",
            f"s3://{service.bucket}/team/big-out/model.mdl",
            to="cs-h5",
        )
        wait_for(lambda: ((c.get(job["id"]).get("progress") or {}).get("tensors_done") or 0) >= 5, timeout=60)
        cancelled = c.cancel(job["id"])
        assert cancelled["state"] in ("cancelling", "cancelled")
        job = c.wait(job["id"], timeout=60)
    assert job["state"] == "cancelled" and job["error"]["code"] == "cancelled"
    assert job["progress"]["tensors_done"] < job["progress"]["tensors_total"]
    left = {k for k in listing(service.bucket, "team/") if k.startswith(("team/big-out", "team/.ckptconv-staging"))}
    assert left == {"team/big-out/model.mdl.ckptconv-job.json"}, left  # only the record of what happened


# --- a worker killed mid-job, or one that lost its lease -------------------------------------------


@pytest.fixture
def in_process(redis_url: str, bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """Jobs created through the API (in process) under a prefix no worker consumes; the test runs them."""
    from fastapi.testclient import TestClient

    from ckptconv.core.jobstore import JobStore, RedisKeys
    from ckptconv.core.settings import Settings, get_settings
    from service.app import create_app

    monkeypatch.setenv("CKPTCONV_ENVIRONMENT", "development")  # importing worker.tasks builds the Celery app
    get_settings.cache_clear()
    from worker import tasks

    prefix = f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
    settings = Settings(
        environment="development", redis_url=redis_url, redis_prefix=prefix, heartbeat_seconds=0.2, auth_disabled=True
    )
    r = redis.Redis.from_url(redis_url, decode_responses=True)

    def submit(source_key: str, target_key: str) -> str:
        body = {
            "kind": "convert",
            "source": {"uri": f"s3://{bucket}/{source_key}"},
            "target": {"uri": f"s3://{bucket}/{target_key}", "format": "cs-h5"},
        }
        with TestClient(create_app(settings)) as c:
            return c.post("/v1/jobs", json=body).raise_for_status().json()["id"]

    try:
        yield SimpleNamespace(
            settings=settings,
            redis=r,
            store=JobStore(r, RedisKeys(prefix, settings.broker_prefix)),
            submit=submit,
            tasks=tasks,
        )
    finally:
        get_settings.cache_clear()
        keys = list(r.scan_iter(match=prefix + "*", count=1000))
        if keys:
            r.delete(*keys)


def test_a_worker_that_lost_its_lease_stops_and_leaves_the_job_alone(in_process: SimpleNamespace, bucket: str) -> None:
    make_checkpoint(bucket, "team/lease/model.safetensors", 200)
    job_id = in_process.submit("team/lease/model.safetensors", "team/lease-out/model.mdl")
    store, r = in_process.store, in_process.redis
    run = in_process.tasks.JobRun(store, in_process.settings, job_id)

    def progress() -> int:
        return json.loads(r.hget(store.keys.job(job_id), "progress") or "{}").get("tensors_done") or 0

    def steal() -> None:
        wait_for(lambda: progress() >= 5)
        r.set(store.keys.lease(job_id), "another-worker", px=60_000)  # as if this worker had stalled

    thief = threading.Thread(target=steal)
    thief.start()
    run.execute()
    thief.join()
    rec = store.get(job_id)
    assert run.lease_lost.is_set()
    assert rec["state"] == "running" and rec["worker"] == run.token  # left to the new holder
    assert r.get(store.keys.lease(job_id)) == "another-worker"  # not released: it is not ours
    assert not listing(bucket, "team/lease-out") and not listing(bucket, "team/.ckptconv-staging")


def test_a_job_whose_workers_keep_dying_fails_instead_of_looping(in_process: SimpleNamespace, bucket: str) -> None:
    job_id = in_process.submit("team/oom/model.safetensors", "team/oom-out/model.mdl")
    store = in_process.store
    attempts = in_process.settings.max_attempts
    # What `max_attempts` lost workers leave behind: a running job, no live lease.
    assert store.transition(job_id, ("queued",), "running", {"attempts": str(attempts), "started_ms": "1"})[0]
    in_process.tasks.JobRun(store, in_process.settings, job_id).execute()
    rec = store.get(job_id)
    assert rec["state"] == "failed"
    assert json.loads(rec["error"])["code"] == "worker_lost"


def test_a_job_with_an_option_this_worker_does_not_know_fails_and_frees_its_target(
    in_process: SimpleNamespace, bucket: str
) -> None:
    # As a job accepted by a newer API reaches a worker of an earlier version.
    make_checkpoint(bucket, "team/newer/model.safetensors", 4)
    job_id = in_process.submit("team/newer/model.safetensors", "team/newer-out/model.mdl")
    store, r = in_process.store, in_process.redis
    request = json.loads(store.get(job_id)["request"])
    request["options"]["option_of_a_later_version"] = True
    r.hset(store.keys.job(job_id), "request", json.dumps(request))
    target = f"s3://{bucket}/team/newer-out/model.mdl"
    assert r.get(store.keys.target(target)) == job_id
    in_process.tasks.JobRun(store, in_process.settings, job_id).execute()
    rec = store.get(job_id)
    assert rec["state"] == "failed" and json.loads(rec["error"])["code"] == "internal_error"
    assert r.get(store.keys.target(target)) is None  # the target can be submitted again
    assert set(listing(bucket, "team/newer-out")) == {"team/newer-out/model.mdl.ckptconv-job.json"}  # its record
    assert not listing(bucket, "team/.ckptconv-staging")


def test_redis_failing_past_its_retries_puts_the_message_back_and_ends_nothing(
    in_process: SimpleNamespace, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery.exceptions import Reject

    make_checkpoint(bucket, "team/flaky/model.safetensors", 4)
    job_id = in_process.submit("team/flaky/model.safetensors", "team/flaky-out/model.mdl")
    store, tasks = in_process.store, in_process.tasks
    monkeypatch.setattr(tasks, "INFRA_BACKOFF_MAX_SECONDS", 0.05)
    healthy = type(store).transition
    calls = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise redis.ConnectionError("Connection reset by peer")  # what the retries gave up on

    # Redis fails at the job's first change of state after its start: recording its success,
    # once the output is published.
    monkeypatch.setattr(type(store), "transition", broken)
    run = tasks.JobRun(store, in_process.settings, job_id)
    with pytest.raises(Reject) as rejected:
        run.execute()
    assert rejected.value.requeue and calls
    assert store.get(job_id)["state"] == "running"  # nothing acknowledged as done
    assert in_process.redis.get(store.keys.lease(job_id)) is None  # the next delivery may start at once
    s3 = boto3.client("s3")
    published = {
        k: s3.head_object(Bucket=bucket, Key=k)["ETag"] for k in listing(bucket, "team/flaky-out") if "manifest" in k
    }
    assert published  # whole: the manifest is written last

    monkeypatch.setattr(type(store), "transition", healthy)
    tasks.JobRun(store, in_process.settings, job_id).execute()  # the message delivered again
    rec = store.get(job_id)
    assert rec["state"] == "succeeded" and rec["attempts"] == "2", rec.get("error")
    # It took over what the first attempt published instead of converting and publishing again.
    assert {k: s3.head_object(Bucket=bucket, Key=k)["ETag"] for k in published} == published
    assert set(listing(bucket, "team/flaky-out")) == {
        "team/flaky-out/model.mdl",
        "team/flaky-out/model.mdl.manifest.json",
        "team/flaky-out/model.mdl.ckptconv-job.json",
    }
    assert json.loads(rec["result"])["outputs"]


def test_kill_9_mid_job_then_a_new_worker_finishes_it_with_nothing_partial_visible(
    redis_url: str, bucket: str, tmp_path: Path
) -> None:
    svc = Service(redis_url, bucket, tmp_path)
    scratch_dir = tmp_path / "scratch"
    svc.env["CKPTCONV_SCRATCH_DIR"] = str(scratch_dir)  # where workers build H5 files before upload
    try:
        expected = make_checkpoint(bucket, "team/kill/model.safetensors", 200)
        target_key = "team/kill-out/model.mdl"
        snapshots: list[dict[str, int]] = []
        stop = threading.Event()

        def watch() -> None:
            # Samples the target all through the job (both attempts and publication); every sample must
            # show complete objects only. Every 0.2 s: a tighter loop starves the S3 server the workers need.
            while not stop.is_set():
                snapshots.append(listing(bucket, target_key))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        first = svc.start_worker()
        with svc.client() as c:
            job = c.submit(f"s3://{bucket}/team/kill/model.safetensors", f"s3://{bucket}/{target_key}", to="cs-h5")
            wait_for(lambda: ((c.get(job["id"]).get("progress") or {}).get("tensors_done") or 0) >= 20, timeout=60)
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            assert c.get(job["id"])["state"] == "running"  # nobody noticed yet
            (left,) = list(scratch_dir.iterdir())  # the killed worker's partial H5 file
            assert str(first.pid) in left.name
            svc.start_worker()
            assert not left.exists()  # removed by the new worker as it started
            job = c.wait(job["id"], timeout=120)
        stop.set()
        watcher.join()

        assert job["state"] == "succeeded", job.get("error")
        assert job["attempts"] == 2
        check_outputs(job, bucket, expected)
        final = listing(bucket, target_key)
        manifest_key = job["result"]["manifest"].split("/", 3)[3]
        outputs = {o["uri"].split("/", 3)[3]: o["size"] for o in job["result"]["outputs"]}
        for snap in snapshots:
            visible = {k: v for k, v in snap.items() if not k.endswith(".ckptconv-job.json")}
            for key, size in visible.items():
                assert final.get(key) == size, f"partial object visible: {key} ({size} bytes)"
            if manifest_key in visible:
                assert all(k in visible for k in outputs), "manifest visible before its outputs"
        assert any(manifest_key in s for s in snapshots) or manifest_key in final
        assert not listing(bucket, "team/kill-out/.ckptconv-staging") and not listing(bucket, "team/.ckptconv-staging")
        assert list(scratch_dir.iterdir()) == []
    finally:
        svc.stop()


def test_kill_9_mid_upload_leaves_no_multipart_upload_after_the_takeover(
    redis_url: str, bucket: str, tmp_path: Path
) -> None:
    """A safetensors target on S3 streams as a multipart upload from the staging area; the worker
    killed mid-upload never aborts it, so the attempt that takes over must (its parts are storage
    paid for and invisible to listings)."""
    svc = Service(redis_url, bucket, tmp_path, workers=1)
    first = svc.procs[1]
    s3 = boto3.client("s3")

    def uploads() -> list[str]:
        found = s3.list_multipart_uploads(Bucket=bucket, Prefix="team/kill-mpu").get("Uploads", [])
        return [u["Key"] for u in found]

    try:
        expected = make_checkpoint(bucket, "team/kill-mpu/model.safetensors", 120, dim=256)  # 30 MiB: parts
        with svc.client() as c:
            job = c.submit(
                f"s3://{bucket}/team/kill-mpu/model.safetensors",
                f"s3://{bucket}/team/kill-mpu-out/model.safetensors",
                to="safetensors",
            )
            wait_for(uploads, timeout=120, interval=0.02)  # the upload of the first attempt is under way
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            assert uploads()
            svc.start_worker()
            job = c.wait(job["id"], timeout=300)
        assert job["state"] == "succeeded" and job["attempts"] == 2, job.get("error")
        check_outputs(job, bucket, expected, fmt="safetensors")
        assert uploads() == []
        assert not listing(bucket, "team/kill-mpu-out/.ckptconv-staging")
    finally:
        svc.stop()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_hostile_dcp_metadata_is_a_typed_answer_of_the_api(service: Service, tmp_path: Path) -> None:
    # A distributed checkpoint whose .metadata lies (a size of text, chunks that overlap): the
    # interactive worker answers inspect and plan with a typed problem, never a 5xx.
    import pickle

    import torch
    from dcp_writer import grid, save_dcp

    from ckptconv.core.errors import CorruptCheckpoint

    def upload(name: str, edit) -> str:
        d = save_dcp({"w": torch.arange(8.0)}, tmp_path / name, {"w": grid((8,), (4,))})
        meta = pickle.loads((d / ".metadata").read_bytes())  # the test's own file, written by torch above
        edit(meta.state_dict_metadata["w"])
        (d / ".metadata").write_bytes(pickle.dumps(meta))
        for f in d.iterdir():
            boto3.client("s3").upload_file(str(f), service.bucket, f"team/{name}/{f.name}")
        return f"s3://{service.bucket}/team/{name}"

    text_size = upload("dcp-text-size", lambda md: setattr(md, "size", ("8",)))
    overlap = upload("dcp-overlap", lambda md: setattr(md.chunks[2], "offsets", torch.Size([2])))
    with service.client() as c:
        for uri in (text_size, overlap):
            with pytest.raises(CorruptCheckpoint):
                c.inspect(uri)
            with pytest.raises(CorruptCheckpoint):
                c.plan(uri, f"s3://{service.bucket}/team/dcp-out.mdl", to="cs-h5")
