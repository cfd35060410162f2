"""The HTTP API against a real Redis, in process (FastAPI TestClient), without workers.

What needs a worker (jobs running, dry runs answered, webhooks) is in test_e2e_service.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from fastapi.testclient import TestClient
from test_e2e_service import wait_for

from ckptconv.core.auth import create_key, hash_key, load_keys_file
from ckptconv.core.errors import Unauthorized
from ckptconv.core.job_records import new_job_id
from ckptconv.core.jobstore import JobStore, RedisKeys
from ckptconv.core.settings import DEFAULT_WEBHOOK_SECRET, Settings
from ckptconv.core.webhooks import sign, verify
from ckptconv.formats import FORMATS
from service.app import create_app
from service.queue import TaskMessages, time_limits

ROOT = Path(__file__).resolve().parent.parent
PROBLEM = "application/problem+json"


def drop_prefix(client: redis.Redis, prefix: str) -> None:
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i : i + 500])


@pytest.fixture
def api(redis_url: str, s3_server: str, tmp_path: Path):
    prefix = f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
    settings = Settings(
        environment="development",
        redis_url=redis_url,
        redis_prefix=prefix,
        plan_timeout_seconds=1.0,
        storage_probe_uri=str(tmp_path) + "/",
    )
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = RedisKeys(settings.redis_prefix, settings.broker_prefix)
    key_a, _ = create_key(r, keys, "team-a", ["s3://bucket/team-a/", "/data/team-a/"])
    key_b, _ = create_key(r, keys, "team-b", ["s3://bucket/team-b/"])
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            yield SimpleNamespace(
                client=client,
                settings=settings,
                redis=r,
                keys=keys,
                a={"Authorization": f"Bearer {key_a}"},
                b={"Authorization": f"Bearer {key_b}"},
            )
    finally:
        drop_prefix(r, prefix)


def job_body(n: int = 0, team: str = "team-a", **extra) -> dict:
    return {
        "kind": "convert",
        "source": {"uri": f"s3://bucket/{team}/in-{n}.safetensors"},
        "target": {"uri": f"s3://bucket/{team}/out-{n}/model.mdl", "format": "cs-h5"},
        **extra,
    }


def assert_problem(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    doc = response.json()
    assert doc["status"] == status and doc["code"] == code, doc
    assert doc["type"].endswith("/" + code) and doc["title"] and doc["detail"]
    return doc


# --- the process boundary ---------------------------------------------------------------------


def test_api_process_never_imports_torch_or_h5py(redis_url: str, s3_server: str, tmp_path: Path) -> None:
    prefix = f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
    code = f"""
import sys
from fastapi.testclient import TestClient
import ckptconv.client, ckptconv.cli.service, ckptconv.cli
from service.app import create_app
from ckptconv.core.settings import Settings
s = Settings(environment="development", auth_disabled=True, redis_url={redis_url!r},
             redis_prefix={prefix!r}, storage_probe_uri={str(tmp_path)!r})
with TestClient(create_app(s)) as c:
    c.get("/readyz").raise_for_status()
    c.get("/v1/formats").raise_for_status()
    c.get("/v1/kinds").raise_for_status()
    c.get("/openapi.json").raise_for_status()
    c.get("/metrics").raise_for_status()
    c.post("/v1/jobs", json={{"kind": "convert", "source": {{"uri": "s3://b/x"}},
                              "target": {{"uri": "s3://b/y.mdl", "format": "cs-h5"}}}}).raise_for_status()
