"""Fault suite: the job lifecycle's promises under faults, with real parts only.

A real API process, real Celery worker processes (killed with SIGKILL), real Redis (a private
``redis-server`` with an append-only file, restarted mid-run), a moto S3 server. Short versions of
what ``python -m bench.chaos`` runs at length.

Promises checked: one live job per target (``409 target_taken``; the same job for the same
Idempotency-Key); publication never replaces bytes it did not write; no job is lost, stuck or run
twice when workers die, stall past their lease, get the same message twice, or Redis restarts;
a stale attempt changes nothing; a deadline leaves nothing at the target without its manifest.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import boto3
import httpx
import pytest
import redis
import test_e2e_service as e2e
from conftest import PrivateRedis
from killed_copy import Killed, killed_after_the_first_file, killed_at_the_second_part, lower_copy_threshold
from test_e2e_service import Service, check_outputs, listing, make_checkpoint, wait_for

from bench.faultproxy import FaultProxy
from ckptconv.core.errors import Conflict, TargetExists
from ckptconv.engine.convert import convert
from ckptconv.storage import open_storage

# The e2e module's fixtures: a bucket on the session's S3 server; jobs run in this process.
bucket = e2e.bucket
in_process = e2e.in_process


@pytest.fixture(scope="module")
def api(redis_url: str, s3_server: str, tmp_path_factory: pytest.TempPathFactory):
    """An API process with no worker: submitted jobs stay queued (their bucket need not exist)."""
    svc = Service(redis_url, "faults-api", tmp_path_factory.mktemp("api"))
    try:
        yield svc
    finally:
        svc.stop()


# --- one target, one job ------------------------------------------------------------------------


def _submit(svc: Service, target: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {svc.key}"}
    if key:
        headers["Idempotency-Key"] = key
    body = {
        "kind": "convert",
        "source": {"uri": f"s3://{svc.bucket}/team/in/model.safetensors"},
        "target": {"uri": target, "format": "cs-h5"},
    }
    return httpx.post(svc.url + "/v1/jobs", json=body, headers=headers, timeout=30)


def test_concurrent_submissions_to_one_target_make_exactly_one_job(api: Service) -> None:
    target = f"s3://{api.bucket}/team/race-{uuid.uuid4().hex[:6]}/model.mdl"
    # 32 requests at once: 16 Idempotency-Keys, each sent twice; and the target spelled two ways.
    run = uuid.uuid4().hex[:6]
    calls = [(target + ("/" if (i // 2) % 3 == 0 else ""), f"race-{run}-{i // 2}") for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(lambda c: _submit(api, *c), calls))
    accepted = [r for r in responses if r.status_code == 202]
    refused = [r for r in responses if r.status_code == 409]
    assert len(accepted) + len(refused) == len(responses), [r.status_code for r in responses]
    assert {r.json()["id"] for r in accepted} and len({r.json()["id"] for r in accepted}) == 1
    winner_key = next(c[1] for c, r in zip(calls, responses, strict=True) if r.status_code == 202)
    # Only the winner's Idempotency-Key may be accepted twice (the replay of the same job).
    assert {c[1] for c, r in zip(calls, responses, strict=True) if r.status_code == 202} == {winner_key}
    assert all(r.json()["code"] == "target_taken" for r in refused)
    assert all(r.headers["content-type"].startswith("application/problem+json") for r in refused)

    # Released on a final state: cancel the queued job, then the target can be submitted again.
    job_id = accepted[0].json()["id"]
    auth = {"Authorization": f"Bearer {api.key}"}
    assert httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel", headers=auth).json()["state"] == "cancelled"
    again = _submit(api, target)
    assert again.status_code == 202 and again.json()["id"] != job_id
    assert _submit(api, target).json()["code"] == "target_taken"


def test_distinct_targets_are_not_reserved_together(api: Service) -> None:
    base = f"s3://{api.bucket}/team/apart-{uuid.uuid4().hex[:6]}"
    assert _submit(api, base + "/a.mdl").status_code == 202
    assert _submit(api, base + "/b.mdl").status_code == 202
    assert _submit(api, base + "/a.mdl2").status_code == 202


def test_a_burst_to_one_target_shares_one_existence_check(api: Service, s3_server: str) -> None:
    # Each S3 request is held 2 s at the proxy: the burst arrives while the first check is under way.
    with FaultProxy(s3_server, delay_s=2.0) as proxy:
        url = api.start_api(AWS_ENDPOINT_URL=proxy.url, CKPTCONV_TARGET_CHECK_TIMEOUT_SECONDS="60")
        svc = SimpleNamespace(url=url, key=api.key, bucket=api.bucket)
        target = f"s3://{api.bucket}/team/burst-{uuid.uuid4().hex[:6]}/model.mdl"
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(lambda _: _submit(svc, target), range(16)))
    assert sorted(r.status_code for r in responses) == [202] + [409] * 15, [r.text for r in responses]
    # A check is a HEAD and a listing: one check per submission would have been 32 requests.
    assert 2 <= proxy.requests <= 8, proxy.requests


def test_an_existing_file_target_is_refused_at_submit(api: Service, s3_server: str) -> None:
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket=api.bucket)
    key = f"team/exists-{uuid.uuid4().hex[:6]}/model.mdl"
    s3.put_object(Bucket=api.bucket, Key=key, Body=b"earlier bytes")
    refused = _submit(api, f"s3://{api.bucket}/{key}")
    assert refused.status_code == 409 and refused.headers["content-type"].startswith("application/problem+json")
    body = refused.json()
    assert body["code"] == "target_taken" and body["status"] == 409
    assert body["type"] == "https://ckptconv.dev/problems/target_taken" and body["title"]
    assert body["detail"] == f"s3://{api.bucket}/{key} already exists" and "overwrite" in body["hint"]
    assert body["details"] == {"uri": f"s3://{api.bucket}/{key}"}
    assert s3.get_object(Bucket=api.bucket, Key=key)["Body"].read() == b"earlier bytes"
    # Nothing was reserved: the same target is refused for its bytes, and a free one is accepted.
    assert _submit(api, f"s3://{api.bucket}/{key}").json()["code"] == "target_taken"
    assert _submit(api, f"s3://{api.bucket}/{key}.new").status_code == 202


def test_an_existing_directory_or_bundle_target_is_refused_at_submit(api: Service, s3_server: str) -> None:
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket=api.bucket)
    base = f"team/dir-{uuid.uuid4().hex[:6]}"
    s3.put_object(Bucket=api.bucket, Key=f"{base}/out/__METADATA__", Body=b"{}")  # objects under the target
    s3.put_object(Bucket=api.bucket, Key=f"{base}/tf/model.index", Body=b"")  # a TF bundle named by its prefix
    auth = {"Authorization": f"Bearer {api.key}"}

    def submit(target: str, fmt: str) -> httpx.Response:
        body = {
            "kind": "convert",
            "source": {"uri": f"s3://{api.bucket}/team/in/model.safetensors"},
            "target": {"uri": target, "format": fmt},
        }
        return httpx.post(api.url + "/v1/jobs", json=body, headers=auth, timeout=30)

    for target, fmt in ((f"{base}/out", "cs-s3"), (f"{base}/out/", "cs-s3"), (f"{base}/tf/model", "tf")):
        refused = submit(f"s3://{api.bucket}/{target}", fmt)
        assert refused.status_code == 409 and refused.json()["code"] == "target_taken", (target, refused.text)
    assert submit(f"s3://{api.bucket}/{base}/other", "cs-s3").status_code == 202


def _submit_is_a_503(api: Service, endpoint: str, target_key: str) -> str:
    """Through an API process whose object store is ``endpoint`` (its target check bounded to 2 s),
    a submission is a 503 storage_unavailable with Retry-After; the API's URL."""
    url = api.start_api(AWS_ENDPOINT_URL=endpoint, CKPTCONV_TARGET_CHECK_TIMEOUT_SECONDS="2")
    r = httpx.post(
        url + "/v1/jobs",
        json={
            "kind": "convert",
            "source": {"uri": f"s3://{api.bucket}/team/in/model.safetensors"},
            "target": {"uri": f"s3://{api.bucket}/{target_key}", "format": "cs-h5"},
        },
        headers={"Authorization": f"Bearer {api.key}"},
        timeout=30,
    )
    assert r.status_code == 503 and r.json()["code"] == "storage_unavailable", r.text
    assert int(r.headers["retry-after"]) > 0 and r.json()["correlation_id"]
    return url


