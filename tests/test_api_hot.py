"""The short way of POST /v1/jobs (service.hot) answers exactly as the FastAPI route does.

A body sent as ``application/json`` takes the short way; the same body sent as
``application/vnd.ckptconv+json`` (JSON to FastAPI, not the usual shape to service.hot) is answered
by the FastAPI route. Every request below goes both ways and the answers are compared. The short
way runs in front of FastAPI's middleware (service.edges), so its server errors are compared too.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from fastapi.testclient import TestClient
from test_api import assert_problem, drop_prefix, job_body

from ckptconv.core.auth import create_key
from ckptconv.core.job_records import job_resource
from ckptconv.core.jobstore import JobStore, RedisKeys
from ckptconv.core.settings import Settings
from service.app import create_app
from service.deps import AppState

SHORT = "application/json"
ROUTE = "application/vnd.ckptconv+json"


@pytest.fixture
def api(redis_url: str, s3_server: str, tmp_path: Path) -> Iterator[SimpleNamespace]:
    prefix = f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
    settings = Settings(environment="development", redis_url=redis_url, redis_prefix=prefix, max_body_bytes=4096)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = RedisKeys(settings.redis_prefix, settings.broker_prefix)
    key, _ = create_key(r, keys, "team-a", ["s3://bucket/team-a/", f"{tmp_path}/"])
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            yield SimpleNamespace(
                client=client, auth={"Authorization": f"Bearer {key}"}, redis=r, keys=keys, settings=settings
            )
    finally:
        drop_prefix(r, prefix)


def post(api: SimpleNamespace, content_type: str | None, body: bytes | Iterator[bytes], **headers: str):
    h = {**api.auth, **headers}
    if content_type is not None:
        h["Content-Type"] = content_type
    return api.client.post("/v1/jobs", content=body, headers=h)


def both(api: SimpleNamespace, body: bytes, **headers: str) -> tuple:
    return post(api, SHORT, body, **headers), post(api, ROUTE, body, **headers)


def same_problem(short, route) -> dict:
    assert short.status_code == route.status_code, (short.text, route.text)
    assert short.headers["content-type"] == route.headers["content-type"] == "application/problem+json"
    assert short.json() == route.json()
    return short.json()


def encode(doc: object) -> bytes:
    return json.dumps(doc).encode()


def test_a_job_is_created_alike_both_ways(api, tmp_path: Path) -> None:
    extra = {"labels": {"a": "b"}, "max_runtime_seconds": 60, "options": {"dtype": "bfloat16"}}
    short = post(api, SHORT, encode(job_body(1, **extra)))
    route = post(api, ROUTE, encode(job_body(11, **extra)))
    assert short.status_code == route.status_code == 202
    assert short.headers["content-type"] == route.headers["content-type"] == "application/json"
    # The same headers, in the same order (the short way sends raw ASGI messages, the route a Response).
    assert [name for name, _ in short.headers.raw] == [name for name, _ in route.headers.raw]
    assert short.headers["content-length"] == str(len(short.content))
    one, other = short.json(), route.json()
    assert (
        short.headers["location"] == f"/v1/jobs/{one['id']}" and route.headers["location"] == f"/v1/jobs/{other['id']}"
    )
    assert (
        one["target"]["uri"] == job_body(1)["target"]["uri"] and other["target"]["uri"] == job_body(11)["target"]["uri"]
    )
    varying = ("id", "links", "created_at", "updated_at", "source", "target")
    assert {k: v for k, v in one.items() if k not in varying} == {k: v for k, v in other.items() if k not in varying}
    # The same target twice: the second is refused, either way.
    local = {"kind": "convert", "source": {"uri": f"{tmp_path}/in.safetensors"}}
    first = post(api, SHORT, encode({**local, "target": {"uri": f"{tmp_path}/a/out.mdl", "format": "cs-h5"}}))
    assert first.status_code == 202
    again = encode({**local, "target": {"uri": f"{tmp_path}/a/out.mdl/", "format": "cs-h5"}})
    doc = same_problem(*both(api, again))
    assert doc["code"] == "target_taken" and first.json()["id"] in doc["detail"]
    # Data already at a target.
    (tmp_path / "there.mdl").write_bytes(b"x")
    taken = encode({**local, "target": {"uri": f"{tmp_path}/there.mdl", "format": "cs-h5"}})
    assert same_problem(*both(api, taken))["code"] == "target_taken"


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{not json",
        b"[" * 3000,  # parsing it recurses too deep (RecursionError, not a ValueError)
        encode({**job_body(), "labels": 0}).replace(b": 0", b": " + b"[" * 1500 + b"]" * 1500),
        b"\xff\xfe",
        b"[]",
        b"null",
        b'"convert"',
        encode({"kind": "convert", "source": {"uri": "s3://bucket/team-a/x"}}),
        encode({**job_body(), "kind": "teleport"}),
        encode({**job_body(), "kind": 7}),
        encode({**job_body(), "surprise": True}),
        encode({**job_body(), "options": {"shard_size": "5 parsecs"}}),
        encode({**job_body(), "labels": {"bad key!": "x"}}),
        encode({**job_body(), "labels": {f"k{i}": "v" for i in range(33)}}),
        encode({**job_body(), "max_runtime_seconds": "60"}),
        encode({**job_body(), "max_runtime_seconds": 10**9}),
        encode({**job_body(), "webhook": {"url": "ftp://example.com/hook"}}),
        encode({**job_body(), "webhook": {"url": "http://127.0.0.1/hook"}}),
        encode({**job_body(), "webhook": {"url": "https://example.com/hook", "secret": ""}}),
        encode({**job_body(), "source": {"uri": "s3://bucket/team-b/secret"}}),
        encode({**job_body(), "source": {"uri": "s3://bucket/team-a/../team-b/x"}}),
        encode({**job_body(), "source": {"uri": "relative/x"}}),
        encode({**job_body(), "source": {"uri": "/etc/passwd"}}),
        encode({**job_body(), "source": {"uri": "http://example.com/x"}}),
    ],
)
def test_refusals_are_the_same_problem_both_ways(api, body: bytes) -> None:
    doc = same_problem(*both(api, body))
    assert doc["status"] in (400, 403, 409, 422), doc


def test_the_body_limit_and_content_types(api) -> None:
    big = encode({**job_body(), "labels": {"x": "y" * 200}}) + b" " * 5000
    assert same_problem(*both(api, big))["code"] == "payload_too_large"  # declared length
    chunks = [b'{"kind": "convert", ', b" " * 3000, b" " * 3000, b"}"]
    short, route = post(api, SHORT, iter(chunks)), post(api, ROUTE, iter(chunks))  # chunked: read until too much
    assert same_problem(short, route)["code"] == "payload_too_large"
    # Bodies FastAPI does not read as JSON, with a content type or without, are invalid requests.
    for content_type in ("text/plain", None, "application/json-patch"):
        assert_problem(post(api, content_type, encode(job_body(9))), 422, "invalid_request")
    # Parameters of application/json do not matter.
    assert post(api, "Application/JSON; charset=utf-8", encode(job_body(10))).status_code == 202


def test_idempotency_keys_replay_across_both_ways(api) -> None:
    body = encode(job_body(2))
    first = post(api, SHORT, body, **{"Idempotency-Key": "k-1"})
    assert first.status_code == 202
    for content_type in (SHORT, ROUTE):
        again = post(api, content_type, body, **{"Idempotency-Key": "k-1"})
        assert again.status_code == 202 and again.content == first.content
        assert again.headers["idempotent-replayed"] == "true" and again.headers["location"] == first.headers["location"]
    # The same body spelled differently (key order, spaces) is the same request.
    respelled = json.dumps(dict(reversed(list(job_body(2).items()))), indent=2).encode()
    assert post(api, SHORT, respelled, **{"Idempotency-Key": "k-1"}).content == first.content
    other = encode(job_body(3))
    assert same_problem(*both(api, other, **{"Idempotency-Key": "k-1"}))["code"] == "idempotency_key_reused"
    for bad in ("", "x" * 256):
        assert same_problem(*both(api, other, **{"Idempotency-Key": bad}))["code"] == "invalid_request"
    long_key = post(api, SHORT, other, **{"Idempotency-Key": "x" * 255})
    assert long_key.status_code == 202


def test_get_answers_the_job_or_404(api) -> None:
    job = post(api, SHORT, encode(job_body(4))).json()
    got = api.client.get(f"/v1/jobs/{job['id']}", headers=api.auth)
    assert got.status_code == 200 and got.headers["content-type"] == "application/json" and got.json() == job
    for missing in ("job_00000000000000000000000000000000", "not-an-id"):
        doc = assert_problem(api.client.get(f"/v1/jobs/{missing}", headers=api.auth), 404, "not_found")
        assert doc["instance"] == f"/v1/jobs/{missing}"
    assert_problem(api.client.get(f"/v1/jobs/{job['id']}"), 401, "unauthorized")
    # A read after any change of the record shows the change (documents are kept by their record).
    store = JobStore(api.redis, api.keys)
    progress = {"stage": "converting", "tensors_done": 1, "tensors_total": 2, "bytes_done": 5, "bytes_total": 9}
    for change in (
        lambda: store.progress(job["id"], progress),
        lambda: store.set_fields(job["id"], {"attempts": 3}),
        lambda: store.transition(job["id"], ("queued",), "cancelled"),
    ):
        before = api.client.get(f"/v1/jobs/{job['id']}", headers=api.auth).json()
        change()
        after = api.client.get(f"/v1/jobs/{job['id']}", headers=api.auth).json()
        assert after != before and after == job_resource(store.get(job["id"]))
    assert after["progress"] == progress and after["attempts"] == 3 and after["state"] == "cancelled"


def test_an_unhandled_error_is_the_same_logged_500_both_ways(api, monkeypatch, caplog) -> None:
    async def boom(*args: object) -> None:
        raise RuntimeError("the bug's own words")

    monkeypatch.setattr("service.hot.create", boom)  # the short way
    monkeypatch.setattr("service.routes.jobs.create", boom)  # the route (submit)
    with caplog.at_level(logging.ERROR, logger="ckptconv.api"):
        short, route = both(api, encode(job_body(5)))
    docs = []
    for r in (short, route):
        doc = assert_problem(r, 500, "internal_error")
        assert r.headers["correlation-id"] == doc["correlation_id"] and "the bug's own words" not in r.text
        logged = [rec for rec in caplog.records if doc["correlation_id"] in rec.getMessage()]
        assert len(logged) == 1 and "POST /v1/jobs" in logged[0].getMessage()
        assert logged[0].exc_info and "the bug's own words" in str(logged[0].exc_info[1])
        docs.append({k: v for k, v in doc.items() if k not in ("correlation_id", "detail")})
    assert docs[0] == docs[1]
    assert [name for name, _ in short.headers.raw] == [name for name, _ in route.headers.raw]

    # The status path too, and the error goes on to the server (which logs it), as from a route.
    monkeypatch.setattr("service.hot.job_document", boom)
    doc = assert_problem(api.client.get("/v1/jobs/job_1", headers=api.auth), 500, "internal_error")
    assert doc["instance"] == "/v1/jobs/job_1"
    with TestClient(create_app(api.settings)) as raising:
        for content_type in (SHORT, ROUTE):
            with pytest.raises(RuntimeError, match="the bug's own words"):
                headers = {**api.auth, "Content-Type": content_type}
                raising.post("/v1/jobs", content=encode(job_body(6)), headers=headers)
        with pytest.raises(RuntimeError, match="the bug's own words"):
            raising.get("/v1/jobs/job_1", headers=api.auth)


def test_lifespan_events_reach_fastapi(redis_url: str) -> None:
    prefix = f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
    app = create_app(Settings(environment="development", redis_url=redis_url, redis_prefix=prefix))
    events = []
    lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def observed(app_: object) -> AsyncIterator[None]:
        async with lifespan(app_):
            events.append("startup")
            yield
        events.append("shutdown")

    app.router.lifespan_context = observed
    with TestClient(app) as client:
        assert events == ["startup"] and isinstance(app.state.ckptconv, AppState)
        assert client.get("/v1/formats").status_code == 200
    assert events == ["startup", "shutdown"]