print(sorted(m for m in ("torch", "h5py", "tensorflow", "safetensors") if m in sys.modules))
"""
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    finally:
        drop_prefix(redis.Redis.from_url(redis_url), prefix)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


# --- submit, get, replay ---------------------------------------------------------------------


def test_submit_answers_202_with_location_and_enqueues_only_the_job_id(api) -> None:
    r = api.client.post("/v1/jobs", json=job_body(labels={"team": "a"}), headers=api.a)
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["state"] == "queued" and job["done"] is False and job["attempts"] == 0
    assert job["target"] == {"uri": "s3://bucket/team-a/out-0/model.mdl", "format": "cs-h5"}
    assert job["labels"] == {"team": "a"} and job["result"] is None and job["error"] is None
    assert api.client.get(r.headers["location"], headers=api.a).json() == job

    # The queue holds one Celery protocol-2 message whose only argument is the job id, tagged
    # with the job id (the worker's heartbeat keeps that tag's delivery alive).
    raw = api.redis.lrange(api.keys.queue(api.settings.jobs_queue), 0, -1)
    assert len(raw) == 1
    msg = json.loads(raw[0])
    assert msg["headers"]["task"] == "ckptconv.run_job"
    assert msg["properties"]["delivery_tag"] == job["id"]
    assert msg["properties"]["delivery_info"]["routing_key"] == api.settings.jobs_queue
    args, kwargs, _embed = json.loads(base64.b64decode(msg["body"]))
    assert args == [job["id"]] and kwargs == {}
    # Celery's limits come after the job's own deadline (max_runtime_seconds), each with grace.
    soft, hard = msg["headers"]["timelimit"][1], msg["headers"]["timelimit"][0]
    assert hard > soft > job["max_runtime_seconds"]


def test_a_run_job_message_copied_from_its_template_is_the_message_rendered_whole() -> None:
    messages = TaskMessages(RedisKeys("p:"))
    for queue, runtime in (("jobs", 3600), ("jobs", 60), ("other", 3600), ("jobs", 3600)):
        job_id, task_id = new_job_id(), str(uuid.uuid4())
        limits = time_limits(runtime)
        whole = messages.render(
            "ckptconv.run_job", [job_id], queue=queue, delivery_tag=job_id, task_id=task_id, **limits
        )
        assert messages.run_job(job_id, queue=queue, max_runtime_seconds=runtime, task_id=task_id) == whole
    a, b = (json.loads(messages.run_job(new_job_id(), queue="jobs", max_runtime_seconds=60)) for _ in range(2))
    assert a["headers"]["id"] != b["headers"]["id"]  # a new task id each time


def test_idempotency_key_replays_rejects_other_bodies_and_is_per_api_key(api) -> None:
    h = {**api.a, "Idempotency-Key": "order-1"}
    first = api.client.post("/v1/jobs", json=job_body(1), headers=h)
    again = api.client.post("/v1/jobs", json=job_body(1), headers=h)
    assert first.status_code == again.status_code == 202
    assert again.content == first.content and again.headers["location"] == first.headers["location"]
    assert again.headers["idempotent-replayed"] == "true"
    assert api.redis.llen(api.keys.queue(api.settings.jobs_queue)) == 1  # one job, one message

    assert_problem(api.client.post("/v1/jobs", json=job_body(2), headers=h), 422, "idempotency_key_reused")
    # The same key from another API key is another request altogether.
    other = api.client.post(
        "/v1/jobs", json=job_body(1, team="team-b"), headers={**api.b, "Idempotency-Key": "order-1"}
    )
    assert other.status_code == 202 and other.json()["id"] != first.json()["id"]


def test_local_targets_with_data_are_409_and_a_retry_still_gets_its_job(api, tmp_path: Path) -> None:
    key, _ = create_key(api.redis, api.keys, "local", [f"{tmp_path}/"])
    auth = {"Authorization": f"Bearer {key}"}

    def submit(target: str, fmt: str = "cs-h5", idem: str | None = None):
        body = {
            "kind": "convert",
            "source": {"uri": f"{tmp_path}/in.safetensors"},
            "target": {"uri": target, "format": fmt},
        }
        return api.client.post("/v1/jobs", json=body, headers={**auth, **({"Idempotency-Key": idem} if idem else {})})

    (tmp_path / "file.mdl").write_bytes(b"earlier bytes")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "model.mdl").write_bytes(b"")
    (tmp_path / "tf").mkdir()
    (tmp_path / "tf" / "model.index").write_bytes(b"")
    (tmp_path / "gone.mdl.manifest.json").write_text("{}")  # the file itself was deleted; its manifest was not
    for target, fmt in (
        (f"{tmp_path}/file.mdl", "cs-h5"),
        (f"{tmp_path}/gone.mdl", "cs-h5"),
        (f"{tmp_path}/dir", "cs-s3"),
        (f"{tmp_path}/tf/model", "tf"),
    ):
        assert_problem(submit(target, fmt), 409, "target_taken")
    assert submit(f"{tmp_path}/tf/model", "safetensors").status_code == 202  # only a TF bundle is named by its prefix
    assert (tmp_path / "file.mdl").read_bytes() == b"earlier bytes"

    # The job made by a request is that request's answer even after the job wrote its target.
    first = submit(f"{tmp_path}/new/model.mdl", idem="retry-1")
    assert first.status_code == 202, first.text
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "model.mdl").write_bytes(b"the job's output")
    again = submit(f"{tmp_path}/new/model.mdl", idem="retry-1")
    assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert_problem(submit(f"{tmp_path}/new/model.mdl", idem="retry-2"), 409, "target_taken")


def test_one_target_spelled_with_or_without_a_trailing_slash_is_one_reservation(api, tmp_path: Path) -> None:
    key, _ = create_key(api.redis, api.keys, "spellings", ["s3://bucket/team-a/", f"{tmp_path}/"])
    auth = {"Authorization": f"Bearer {key}"}

    def submit(target: str):
        body = {"kind": "convert", "source": {"uri": "s3://bucket/team-a/in.safetensors"}}
        return api.client.post(
            "/v1/jobs", json={**body, "target": {"uri": target, "format": "safetensors"}}, headers=auth
        )

    for first, *others in (
        ("s3://bucket/team-a/slash/out/", "s3://bucket/team-a/slash/out"),
        ("s3://bucket/team-a/bare/out", "s3://bucket/team-a/bare/out/"),
        (f"{tmp_path}/local/out/", f"{tmp_path}/local/out", f"file://{tmp_path}/local/out", f"{tmp_path}/local/./out"),
    ):
        assert submit(first).status_code == 202
        for other in others:
            assert_problem(submit(other), 409, "target_taken")


def _submitter(api, tmp_path: Path, name: str) -> tuple:
    """A function submitting a conversion to a given target, under a new key for team-a's S3 prefix
    and ``tmp_path``, and that key's headers."""
    key, _ = create_key(api.redis, api.keys, name, ["s3://bucket/team-a/", f"{tmp_path}/"])
    auth = {"Authorization": f"Bearer {key}"}

    def submit(target: str, fmt: str = "safetensors"):
        body = {"kind": "convert", "source": {"uri": "s3://bucket/team-a/in.safetensors"}}
        return api.client.post("/v1/jobs", json={**body, "target": {"uri": target, "format": fmt}}, headers=auth)

    return submit, auth