def test_an_unreachable_object_store_at_submit_is_a_503_with_retry_after(api: Service) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    url = _submit_is_a_503(api, dead, "team/unreachable/model.mdl")

    # A retry of a submission that did make a job gets that job back, outage or not.
    body = {
        "kind": "convert",
        "source": {"uri": f"s3://{api.bucket}/team/in/model.safetensors"},
        "target": {"uri": f"s3://{api.bucket}/team/made-before/model.mdl", "format": "cs-h5"},
    }
    headers = {"Authorization": f"Bearer {api.key}", "Idempotency-Key": f"outage-{uuid.uuid4().hex[:8]}"}
    made = httpx.post(api.url + "/v1/jobs", json=body, headers=headers, timeout=30)
    assert made.status_code == 202, made.text
    again = httpx.post(url + "/v1/jobs", json=body, headers=headers, timeout=30)
    assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true", again.text
    assert again.json()["id"] == made.json()["id"]


def test_an_object_store_that_never_answers_at_submit_is_a_503_within_the_check_timeout(api: Service) -> None:
    # It takes the connection and sends nothing: the target check gives up at its timeout instead
    # of holding the submission for the store's own timeouts and retries.
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        stalled.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(stalled.accept()[0])

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        _submit_is_a_503(api, f"http://127.0.0.1:{stalled.getsockname()[1]}", "team/stalled/model.mdl")
        assert held  # the store was reached, and never answered
    finally:
        stop.set()
        acceptor.join()
        for conn in held:
            conn.close()
        stalled.close()


# --- publication never replaces bytes it did not write -----------------------------------------


def _writes_into_target_mid_run(storage_uri: str):
    """A progress callback that, once, puts foreign bytes where the conversion will publish."""
    done = []

    def progress(_p) -> None:
        if not done:
            done.append(True)
            open_storage(storage_uri).write_bytes(storage_uri, b"someone else's bytes")

    return progress


@pytest.mark.parametrize("where", ["local", "s3"])
def test_publication_never_replaces_bytes_it_did_not_write(where: str, tmp_path: Path, s3_bucket: str) -> None:
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "in.safetensors"
    save_file({f"w{i}": torch.full((8,), float(i)) for i in range(4)}, str(src))
    base = str(tmp_path / "out") if where == "local" else f"s3://{s3_bucket}/team/foreign-{uuid.uuid4().hex[:6]}"
    target = base + "/model"
    foreign = target + "/model.safetensors"
    with pytest.raises(TargetExists):
        convert(str(src), target, to="safetensors", job_id="job-a", progress=_writes_into_target_mid_run(foreign))
    storage = open_storage(foreign)
    assert storage.read_all(foreign) == b"someone else's bytes"
    left = sorted(i.uri for i in storage.list(base + "/"))
    assert left == [foreign], left  # nothing else published, nothing left in staging


