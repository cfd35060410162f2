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
import uuid
from pathlib import Path

import httpx
import pytest
from test_e2e_service import Service

from ckptconv.core.errors import TargetExists
from ckptconv.engine.convert import convert
from ckptconv.storage import open_storage


@pytest.fixture(scope="module")
def api(redis_url: str, tmp_path_factory: pytest.TempPathFactory):
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