def test_a_target_and_anything_under_or_over_it_are_one_reservation(api, tmp_path: Path) -> None:
    # A directory target and a file inside it publish to one final key: the second is refused
    # whichever comes first, locally and on S3; a sibling sharing a name prefix is another target.
    submit, auth = _submitter(api, tmp_path, "nested")

    for base in ("s3://bucket/team-a/nest", f"{tmp_path}/nest"):
        outer = submit(f"{base}/d1/")
        assert outer.status_code == 202, outer.text
        assert_problem(submit(f"{base}/d1/model.safetensors"), 409, "target_taken")  # under a held one
        assert_problem(submit(f"{base}/d1/deeper/x.safetensors"), 409, "target_taken")
        inner = submit(f"{base}/d2/sub/model.safetensors")
        assert inner.status_code == 202, inner.text
        assert_problem(submit(f"{base}/d2/"), 409, "target_taken")  # over a held one
        assert_problem(submit(f"{base}/d2/sub"), 409, "target_taken")
        assert submit(f"{base}/d1x/model.safetensors").status_code == 202  # segment boundaries
        assert submit(f"{base}/d2x").status_code == 202
        # Released on a final state: the other one of each pair is then accepted.
        for job in (outer, inner):
            cancelled = api.client.post(f"/v1/jobs/{job.json()['id']}/cancel", headers=auth)
            assert cancelled.json()["state"] == "cancelled"
        assert submit(f"{base}/d1/model.safetensors").status_code == 202
        assert submit(f"{base}/d2/").status_code == 202


def test_a_target_and_a_file_it_writes_beside_itself_are_one_reservation(api, tmp_path: Path) -> None:
    # A TF bundle named by its prefix writes "<prefix>.index" and "<prefix>.data-..." beside it, and a
    # file target its "<file>.manifest.json": a target at one of those names publishes to the same
    # key; whichever comes first, the second is refused at submit, not at publication after its work.
    submit, auth = _submitter(api, tmp_path, "siblings")

    def cancel(job) -> None:
        assert api.client.post(f"/v1/jobs/{job.json()['id']}/cancel", headers=auth).json()["state"] == "cancelled"

    for base in ("s3://bucket/team-a/sib", f"{tmp_path}/sib"):
        bundle = submit(f"{base}/a/model", "tf")
        assert bundle.status_code == 202, bundle.text
        assert_problem(submit(f"{base}/a/model.index"), 409, "target_taken")
        assert_problem(submit(f"{base}/a/model.data-00000-of-00001"), 409, "target_taken")
        assert_problem(submit(f"{base}/a/model.manifest.json"), 409, "target_taken")
        assert submit(f"{base}/a/model.v2.safetensors").status_code == 202  # not a name it writes
        cancel(bundle)
        index = submit(f"{base}/b/model.data-00000-of-00001")
        assert index.status_code == 202, index.text
        assert_problem(submit(f"{base}/b/model", "tf"), 409, "target_taken")
        cancel(index)
        assert submit(f"{base}/b/model", "tf").status_code == 202