def test_an_existing_target_fails_the_job_with_a_typed_error_and_keeps_its_bytes(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "in.safetensors"
    save_file({"w": torch.ones(4)}, str(src))
    target = tmp_path / "out.mdl"
    target.write_bytes(b"precious")
    with pytest.raises(TargetExists):
        convert(str(src), str(target), to="cs-h5", job_id="job-b")
    assert target.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors", "out.mdl"]


# --- leases, fencing, duplicate delivery, the reaper ---------------------------------------------


def _progress(store, job_id: str) -> int:
    return json.loads(store.r.hget(store.keys.job(job_id), "progress") or "{}").get("tensors_done") or 0


def _run_in_thread(run) -> threading.Thread:
    t = threading.Thread(target=run.execute)
    t.start()
    return t


def test_a_lapsed_lease_nobody_else_took_is_taken_again(in_process: SimpleNamespace, bucket: str) -> None:
    make_checkpoint(bucket, "team/lapse/model.safetensors", 150)
    job_id = in_process.submit("team/lapse/model.safetensors", "team/lapse-out/model.mdl")
    store = in_process.store
    run = in_process.tasks.JobRun(store, in_process.settings, job_id)
    t = _run_in_thread(run)
    wait_for(lambda: _progress(store, job_id) >= 5)
    store.r.delete(store.keys.lease(job_id))  # as if Redis had been away longer than the lease
    t.join()
    rec = store.get(job_id)
    assert not run.lease_lost.is_set()
    assert rec["state"] == "succeeded" and rec["attempts"] == "1", rec.get("error")
    assert listing(bucket, "team/lapse-out/model.mdl")


def test_a_stale_attempt_records_nothing_and_publishes_nothing(in_process: SimpleNamespace, bucket: str) -> None:
    make_checkpoint(bucket, "team/stale/model.safetensors", 150)
    job_id = in_process.submit("team/stale/model.safetensors", "team/stale-out/model.mdl")
    store = in_process.store
    run = in_process.tasks.JobRun(store, in_process.settings, job_id)
    t = _run_in_thread(run)
    wait_for(lambda: _progress(store, job_id) >= 5)
    # Another worker took over: it started attempt 2 and holds the lease.
    store.r.hset(store.keys.job(job_id), "attempts", "2")
    store.r.set(store.keys.lease(job_id), "the-new-owner", px=60_000)
    t.join()
    assert run.lease_lost.is_set()
    # The stale attempt cannot record an outcome over the new owner's run, nor report progress.
    run._finish("failed", {"error": {"code": "internal_error"}})
    assert not store.transition(job_id, ("running",), "failed", attempt=1)[0]
    before = store.r.hget(store.keys.job(job_id), "progress")
    run._progress({"stage": "converting", "tensors_done": 999, "bytes_done": 0, "bytes_total": 0})
    assert store.r.hget(store.keys.job(job_id), "progress") == before
    rec = store.get(job_id)
    assert rec["state"] == "running" and rec["attempts"] == "2"
    assert not listing(bucket, "team/stale-out") and not listing(bucket, "team/.ckptconv-staging")
    # The current attempt can.
    assert store.transition(job_id, ("running",), "failed", {"error": {"code": "x"}}, attempt=2)[0]
    assert store.r.get(store.keys.target(rec_target(rec))) is None  # reservation released


def test_a_stale_simulate_attempt_writes_no_checkpoint_over_the_new_owners_run(
    in_process: SimpleNamespace, tmp_path: Path
) -> None:
    """Trainer checkpoints are fenced like a conversion's publication: staged under the attempt,
    published create-only while the attempt still owns the job."""
    from fastapi.testclient import TestClient
    from test_simulator_trainer import config

    from service.app import create_app

    model_dir = tmp_path / "model"
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps(config(checkpoint={"steps": 2}, max_steps=40)))
    body = {"kind": "simulate", "source": {"uri": str(params)}, "options": {"model_dir": str(model_dir)}}
    with TestClient(create_app(in_process.settings)) as c:
        job_id = c.post("/v1/jobs", json=body).raise_for_status().json()["id"]
    store = in_process.store
    # A worker whose heartbeat never comes: only the fence can tell it that it lost the job.
    deaf = in_process.settings.model_copy(update={"heartbeat_seconds": 3600})
    stale = in_process.tasks.JobRun(store, deaf, job_id)
    t = _run_in_thread(stale)
    wait_for(lambda: any(model_dir.glob("*.mdl")), timeout=120)
    store.r.hset(store.keys.job(job_id), "attempts", "2")
    store.r.set(store.keys.lease(job_id), "the-new-owner", px=60_000)
    before_takeover = {p.name for p in model_dir.glob("*.mdl")}
    t.join(timeout=120)
    assert not t.is_alive() and stale.lease_lost.is_set()
    left = {p.name: p.read_bytes() for p in model_dir.glob("*.mdl")}
    # At most the one save that passed its fence just before the takeover; the run stopped there.
    assert len(set(left) - before_takeover) <= 1, sorted(set(left) - before_takeover)
    assert store.get(job_id)["state"] == "running"

    # The new owner died at once too; the next attempt resumes from the latest checkpoint.
    store.r.delete(store.keys.lease(job_id))
    in_process.tasks.JobRun(store, in_process.settings, job_id).execute()
    rec = store.get(job_id)
    assert rec["state"] == "succeeded" and rec["attempts"] == "3", rec.get("error")
    result = json.loads(rec["result"])
    assert result["global_step"] == 40 and result["start_step"] == max(int(n[11:-4]) for n in left)
    for name, data in left.items():
        assert (model_dir / name).read_bytes() == data, f"{name} was written over"
    assert not (model_dir / ".ckptconv-staging").exists()
    assert not [p for p in model_dir.rglob("*") if p.name.endswith(".tmp")]


def rec_target(rec: dict[str, str]) -> str:
    return json.loads(rec["request"])["target"]["uri"]


def test_the_reaper_requeues_a_job_with_no_owner_and_no_message(in_process: SimpleNamespace, bucket: str) -> None:
    from worker.reaper import Reaper

    make_checkpoint(bucket, "team/orphan/model.safetensors", 3)
    job_id = in_process.submit("team/orphan/model.safetensors", "team/orphan-out/model.mdl")
    store, settings = in_process.store, in_process.settings
    settings = settings.model_copy(update={"visibility_timeout_seconds": 1.0, "reaper_interval_seconds": 0.2})
    queue = store.keys.queue(settings.jobs_queue)
    # What a lost message leaves: attempt 1 ran, its worker died, its message was acknowledged.
    assert store.start_attempt(job_id, "dead-worker", 0.05, settings.max_attempts)[0] == "started"
    store.r.delete(queue)
    reaper = Reaper(store, settings)
    assert wait_for(lambda: reaper.run_once()["requeued"], timeout=30) == [job_id]
    assert store.r.llen(queue) == 1
    assert reaper.run_once()["requeued"] == []  # its message is queued now: nothing to do

    # The requeued message runs the job to the end (attempt 2).
    in_process.tasks.JobRun(store, settings, job_id).execute()
    rec = store.get(job_id)
    assert rec["state"] == "succeeded" and rec["attempts"] == "2", rec.get("error")


def test_past_the_attempt_budget_the_reaped_job_fails_with_worker_lost(
    in_process: SimpleNamespace, bucket: str
) -> None:
    from worker.reaper import Reaper

    job_id = in_process.submit("team/budget/model.safetensors", "team/budget-out/model.mdl")
    store = in_process.store
    settings = in_process.settings.model_copy(
        update={"visibility_timeout_seconds": 1.0, "reaper_interval_seconds": 0.2, "max_attempts": 1}
    )
    store.r.delete(store.keys.queue(settings.jobs_queue))
    assert store.start_attempt(job_id, "dead-worker", 0.05, 1)[0] == "started"
    reaper = Reaper(store, settings)
    wait_for(lambda: reaper.run_once()["requeued"], timeout=30)
    in_process.tasks.JobRun(store, settings, job_id).execute()
    rec = store.get(job_id)
    assert rec["state"] == "failed" and json.loads(rec["error"])["code"] == "worker_lost"