def test_a_submission_over_many_live_jobs_reads_one_page_of_them(tmp_path: Path) -> None:
    # Thousands of live jobs under one directory: a submission for that directory is refused on the
    # first live one it reads, without reading the whole set of them (which blocked Redis, one
    # single-threaded script per refused request). A private server: its command counts are ours.
    import redis.asyncio
    from conftest import PrivateRedis

    from ckptconv.core.job_records import new_record
    from ckptconv.core.jobstore import AsyncJobStore

    server = PrivateRedis(tmp_path, aof=False)
    try:
        keys = RedisKeys("many:")
        sync = redis.Redis.from_url(server.url, decode_responses=True)

        async def scenario() -> list[str]:
            store = AsyncJobStore(redis.asyncio.Redis.from_url(server.url, decode_responses=True), keys)

            async def submit(uri: str) -> list[str]:
                claim = keys.target_claim(uri)
                rec = new_record(
                    job_id=new_job_id(), owner="o", kind="convert", request={}, webhook_secret=None,
                    created=1, target_claim=claim, scopes=None,
                )  # fmt: skip
                return await store.submit(
                    rec, labels={}, idem_key=None, fingerprint="", idem_ttl_seconds=60, response_body="{}",
                    queue="q", message="m",
                )  # fmt: skip

            for i in range(2000):
                assert (await submit(f"s3://bucket/team/p/j{i}/model.mdl"))[0] == "created"
            sync.config_resetstat()
            return await submit("s3://bucket/team/p/")

        assert asyncio.run(scenario())[0] == "target_taken"
        stats = sync.info("commandstats")
        assert "cmdstat_smembers" not in stats and stats["cmdstat_sscan"]["calls"] == 1, stats
        assert stats["cmdstat_hmget"]["calls"] == 1
    finally:
        server.stop()


def test_idempotency_key_in_flight_is_409_and_released_after_a_5xx(api) -> None:
    # No worker consumes the interactive queue, so a dry run waits plan_timeout_seconds (1 s) and
    # then answers 503; meanwhile its Idempotency-Key is in flight.
    h = {**api.a, "Idempotency-Key": "plan-1"}
    body = job_body(3)
    first: dict = {}
    t = threading.Thread(target=lambda: first.setdefault("r", api.client.post("/v1/plans", json=body, headers=h)))
    t.start()
    # Sent once the first request holds the key (not after a fixed pause: on a busy machine its
    # thread may not have run yet); it holds it for the whole plan timeout, which is far longer
    # than this request needs to reach its own claim.
    claims = f"{api.settings.redis_prefix}idem:*"
    wait_for(lambda: any(api.redis.scan_iter(match=claims)) or not t.is_alive())
    assert_problem(api.client.post("/v1/plans", json=body, headers=h), 409, "idempotent_request_in_flight")
    t.join()
    assert_problem(first["r"], 503, "worker_timeout")
    # The 503 released the key: a retry runs again (and times out again) instead of replaying.
    assert_problem(api.client.post("/v1/plans", json=body, headers=h), 503, "worker_timeout")


def _claim_taken_in_flight(api, body: dict, headers: dict, then=lambda: None) -> tuple:
    """A dry run whose Idempotency-Key claim, while it runs, is replaced by another request's (the
    first claim lapsed and another request claimed the key); ``then`` runs after the swap. Returns
    the dry run's response and the key's record."""
    pattern = api.keys.idempotency("*", "*")
    first: dict = {}
    t = threading.Thread(target=lambda: first.setdefault("r", api.client.post("/v1/plans", json=body, headers=headers)))
    t.start()
    record = None
    while record is None and t.is_alive():
        record = next(iter(api.redis.scan_iter(match=pattern)), None)
    assert record is not None and api.redis.hget(record, "status") == "pending"
    api.redis.hset(record, "claim", "another-request")
    then()
    t.join()
    return first["r"], record


def test_a_5xx_releases_only_its_own_idempotency_claim(api) -> None:
    # While the dry run waits (then answers 503), its claim is replaced by another request's (the
    # first claim lapsed and another request claimed the key): the 503 must not release that one.
    h = {**api.a, "Idempotency-Key": "plan-own"}
    body = job_body(4)
    first, record = _claim_taken_in_flight(api, body, h)
    assert_problem(first, 503, "worker_timeout")
    assert api.redis.hgetall(record).get("claim") == "another-request"
    assert_problem(api.client.post("/v1/plans", json=body, headers=h), 409, "idempotent_request_in_flight")


def test_an_answer_is_stored_only_over_its_own_idempotency_claim(api, monkeypatch) -> None:
    # While the dry run works, its claim lapses and another request claims the key: the dry run's
    # answer must not be recorded over that claim (a third request would be answered with it, and
    # the claim holder's own outcome would be overwritten when it finishes).
    from service.routes import plans

    swapped = threading.Event()

    async def answer(state, name, payload):
        while not swapped.is_set():
            await asyncio.sleep(0.01)
        return {"outputs": []}

    monkeypatch.setattr(plans, "call_worker", answer)
    h = {**api.a, "Idempotency-Key": "plan-complete-own"}
    body = job_body(5)
    first, record = _claim_taken_in_flight(api, body, h, then=swapped.set)
    assert first.status_code == 200, first.text
    stored = api.redis.hgetall(record)
    assert stored.get("status") == "pending" and stored.get("claim") == "another-request", stored
    assert_problem(api.client.post("/v1/plans", json=body, headers=h), 409, "idempotent_request_in_flight")


def test_the_api_reconnects_to_redis_after_jittered_waits(api) -> None:
    # When Redis drops every client at once, the API's commands (and its processes) must not all
    # reconnect and resend at the same instants: each wait of the retry policy is drawn at random.
    state = api.client.app.ckptconv
    policies = [
        state.redis._mux.retry,  # the multiplexed short commands
        state.redis.connection_pool.connection_kwargs["retry"],  # the short commands' pool
        state.blocking_redis.connection_pool.connection_kwargs["retry"],
    ]
    for policy in policies:
        for failures, (low, high) in {1: (0.05, 0.1), 2: (0.1, 0.2), 3: (0.2, 0.4)}.items():
            waits = [policy._backoff.compute(failures) for _ in range(200)]
            assert low <= min(waits) and max(waits) <= high
            assert len(set(waits)) > 150, (type(policy._backoff).__name__, failures, sorted(set(waits))[:3])


# --- authentication and scopes ----------------------------------------------------------------


def test_missing_unknown_and_revoked_keys_are_401(api) -> None:
    doc = assert_problem(api.client.get("/v1/jobs"), 401, "unauthorized")
    assert "Bearer" in doc["hint"]
    r = api.client.get("/v1/jobs", headers={"Authorization": "Bearer ckc_nope"})
    assert_problem(r, 401, "unauthorized")
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert_problem(api.client.get("/v1/jobs", headers={"Authorization": "Basic dTpw"}), 401, "unauthorized")


def test_uris_outside_the_keys_prefixes_are_403(api) -> None:
    outside = job_body(target={"uri": "s3://bucket/team-b/stolen.mdl", "format": "cs-h5"})
    assert_problem(api.client.post("/v1/jobs", json=outside, headers=api.a), 403, "forbidden")
    reading = {**job_body(), "source": {"uri": "s3://bucket/team-b/secret.safetensors"}}
    assert_problem(api.client.post("/v1/jobs", json=reading, headers=api.a), 403, "forbidden")
    # A string prefix is not fooled by dot segments or by local path normalisation.
    dots = {**job_body(), "source": {"uri": "s3://bucket/team-a/../team-b/x"}}
    assert_problem(api.client.post("/v1/jobs", json=dots, headers=api.a), 422, "path_escape")
    local = {**job_body(), "source": {"uri": "/data/team-a/../../etc/passwd"}}
    assert_problem(api.client.post("/v1/jobs", json=local, headers=api.a), 422, "path_escape")
    rel = {**job_body(), "source": {"uri": "data/team-a/x"}}
    assert_problem(api.client.post("/v1/jobs", json=rel, headers=api.a), 422, "invalid_request")
    ok = {**job_body(), "source": {"uri": "file:///data/team-a/in.safetensors"}}
    r = api.client.post("/v1/jobs", json=ok, headers=api.a)
    assert r.status_code == 202 and r.json()["source"]["uri"] == "/data/team-a/in.safetensors"
    assert_problem(
        api.client.get("/v1/inspect", params={"uri": "s3://bucket/team-b/x"}, headers=api.a), 403, "forbidden"
    )


def test_a_target_at_the_root_of_a_prefix_is_403(api) -> None:
    # A job stages and writes its manifest beside its target: at a prefix's root, outside the prefix.
    for uri in ("s3://bucket/team-a/", "/data/team-a/"):
        body = job_body(target={"uri": uri, "format": "safetensors"})
        doc = assert_problem(api.client.post("/v1/jobs", json=body, headers=api.a), 403, "forbidden")
        assert ".ckptconv-staging" in doc["detail"]
    inside = job_body(target={"uri": "s3://bucket/team-a/out/", "format": "safetensors"})
    assert api.client.post("/v1/jobs", json=inside, headers=api.a).status_code == 202


def test_a_key_sees_only_its_own_jobs(api) -> None:
    job = api.client.post("/v1/jobs", json=job_body(), headers=api.a).json()
    assert_problem(api.client.get(f"/v1/jobs/{job['id']}", headers=api.b), 404, "not_found")
    assert_problem(api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.b), 404, "not_found")
    assert_problem(api.client.get(f"/v1/jobs/{job['id']}/events", headers=api.b), 404, "not_found")
    assert api.client.get("/v1/jobs", headers=api.b).json()["jobs"] == []
    assert [j["id"] for j in api.client.get("/v1/jobs", headers=api.a).json()["jobs"]] == [job["id"]]