def _killed_mid_part_copy(in_process: SimpleNamespace, bucket: str, name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A job whose worker was killed while publication copied its output in parts: its attempt
    left the staged output and an unfinished multipart upload at the output's final key. Returns
    the job id."""
    make_checkpoint(bucket, f"team/{name}/model.safetensors", 3, dim=1024)  # 12 MiB
    job_id = in_process.submit(f"team/{name}/model.safetensors", f"team/{name}-out/model.mdl")
    lower_copy_threshold(bucket, monkeypatch)  # the output is copied in three parts
    with killed_at_the_second_part(bucket):
        in_process.tasks.JobRun(in_process.store, in_process.settings, job_id).execute()
    assert _uploads(bucket, f"team/{name}-out/") == [f"team/{name}-out/model.mdl"]
    return job_id


def _uploads(bucket: str, prefix: str) -> list[str]:
    found = boto3.client("s3").list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    return sorted(u["Key"] for u in found)


def test_a_job_cancelled_after_its_publication_was_killed_mid_part_copy_leaves_no_upload(
    in_process: SimpleNamespace, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app

    job_id = _killed_mid_part_copy(in_process, bucket, "killed-cancel", monkeypatch)
    # An upload of another key with the same beginning (another writer's) is not this job's.
    other = open_storage(f"s3://{bucket}/").open_writer(
        f"s3://{bucket}/team/killed-cancel-out/model.mdl.part", part_size=5 << 20
    )
    other.write(bytes(5 << 20) + b"x")
    try:
        with TestClient(create_app(in_process.settings)) as c:
            assert c.post(f"/v1/jobs/{job_id}/cancel").raise_for_status().json()["state"] == "cancelling"
        in_process.tasks.JobRun(in_process.store, in_process.settings, job_id).execute()  # the next delivery
        assert in_process.store.get(job_id)["state"] == "cancelled"
        assert _uploads(bucket, "team/killed-cancel-out/") == ["team/killed-cancel-out/model.mdl.part"]
        assert list(listing(bucket, "team/killed-cancel-out")) == ["team/killed-cancel-out/model.mdl.ckptconv-job.json"]
    finally:
        other.abort()


def test_a_job_failed_after_its_publication_was_killed_mid_part_copy_leaves_no_upload(
    in_process: SimpleNamespace, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = _killed_mid_part_copy(in_process, bucket, "killed-fail", monkeypatch)
    # Its attempts exhausted (the reaper queues the job again; the worker that receives it fails it).
    settings = in_process.settings.model_copy(update={"max_attempts": 1})
    in_process.tasks.JobRun(in_process.store, settings, job_id).execute()
    rec = in_process.store.get(job_id)
    assert rec["state"] == "failed" and json.loads(rec["error"])["code"] == "worker_lost"
    assert _uploads(bucket, "team/killed-fail-out/") == []
    assert list(listing(bucket, "team/killed-fail-out")) == ["team/killed-fail-out/model.mdl.ckptconv-job.json"]


@pytest.mark.parametrize("ending", ["cancelled", "failed"])
def test_a_job_ending_after_its_publication_was_killed_before_the_manifest_leaves_no_file(
    in_process: SimpleNamespace, bucket: str, ending: str
) -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app

    name = f"killed-placed-{ending}"
    make_checkpoint(bucket, f"team/{name}/model.safetensors", 2)
    job_id = in_process.submit(f"team/{name}/model.safetensors", f"team/{name}-out/model.mdl")
    with killed_after_the_first_file(f"s3://{bucket}/"):
        in_process.tasks.JobRun(in_process.store, in_process.settings, job_id).execute()
    mirror = f"team/{name}-out/model.mdl.ckptconv-job.json"
    assert f"team/{name}-out/model.mdl" in list(listing(bucket, f"team/{name}-out"))  # the data file, no manifest
    settings = in_process.settings
    if ending == "cancelled":
        with TestClient(create_app(settings)) as c:
            assert c.post(f"/v1/jobs/{job_id}/cancel").raise_for_status().json()["state"] == "cancelling"
    else:  # its attempts exhausted: the worker that receives it again fails it
        settings = settings.model_copy(update={"max_attempts": 1})
    in_process.tasks.JobRun(in_process.store, settings, job_id).execute()
    assert in_process.store.get(job_id)["state"] == ending
    assert list(listing(bucket, f"team/{name}-out")) == [mirror]


@pytest.mark.parametrize("ending", ["cancelled", "failed"])
def test_a_job_ending_after_its_publication_finished_succeeds_with_its_output(
    in_process: SimpleNamespace, bucket: str, ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker was killed once the manifest was placed, before it recorded the job succeeded; then
    # the job was cancelled (or its attempts ran out). Its output is complete and described: the job
    # succeeds with it, never ends cancelled (or failed) with the output at the target.
    from fastapi.testclient import TestClient

    from service.app import create_app

    name = f"published-{ending}"
    make_checkpoint(bucket, f"team/{name}/model.safetensors", 2)
    job_id = in_process.submit(f"team/{name}/model.safetensors", f"team/{name}-out/model.mdl")
    finish = in_process.tasks.JobRun._finish

    def killed_before_recording_success(self, state: str, *args, **kwargs) -> None:
        if state == "succeeded":
            raise Killed
        finish(self, state, *args, **kwargs)

    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(in_process.tasks.JobRun, "_finish", killed_before_recording_success)
        in_process.tasks.JobRun(in_process.store, in_process.settings, job_id).execute()
    published = sorted(listing(bucket, f"team/{name}-out"))
    assert f"team/{name}-out/model.mdl" in published and f"team/{name}-out/model.mdl.manifest.json" in published
    settings = in_process.settings
    if ending == "cancelled":
        with TestClient(create_app(settings)) as c:
            assert c.post(f"/v1/jobs/{job_id}/cancel").raise_for_status().json()["state"] == "cancelling"
    else:  # its attempts exhausted: the worker that receives it again would fail it
        settings = settings.model_copy(update={"max_attempts": 1})
    in_process.tasks.JobRun(in_process.store, settings, job_id).execute()
    rec = in_process.store.get(job_id)
    assert rec["state"] == "succeeded", rec.get("error")
    assert json.loads(rec["result"])["manifest"] == f"s3://{bucket}/team/{name}-out/model.mdl.manifest.json"
    mirror = f"team/{name}-out/model.mdl.ckptconv-job.json"
    assert sorted(listing(bucket, f"team/{name}-out")) == sorted([*published, mirror])


def test_a_takeover_failing_before_publication_leaves_no_upload_of_the_killed_one(
    in_process: SimpleNamespace, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = _killed_mid_part_copy(in_process, bucket, "killed-takeover", monkeypatch)
    # The next attempt fails before it finds the staged output to publish: the source is unreadable now.
    boto3.client("s3").put_object(Bucket=bucket, Key="team/killed-takeover/model.safetensors", Body=b"not a checkpoint")
    in_process.tasks.JobRun(in_process.store, in_process.settings, job_id).execute()
    assert in_process.store.get(job_id)["state"] == "failed"
    assert _uploads(bucket, "team/killed-takeover-out/") == []
    mirror = "team/killed-takeover-out/model.mdl.ckptconv-job.json"
    assert list(listing(bucket, "team/killed-takeover-out")) == [mirror]


def test_a_stale_attempt_that_fails_leaves_the_staging_of_the_attempt_that_took_over(
    in_process: SimpleNamespace, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptconv.core.errors import StorageError

    job_id = in_process.submit("team/stale-fail/model.safetensors", "team/stale-fail-out/model.mdl")
    store = in_process.store
    newer = f"team/stale-fail-out/.ckptconv-staging/{job_id}/2/model.mdl"

    def taken_over_then_failing(ctx: object) -> dict:
        # Another worker took the job over (attempt 2, its lease) and staged its output meanwhile.
        store.r.hset(store.keys.job(job_id), "attempts", "2")
        store.r.set(store.keys.lease(job_id), "another-worker", px=60_000)
        boto3.client("s3").put_object(Bucket=bucket, Key=newer, Body=b"attempt 2's output")
        raise StorageError("S3 request failed: reset")

    monkeypatch.setattr("ckptconv.jobs.convert.run", taken_over_then_failing)
    in_process.tasks.JobRun(store, in_process.settings, job_id).execute()
    assert store.get(job_id)["state"] == "running"  # attempt 2's to finish
    assert newer in listing(bucket, "team/stale-fail-out/")


class _ReplyDropper(threading.Thread):
    """A loopback TCP proxy to Redis, in a thread, that once armed closes the client's connection
    instead of relaying the next reply: Redis ran the command, the client sees a dropped connection."""

    def __init__(self, upstream: str) -> None:
        super().__init__(daemon=True)
        where = redis.connection.parse_url(upstream)
        self.upstream = (where.get("host", "127.0.0.1"), int(where.get("port", 6379)))
        self.armed = threading.Event()
        self.dropped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/{where.get('db', 0)}"

    def run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.upstream)
                threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
                threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if replies and self.armed.is_set():
                    self.armed.clear()
                    self.dropped += 1
                    break
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def test_a_worker_records_its_job_across_a_dropped_redis_connection(
    in_process: SimpleNamespace, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker's own Redis client (worker.celery_app.store) loses its connection as the job's
    # success is recorded (Redis ran it; the reply is lost). The command is sent again under the
    # API's retry policy: the job ends succeeded in this attempt, its webhook sent once, and its
    # message is not put back in the queue (a requeue runs the job's delivery again).
    from ckptconv.core.jobstore import JobStore
    from worker import celery_app

    make_checkpoint(bucket, "team/redis-drop/model.safetensors", 2)
    job_id = in_process.submit("team/redis-drop/model.safetensors", "team/redis-drop-out/model.mdl")
    key = in_process.store.keys.job(job_id)
    request = json.loads(in_process.redis.hget(key, "request"))
    in_process.redis.hset(key, "request", json.dumps({**request, "webhook": {"url": "https://hooks.example/x"}}))
    proxy = _ReplyDropper(in_process.settings.redis_url)
    proxy.start()
    settings = in_process.settings.model_copy(update={"redis_url": proxy.url, "heartbeat_seconds": 60.0})
    monkeypatch.setattr(celery_app, "settings", lambda: settings)
    monkeypatch.setattr(celery_app, "_store", None)
    webhooks: list[object] = []
    monkeypatch.setattr(in_process.tasks.deliver_webhook, "apply_async", lambda **kw: webhooks.append(kw))
    worker_store = JobStore(celery_app.store().r, in_process.store.keys)
    transition = JobStore.transition

    def reply_lost(self: JobStore, *args: object, **kwargs: object) -> tuple[bool, str]:
        proxy.armed.set()
        return transition(self, *args, **kwargs)

    monkeypatch.setattr(JobStore, "transition", reply_lost)
    try:
        in_process.tasks.JobRun(worker_store, settings, job_id).execute()
    finally:
        proxy.close()
        celery_app.store().r.close()
    assert proxy.dropped == 1
    rec = in_process.store.get(job_id)
    assert rec["state"] == "succeeded" and rec["attempts"] == "1", rec
    assert len(webhooks) == 1


def test_an_attempt_started_again_after_its_reply_was_lost_is_the_same_attempt(in_process: SimpleNamespace) -> None:
    # The retry policy sends the start again when its reply was lost: the same worker's call must
    # answer the attempt it started, not count a second one (attempts are the fence and the budget).
    job_id = in_process.submit("team/start-again/model.safetensors", "team/start-again-out/model.mdl")
    store = in_process.store
    assert store.start_attempt(job_id, "worker-a", 30, 3) == ["started", "1", "queued"]
    assert store.start_attempt(job_id, "worker-a", 30, 3)[:2] == ["started", "1"]
    assert store.start_attempt(job_id, "worker-b", 30, 3) == ["held", "worker-a"]
    assert store.get(job_id)["attempts"] == "1"


# --- real workers: duplicate delivery, Redis restarted, time limits ------------------------------


@pytest.fixture(scope="module")
def service(redis_url: str, bucket: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service(redis_url, bucket, tmp_path_factory.mktemp("faults"), workers=2)
    try:
        yield svc
    finally:
        svc.stop()


def _worker_logs(svc: Service) -> str:
    return "".join(Path(p.log_path).read_text() for p in svc.procs[1:])


def test_one_message_delivered_to_two_workers_runs_the_job_once(service: Service) -> None:
    expected = make_checkpoint(service.bucket, "team/dup/model.safetensors", 150)
    with service.client() as c:
        job = c.submit(
            f"s3://{service.bucket}/team/dup/model.safetensors",
            f"s3://{service.bucket}/team/dup-out/model.mdl",
            to="cs-h5",
        )
        job_key = f"{service.prefix}job:{job['id']}"
        wait_for(lambda: (c.get(job["id"]).get("progress") or {}).get("tensors_done"), timeout=120)
        # The broker hands the same message out a second time while the first worker runs it.
        service.redis.lpush(f"{service.prefix}q:jobs", service.redis.hget(job_key, "message"))
        job = c.wait(job["id"], timeout=180)
    assert job["state"] == "succeeded" and job["attempts"] == 1, job.get("error")
    check_outputs(job, service.bucket, expected)
    wait_for(lambda: "dropping this duplicate delivery" in _worker_logs(service), timeout=30)
    assert not listing(service.bucket, "team/.ckptconv-staging")


def test_the_job_deadline_fires_first_and_leaves_nothing_at_the_target(service: Service) -> None:
    # Ten times what one machine converted in 2 s: the job ends at its deadline whatever the speed
    # of the machine (600 tensors finished within 2 s on a fast one), and the test takes no longer.
    make_checkpoint(service.bucket, "team/slow/model.safetensors", 6000)
    with service.client() as c:
        job = c.submit(
            f"s3://{service.bucket}/team/slow/model.safetensors",
            f"s3://{service.bucket}/team/slow-out/model.mdl",
            to="cs-h5",
            max_runtime_seconds=2,
        )
        job = c.wait(job["id"], timeout=180)
    assert job["state"] == "failed" and job["error"]["code"] == "time_limit_exceeded", job
    left = listing(service.bucket, "team/slow-out")
    assert set(left) <= {"team/slow-out/model.mdl.ckptconv-job.json"}, left
    assert not listing(service.bucket, "team/.ckptconv-staging")


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    (tmp_path / "redis").mkdir()
    server = PrivateRedis(tmp_path / "redis", aof=True)
    try:
        yield server
    finally:
        server.stop()


def test_redis_restarted_mid_job_with_aof_loses_nothing(
    aof_redis: SimpleNamespace, bucket: str, tmp_path: Path
) -> None:
    svc = Service(aof_redis.url, bucket, tmp_path, workers=1)
    try:
        expected = make_checkpoint(bucket, "team/restart/model.safetensors", 200)
        with svc.client() as c:
            job = c.submit(
                f"s3://{bucket}/team/restart/model.safetensors", f"s3://{bucket}/team/restart-out/model.mdl", to="cs-h5"
            )
            queued = c.submit(
                f"s3://{bucket}/team/restart/model.safetensors", f"s3://{bucket}/team/restart-q/model.mdl", to="cs-h5"
            )
            wait_for(lambda: ((c.get(job["id"]).get("progress") or {}).get("tensors_done") or 0) >= 5, timeout=120)
            status = f"{svc.url}/v1/jobs/{job['id']}"
            burst = concurrent.futures.ThreadPoolExecutor(8)
            auth = {"Authorization": f"Bearer {svc.key}"}
            list(burst.map(lambda _: httpx.get(status, headers=auth).status_code, range(32)))  # several connections
            aof_redis.restart()
            svc.redis = redis.Redis.from_url(aof_redis.url, decode_responses=True)
            # The API's pooled connections all died with the old server: they are replaced, not
            # answered with 503s (raw requests here, without the client's own retries).
            assert set(burst.map(lambda _: httpx.get(status, headers=auth).status_code, range(32))) == {200}
            burst.shutdown()
            wait_for(lambda: httpx.get(svc.url + "/readyz").status_code == 200, timeout=60)
            done = [c.wait(j["id"], timeout=300) for j in (job, queued)]
        for j in done:
            assert j["state"] == "succeeded", j.get("error")
            check_outputs(j, bucket, expected)
        assert not listing(bucket, "team/.ckptconv-staging")
    finally:
        svc.stop()


def test_sigkill_while_verifying_is_taken_over(redis_url: str, bucket: str, tmp_path: Path) -> None:
    svc = Service(redis_url, bucket, tmp_path, workers=1)
    first = svc.procs[1]
    try:
        expected = make_checkpoint(bucket, "team/kv/model.safetensors", 300)
        with svc.client() as c:
            job = c.submit(
                f"s3://{bucket}/team/kv/model.safetensors", f"s3://{bucket}/team/kv-out/model.mdl", to="cs-h5"
            )
            wait_for(lambda: (c.get(job["id"]).get("progress") or {}).get("stage") == "verifying", timeout=180)
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            svc.start_worker()
            job = c.wait(job["id"], timeout=300)
        assert job["state"] == "succeeded" and job["attempts"] == 2, job.get("error")
        check_outputs(job, bucket, expected)
        assert not listing(bucket, "team/.ckptconv-staging")
    finally:
        svc.stop()


@pytest.mark.parametrize("cut", ["between data files", "before the manifest"])
def test_sigkill_during_publication_is_taken_over(
    cut: str, redis_url: str, bucket: str, s3_server: str, tmp_path: Path
) -> None:
    """A worker killed while it moves its staged files to the target: the request it was making is
    dropped (the process that sent it is dead), the takeover publishes what is left from the
    staged output, and the manifest never names a file that is not at the target yet."""
    name = "kp-data" if cut == "between data files" else "kp-manifest"
    expected = make_checkpoint(bucket, f"team/{name}/model.safetensors", 40, dim=64)
    out = f"team/{name}-out/"
    held, release = threading.Event(), threading.Event()
    copies: list[str] = []

    def hold(method: str, path: str, headers: dict[str, str]) -> None:
        if method != "PUT" or "x-amz-copy-source" not in headers or f"/{out}" not in path or held.is_set():
            return
        copies.append(path)
        if (cut == "between data files" and len(copies) == 2) or path.endswith("/manifest.json"):
            held.set()
            release.wait(120)
            raise OSError("dropped: its sender was killed")

    seen_partial: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        # Whenever the manifest is visible, every file it names is there, whole.
        s3 = boto3.client("s3")
        while not stop.wait(0.1):
            objects = listing(bucket, out)
            if out + "manifest.json" not in objects:
                continue
            doc = json.loads(s3.get_object(Bucket=bucket, Key=out + "manifest.json")["Body"].read())
            for f in doc["files"]:
                key = f["uri"].removeprefix(f"s3://{bucket}/")
                if objects.get(key) != f["size"]:
                    seen_partial.append(key)

    watcher = threading.Thread(target=watch, daemon=True)
    with FaultProxy(s3_server) as proxy:
        proxy.on_request = hold
        svc = Service(redis_url, bucket, tmp_path, env={"AWS_ENDPOINT_URL": proxy.url})
        scratch = tmp_path / "scratch"
        svc.env["CKPTCONV_SCRATCH_DIR"] = str(scratch)
        try:
            first = svc.start_worker()
            watcher.start()
            with svc.client() as c:
                job = c.submit(
                    f"s3://{bucket}/team/{name}/model.safetensors",
                    f"s3://{bucket}/{out.rstrip('/')}",
                    to="safetensors",
                    options={"shard_size": "100KB"},
                )
                assert held.wait(180), "publication never reached the cut"
                os.kill(first.pid, signal.SIGKILL)
                first.wait()
                release.set()
                at_kill = listing(bucket, out)
                assert out + "manifest.json" not in at_kill
                assert len(at_kill) == (1 if cut == "between data files" else len(copies) - 1), at_kill
                svc.start_worker()
                job = c.wait(job["id"], timeout=300)
        finally:
            stop.set()
            release.set()
            svc.stop()
    watcher.join(timeout=10)
    assert job["state"] == "succeeded" and job["attempts"] == 2, job.get("error")
    assert len(job["result"]["outputs"]) > 2  # several shards and their index
    check_outputs(job, bucket, expected, "safetensors")
    assert out + "manifest.json" in listing(bucket, out)
    assert not seen_partial, seen_partial
    assert not listing(bucket, "team/.ckptconv-staging")
    assert not [p for p in scratch.rglob("*") if p.is_file()], "temp files left"


def test_production_is_not_ready_on_a_redis_without_persistence(
    aof_redis: PrivateRedis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fastapi.testclient import TestClient

    from ckptconv.core.settings import Settings
    from service.app import create_app

    volatile = PrivateRedis(tmp_path, aof=False)
    try:
        answers = {}
        for url, ready in ((volatile.url, False), (aof_redis.url, True)):
            settings = Settings(
                environment="production", redis_url=url, webhook_secret="whsec_" + "cHJvZHVjdGlvbi1zZWNyZXQ=" * 2
            )
            with TestClient(create_app(settings), raise_server_exceptions=False) as c:
                answers[ready] = c.get("/readyz")
            assert (answers[ready].status_code == 200) is ready, answers[ready].text
        assert answers[False].status_code == 503
        assert "Redis has no persistence" in caplog.text  # the reason is in the log, not the answer
        assert "persistence" not in answers[False].text
    finally:
        volatile.stop()


@pytest.mark.parametrize(
    ("options", "logged"),
    [
        ({"save": "3600 1"}, "persists by snapshots only"),  # snapshots alone: ready, the cost logged
        ({"extra": ("--rename-command", "CONFIG", "")}, "assuming it does"),  # a managed Redis hides CONFIG
    ],
)
def test_production_is_ready_on_a_redis_with_snapshots_or_one_that_hides_its_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, options: dict, logged: str
) -> None:
    from fastapi.testclient import TestClient

    from ckptconv.core.settings import Settings
    from service.app import create_app

    server = PrivateRedis(tmp_path, aof=False, **options)
    try:
        settings = Settings(
            environment="production", redis_url=server.url, webhook_secret="whsec_" + "cHJvZHVjdGlvbi1zZWNyZXQ=" * 2
        )
        with TestClient(create_app(settings), raise_server_exceptions=False) as c:
            answer = c.get("/readyz")
        assert answer.status_code == 200 and answer.json() == {"status": "ready"}, answer.text
        assert logged in caplog.text
    finally:
        server.stop()


def test_a_plan_answers_while_every_conversion_worker_is_busy(redis_url: str, bucket: str, tmp_path: Path) -> None:
    svc = Service(redis_url, bucket, tmp_path)
    try:
        make_checkpoint(bucket, "team/busy/model.safetensors", 600)
        # Both started at once (their imports overlap); the conversion worker is the only one.
        interactive = svc._spawn("interactive", ["worker", "--interactive", "--loglevel", "info"])
        svc.start_worker("--queues", "jobs")
        wait_for(lambda: b"ready." in Path(interactive.log_path).read_bytes(), timeout=60)
        with svc.client() as c:
            job = c.submit(
                f"s3://{bucket}/team/busy/model.safetensors", f"s3://{bucket}/team/busy-out/model.mdl", to="cs-h5"
            )
            wait_for(lambda: c.get(job["id"])["state"] == "running", timeout=120)
            plan = c.plan(f"s3://{bucket}/team/busy/model.safetensors", f"s3://{bucket}/team/busy-plan.mdl", to="cs-h5")
            assert plan["ok"] is True
            assert c.get(job["id"])["state"] == "running"  # answered while the conversion worker was busy
            # Ended here: a worker told to stop finishes its task first, up to the whole conversion.
            with contextlib.suppress(Conflict):  # it ended already
                c.cancel(job["id"])
            c.wait(job["id"], timeout=120)
    finally:
        svc.stop()