def test_keys_file_principals(tmp_path: Path, redis_url: str) -> None:
    key = "ckc_from-a-file"
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - name: ci\n    sha256: {hash_key(key)}\n    prefixes: ['s3://ci/']\n")
    principals = load_keys_file(path)
    (p,) = principals.values()
    assert p.name == "ci" and p.prefixes == ("s3://ci/",)
    settings = Settings(
        environment="development",
        redis_url=redis_url,
        api_keys_file=path,
        redis_prefix=f"ckptconv-test-{uuid.uuid4().hex[:10]}:",
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        assert c.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert_problem(c.get("/v1/jobs", headers={"Authorization": "Bearer ckc_other"}), 401, "unauthorized")


# --- validation and unknown routes ---------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"kind": "convert", "source": {"uri": "s3://bucket/team-a/x"}},  # no target
        {**job_body(), "kind": "teleport"},
        {**job_body(), "target": {"uri": "s3://bucket/team-a/y", "format": "pdf"}},
        {**job_body(), "options": {"shard_size": "5 parsecs"}},
        {**job_body(), "options": {"shard_size": 0}},
        {**job_body(), "options": {"dtype": "int8"}},
        {**job_body(), "options": {"typo": 1}},
        {**job_body(), "surprise": True},
        {**job_body(), "labels": {"bad key!": "x"}},
        {**job_body(), "webhook": {"url": "ftp://example.com/hook"}},
        {**job_body(), "max_runtime_seconds": 0},
        {**job_body(), "source": {"uri": "http://example.com/x.safetensors"}},
    ],
)
def test_invalid_requests_are_422_problems(api, body: dict) -> None:
    doc = assert_problem(
        api.client.post("/v1/jobs", json=body, headers=api.a), 422, body.get("_code", "invalid_request")
    )
    assert doc["detail"]


def test_malformed_json_unknown_routes_and_methods(api) -> None:
    r = api.client.post("/v1/jobs", content=b"{not json", headers={**api.a, "content-type": "application/json"})
    assert_problem(r, 422, "invalid_request")
    assert_problem(api.client.get("/v1/nothing-here", headers=api.a), 404, "not_found")
    assert_problem(api.client.get("/v1/jobs/job_00000000000000000000000000000000", headers=api.a), 404, "not_found")
    assert_problem(api.client.get("/v1/jobs/not-an-id", headers=api.a), 404, "not_found")
    assert_problem(api.client.delete("/v1/jobs", headers=api.a), 405, "method_not_allowed")
    assert_problem(api.client.get("/v1/jobs", params={"cursor": "garbage"}, headers=api.a), 422, "invalid_request")
    assert_problem(api.client.get("/v1/jobs", params={"label": "nocolon"}, headers=api.a), 422, "invalid_request")
    assert_problem(api.client.get("/v1/jobs", params={"limit": 0}, headers=api.a), 422, "invalid_request")


# --- listing ------------------------------------------------------------------------------------


def test_listing_filters_and_cursor_pagination(api) -> None:
    ids = []
    for i in range(5):
        labels = {"run": "even" if i % 2 == 0 else "odd"}
        ids.append(api.client.post("/v1/jobs", json=job_body(i, labels=labels), headers=api.a).json()["id"])
    newest_first = ids[::-1]

    seen, cursor = [], None
    for _ in range(5):
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = api.client.get("/v1/jobs", params=params, headers=api.a).json()
        seen += [j["id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == newest_first

    even = api.client.get("/v1/jobs", params={"label": "run:even"}, headers=api.a).json()["jobs"]
    assert [j["id"] for j in even] == [ids[4], ids[2], ids[0]]
    api.client.post(f"/v1/jobs/{ids[1]}/cancel", headers=api.a)
    cancelled = api.client.get("/v1/jobs", params={"state": "cancelled"}, headers=api.a).json()["jobs"]
    assert [j["id"] for j in cancelled] == [ids[1]]
    queued_odd = api.client.get("/v1/jobs", params={"state": "queued", "label": "run:odd"}, headers=api.a).json()
    assert [j["id"] for j in queued_odd["jobs"]] == [ids[3]]
    assert (
        api.client.get("/v1/jobs", params={"kind": "convert", "limit": 100}, headers=api.a).json()["next_cursor"]
        is None
    )


# --- cancellation and events -------------------------------------------------------------------


def test_cancel_queued_running_and_finished_jobs(api) -> None:
    store = JobStore(api.redis, api.keys)
    queued = api.client.post("/v1/jobs", json=job_body(1), headers=api.a).json()
    r = api.client.post(f"/v1/jobs/{queued['id']}/cancel", headers=api.a)
    assert r.status_code == 200 and r.json()["state"] == "cancelled" and r.json()["done"]
    assert r.json()["error"]["code"] == "cancelled"
    assert api.client.post(f"/v1/jobs/{queued['id']}/cancel", headers=api.a).json()["state"] == "cancelled"

    running = api.client.post("/v1/jobs", json=job_body(2), headers=api.a).json()
    assert store.transition(running["id"], ("queued",), "running")[0]
    r = api.client.post(f"/v1/jobs/{running['id']}/cancel", headers=api.a)
    assert r.json()["state"] == "cancelling" and not r.json()["done"]
    assert api.redis.hget(api.keys.job(running["id"]), "cancel_requested") == "1"

    done = api.client.post("/v1/jobs", json=job_body(3), headers=api.a).json()
    store.transition(done["id"], ("queued",), "running")
    store.transition(done["id"], ("running",), "succeeded", {"result": {"outputs": []}})
    assert_problem(api.client.post(f"/v1/jobs/{done['id']}/cancel", headers=api.a), 409, "conflict")


def _follow_in_thread(api, job_id: str, headers: dict, events: list[tuple[str, dict]]) -> threading.Thread:
    """Read the job's event stream into ``events`` (name, data) on a thread, until it ends.

    Returns once the stream sent its first event (the job as it is): from then on it delivers
    every change of the job. Not after a fixed pause: on a busy machine a stream opened late sees
    the job already finished, and only its final state."""

    def follow() -> None:
        with api.client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            name = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    events.append((name, json.loads(line[5:])))

    t = threading.Thread(target=follow)
    t.start()
    wait_for(lambda: events or not t.is_alive())
    return t


def test_event_stream_replays_history_and_ends_with_the_job(api) -> None:
    store = JobStore(api.redis, api.keys)
    job = api.client.post("/v1/jobs", json=job_body(), headers=api.a).json()
    events: list[tuple[str, dict]] = []
    t = _follow_in_thread(api, job["id"], api.a, events)
    store.transition(job["id"], ("queued",), "running")
    store.progress(
        job["id"], {"stage": "converting", "tensors_done": 1, "tensors_total": 2, "bytes_done": 4, "bytes_total": 8}
    )
    store.transition(job["id"], ("running",), "succeeded", {"result": {"outputs": []}})
    t.join(timeout=20)
    assert not t.is_alive()
    names = [n for n, _ in events]
    assert names[0] == "job" and names[-1] == "job" and "progress" in names
    assert [d["state"] for n, d in events if n == "state"] == ["running", "succeeded"]
    assert events[-1][1]["state"] == "succeeded" and events[-1][1]["done"]


@pytest.mark.parametrize("last_event_id", ["18446744073709551616-0", "0-18446744073709551616", "1-x", "+"])
def test_a_hostile_last_event_id_resumes_from_now(api, last_event_id: str) -> None:
    """A Last-Event-ID that is no stream position Redis can hold (beyond 64 bits, not numbers) is
    ignored: the stream follows the job from now on, never dies on a Redis error."""
    store = JobStore(api.redis, api.keys)
    job = api.client.post("/v1/jobs", json=job_body(), headers=api.a).json()
    events: list[tuple[str, dict]] = []
    t = _follow_in_thread(api, job["id"], {**api.a, "Last-Event-ID": last_event_id}, events)
    store.transition(job["id"], ("queued",), "running")
    store.transition(job["id"], ("running",), "succeeded", {"result": {"outputs": []}})
    t.join(timeout=20)
    assert not t.is_alive()
    assert [d["state"] for n, d in events if n == "state"] == ["running", "succeeded"]
    assert events[-1][0] == "job" and events[-1][1]["state"] == "succeeded"


# --- catalog, health, metrics ------------------------------------------------------------------


def test_catalog_health_and_metrics(api) -> None:
    formats = {f["name"]: f for f in api.client.get("/v1/formats").json()["formats"]}
    assert {"cs-h5", "safetensors", "torch", "tf", "cs-s3"} <= set(formats)
    assert formats["cs-h5"]["read"] and formats["cs-h5"]["write"]
    assert formats == {f.name: f.describe() for f in FORMATS.values()}  # the registry, as it is
    kinds = {k["name"]: k for k in api.client.get("/v1/kinds").json()["kinds"]}
    assert "shard_size" in kinds["convert"]["options_schema"]["properties"]
    assert api.client.get("/healthz").json() == {"status": "ok"}
    assert api.client.get("/readyz").json() == {"status": "ready"}  # and nothing more: it is unauthenticated

    job = api.client.post("/v1/jobs", json=job_body(), headers=api.a).json()
    api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.a)
    text = api.client.get("/metrics").text
    assert 'ckptconv_jobs{state="cancelled"} 1.0' in text
    assert 'ckptconv_jobs_finished_total{state="cancelled"} 1.0' in text
    assert f'ckptconv_queue_depth{{queue="{api.settings.jobs_queue}"}} 1.0' in text
    assert "ckptconv_job_duration_seconds_bucket" in text and "ckptconv_bytes_converted_total" in text


def test_readyz_fails_when_storage_does_not_answer(redis_url: str, tmp_path: Path) -> None:
    settings = Settings(
        environment="development",
        auth_disabled=True,
        redis_url=redis_url,
        storage_probe_uri="s3://",
        redis_prefix=f"ckptconv-test-{uuid.uuid4().hex[:10]}:",
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        doc = assert_problem(c.get("/readyz"), 503, "service_unavailable")
    # Not ready, and nothing about why (the reason is logged under the correlation id).
    assert "s3" not in doc["detail"] and "Error" not in doc["detail"] and doc["correlation_id"] in doc["detail"]


# --- settings and webhook signatures -------------------------------------------------------------


def test_settings_refuse_development_shortcuts_in_production() -> None:
    with pytest.raises(ValueError, match="auth_disabled"):
        Settings(environment="production", auth_disabled=True, webhook_secret="whsec_c2VjcmV0")
    with pytest.raises(ValueError, match="WEBHOOK_SECRET"):
        Settings(environment="production")
    assert Settings(environment="production", webhook_secret="whsec_c2VjcmV0").auth_disabled is False
    assert Settings(environment="development").webhook_secret.get_secret_value() == DEFAULT_WEBHOOK_SECRET


def test_standard_webhooks_signature_round_trip() -> None:
    secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    body = b'{"type":"job.succeeded"}'
    headers = sign(secret, "msg_1", body)
    assert headers["webhook-signature"].startswith("v1,")
    verify(secret, headers, body)
    with pytest.raises(Unauthorized):
        verify(secret, headers, body + b" ")
    with pytest.raises(Unauthorized):
        verify(secret, sign(secret, "msg_1", body, timestamp=int(time.time()) - 3600), body)


def test_keys_command_creates_lists_and_revokes_hashed_keys(redis_url: str) -> None:
    prefix = f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
    env = {
        "PATH": "/usr/bin:/bin",
        "CKPTCONV_ENVIRONMENT": "development",
        "CKPTCONV_REDIS_URL": redis_url,
        "CKPTCONV_REDIS_PREFIX": prefix,
    }

    def ckptconv(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ckptconv", "keys", *args], cwd=ROOT, env=env, capture_output=True, text=True
        )

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        created = ckptconv("create", "--name", "team-a", "--prefix", "s3://bucket/team-a/")
        assert created.returncode == 0, created.stderr
        key = created.stdout.strip()
        assert key.startswith("ckc_") and len(key) > 40
        stored = r.hgetall(RedisKeys(prefix).api_key(hash_key(key)))
        assert stored["name"] == "team-a" and key not in json.dumps(stored)  # only the hash is kept
        listed = ckptconv("list").stdout
        assert "team-a" in listed and "s3://bucket/team-a/" in listed and key not in listed
        key_id = listed.split()[0]
        assert ckptconv("revoke", key_id).returncode == 0
        assert not r.exists(RedisKeys(prefix).api_key(hash_key(key)))
        assert ckptconv("revoke", key_id).returncode == 2
    finally:
        drop_prefix(r, prefix)


def test_an_unreachable_redis_is_a_503_problem() -> None:
    from conftest import free_port  # the suite's conftest, as pytest loaded it

    settings = Settings(environment="development", auth_disabled=True, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        assert_problem(c.get("/readyz"), 503, "service_unavailable")
        r = c.post("/v1/jobs", json=job_body())
        assert_problem(r, 503, "service_unavailable")
        assert r.headers["retry-after"]


def test_the_model_tables_are_read_before_the_first_request(redis_url: str) -> None:
    # A convert-model request's options are checked against them on the event loop: read at
    # startup, the first such request does not hold every other one while they load.
    from ckptconv.engine.layouts import registry

    registry.model_index.cache_clear()
    registry._tables.cache_clear()
    settings = Settings(
        environment="development", redis_url=redis_url, redis_prefix=f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
    )
    with TestClient(create_app(settings), raise_server_exceptions=False):
        assert registry.model_index.cache_info().currsize == 1
        assert registry._tables.cache_info().currsize == 1
