"""Completion webhooks: destinations refused at submit and re-checked at every delivery (the
connection goes to the address checked, so DNS rebinding cannot redirect it), and transient failures
(connect errors, 5xx, name resolution) retried with backoff by a real worker.

Name resolution is the one thing replaced here, by a resolver function passed in (``getaddrinfo``):
it stands for a DNS server whose answers change, which a test cannot otherwise control.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import free_port
from fastapi.testclient import TestClient
from test_api import assert_problem, drop_prefix, job_body
from test_e2e_service import Service, wait_for

from ckptconv.core.auth import create_key
from ckptconv.core.errors import WebhookRefused
from ckptconv.core.job_records import job_resource, new_record
from ckptconv.core.jobstore import RedisKeys
from ckptconv.core.settings import Settings
from ckptconv.core.webhooks import Unresolvable, delivery_error, post, resolve_destination
from service.app import create_app
from service.queue import TaskMessages

SECRET = "whsec_dGVzdC1vbmx5LXNlY3JldC1mb3Itd2ViaG9va3M="
REFUSED = [
    "http://127.0.0.1:9/hook",
    "http://localhost:8080/hook",
    "http://[::1]/hook",
    "http://169.254.169.254/latest/meta-data/",
    "http://10.1.2.3/hook",
    "http://192.168.0.1/hook",
    "http://100.64.0.1/hook",  # shared address space (carrier-grade NAT)
    "http://0.0.0.0/hook",
    "http://[fe80::1]/hook",
    "http://[::ffff:127.0.0.1]/hook",
    "http://2130706433/hook",  # 127.0.0.1 written as one number
    "http://nonexistent.invalid/hook",  # a name that does not exist
    "http://[::1/hook",  # URLs the standard library cannot split: refused, never a 500
    "http://[not-an-address]/hook",
]


@pytest.fixture
def production_api(redis_url: str, s3_server: str) -> Iterator[tuple[TestClient, dict[str, str]]]:
    prefix = f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
    settings = Settings(environment="production", webhook_secret=SECRET, redis_url=redis_url, redis_prefix=prefix)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key, _ = create_key(r, RedisKeys(prefix), "team-a", ["s3://bucket/team-a/"])
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            yield client, {"Authorization": f"Bearer {key}"}
    finally:
        drop_prefix(r, prefix)


@pytest.mark.parametrize("url", REFUSED)
def test_private_loopback_and_link_local_webhooks_are_refused_at_submit(production_api, url: str) -> None:
    client, auth = production_api
    r = client.post("/v1/jobs", json=job_body(webhook={"url": url}), headers=auth)
    assert_problem(r, 422, "webhook_refused")
    assert client.get("/v1/jobs", headers=auth).json()["jobs"] == []


def test_a_refused_webhook_never_tells_the_submitter_where_a_name_points(production_api) -> None:
    # The submitter chose the name; the address it has inside the service's network is not theirs to learn.
    client, auth = production_api
    doc = assert_problem(
        client.post("/v1/jobs", json=job_body(webhook={"url": "http://localhost/hook"}), headers=auth),
        422,
        "webhook_refused",
    )
    assert "127.0.0.1" not in json.dumps(doc) and "::1" not in json.dumps(doc), doc


def test_a_public_webhook_is_accepted(production_api) -> None:
    client, auth = production_api
    r = client.post("/v1/jobs", json=job_body(webhook={"url": "https://93.184.216.34/hook"}), headers=auth)
    assert r.status_code == 202, r.text


def _answers(address: str):
    """A resolver that answers ``address`` for every name."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET

    def getaddrinfo(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        return [(family, socket.SOCK_STREAM, 6, "", (address, port))]

    return getaddrinfo


class _Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        status = self.server.statuses.pop(0) if self.server.statuses else 204  # type: ignore[attr-defined]
        self.server.seen.append((self.headers["host"], status))  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _no_dns(*args: Any, **kwargs: Any) -> list[Any]:
    raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")


def _receiver(port: int = 0, statuses: list[int] | None = None) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Receiver)
    server.seen, server.statuses = [], list(statuses or [])  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_delivery_rechecks_the_name_and_connects_to_the_address_it_checked() -> None:
    server = _receiver()
    port = server.server_port
    url = f"http://hooks.example.test:{port}/hook"
    try:
        # The name now answers a loopback address (it was public at submit: rebinding): refused.
        with pytest.raises(WebhookRefused):
            post(url, b"{}", {}, timeout=5, allow_private=False, getaddrinfo=_answers("127.0.0.1"))
        assert server.seen == []  # type: ignore[attr-defined]
        # Where private networks are allowed, the request goes to the address resolved, by name.
        status = post(url, b"{}", {}, timeout=5, allow_private=True, getaddrinfo=_answers("127.0.0.1"))
        assert status == 204 and server.seen == [(f"hooks.example.test:{port}", 204)]  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()

    with pytest.raises(Unresolvable):  # transient: the worker retries it
        resolve_destination(url, allow_private=False, getaddrinfo=_no_dns)
    with pytest.raises(WebhookRefused):
        resolve_destination("file:///etc/passwd", allow_private=True)
    # Every address counts: one private address among public ones refuses the name.
    mixed = _answers("93.184.216.34")

    def two(host: str, port: int, *a: Any, **k: Any) -> list[Any]:
        return mixed(host, port) + _answers("10.0.0.7")(host, port)

    with pytest.raises(WebhookRefused):
        resolve_destination("http://hooks.example.test/", allow_private=False, getaddrinfo=two)


def _ended_job_with_hook(svc: Service, auth: dict[str, str], port: int) -> dict[str, Any]:
    """A job with a webhook to ``port`` on loopback, cancelled at once: it ends either way, so the hook fires."""
    body = {
        "kind": "convert",
        "source": {"uri": f"s3://{svc.bucket}/team/in.safetensors"},
        "target": {"uri": f"s3://{svc.bucket}/team/out/model.mdl", "format": "cs-h5"},
        "webhook": {"url": f"http://127.0.0.1:{port}/hook", "secret": SECRET},
    }
    job = httpx.post(svc.url + "/v1/jobs", json=body, headers=auth).raise_for_status().json()
    httpx.post(f"{svc.url}/v1/jobs/{job['id']}/cancel", headers=auth)
    return job


def test_a_worker_retries_connect_errors_and_5xx_until_delivered(redis_url: str, tmp_path: Path) -> None:
    svc = Service(redis_url, f"wh-{uuid.uuid4().hex[:8]}", tmp_path, workers=1)
    port = free_port()  # nothing listens there yet: the first attempts cannot connect
    auth = {"Authorization": f"Bearer {svc.key}"}
    server = None
    try:
        job = _ended_job_with_hook(svc, auth, port)

        def hook() -> dict[str, Any]:
            return httpx.get(f"{svc.url}/v1/jobs/{job['id']}", headers=auth).json()["webhook"]

        first = wait_for(lambda: (h := hook())["attempts"] >= 1 and h)
        # A typed reason, never the exception text (which names the address and port it tried).
        assert first["delivered_at"] is None and first["last_error"] == "connect_error"
        server = _receiver(port, statuses=[503])  # up now, and failing once more
        done = wait_for(lambda: (h := hook())["delivered_at"] and h)
        assert done["last_status"] == 204 and done["attempts"] >= 3
        assert [status for _, status in server.seen] == [503, 204]  # type: ignore[attr-defined]
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        svc.stop()


def _attempt(url: str, *, allow_private: bool = True, **kwargs: Any) -> tuple[str | None, str]:
    """One real delivery attempt: its code and the exception text the code stands for."""
    try:
        status, failure = post(url, b"{}", {}, timeout=0.5, allow_private=allow_private, **kwargs), None
    except (WebhookRefused, Unresolvable, httpx.HTTPError) as e:
        status, failure = None, e
    return delivery_error(failure, status), str(failure)


def test_a_failed_attempt_is_typed_and_the_owner_never_sees_exception_text() -> None:
    closed = free_port()
    code, text = _attempt(f"http://127.0.0.1:{closed}/hook")
    assert code == "connect_error" and text  # the text (address, errno) stays in the worker's log
    assert _attempt(f"http://127.0.0.1:{closed}/hook", allow_private=False)[0] == "refused"

    assert _attempt("http://hooks.example.test/", getaddrinfo=_no_dns)[0] == "unresolvable"
    silent = socket.socket()  # accepts the connection, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        assert _attempt(f"http://127.0.0.1:{silent.getsockname()[1]}/hook")[0] == "timeout"
    finally:
        silent.close()
    server = _receiver(statuses=[503])
    port = server.server_port
    try:
        assert _attempt(f"http://127.0.0.1:{port}/hook")[0] == "http_status"
        assert _attempt(f"http://127.0.0.1:{port}/hook")[0] is None  # 204: delivered
    finally:
        server.shutdown()
        server.server_close()
    # A record written before the codes existed held exception text: the view shows a code.
    rec = new_record(
        "j1",
        owner="o",
        kind="convert",
        request={"source": {}, "max_runtime_seconds": 60, "webhook": {"url": "https://hooks.example.test/"}},
        webhook_secret=None,
        created=0,
        scopes=None,
    )
    rec["webhook_delivery"] = json.dumps({"attempts": 1, "last_error": "ConnectError: [Errno 111] 10.1.2.3:443"})
    assert job_resource(rec)["webhook"]["last_error"] == "transport_error"


@pytest.mark.parametrize(
    ("statuses", "posts"),
    [([503] * 50, 2), ([410], 1)],  # fails every time: the budget (2) ends it; 410 Gone ends it at once
)
def test_a_redelivered_webhook_message_never_goes_past_the_attempt_budget(
    redis_url: str, s3_server: str, tmp_path: Path, statuses: list[int], posts: int
) -> None:
    """A delivery message can come twice (a retry whose countdown outlasts the broker's visibility
    timeout is handed out again): every copy stops at CKPTCONV_WEBHOOK_MAX_ATTEMPTS, or at a 410,
    counted on the job, and nothing is POSTed after the worker gave up."""
    server = _receiver(statuses=statuses)
    svc = Service(
        redis_url, f"wh-{uuid.uuid4().hex[:8]}", tmp_path, env={"CKPTCONV_WEBHOOK_MAX_ATTEMPTS": "2"}, workers=1
    )
    worker = svc.procs[1]
    auth = {"Authorization": f"Bearer {svc.key}"}
    try:
        job = _ended_job_with_hook(svc, auth, server.server_port)

        def handled() -> int:  # deliver_webhook messages the worker finished with (retries are not counted)
            log = Path(worker.log_path).read_text()  # type: ignore[attr-defined]
            return sum("ckptconv.deliver_webhook[" in line and "succeeded in" in line for line in log.splitlines())

        wait_for(handled)
        assert len(server.seen) == posts  # type: ignore[attr-defined]
        # The broker hands the delivery out again, twice.
        message = TaskMessages(RedisKeys(svc.prefix)).render(
            "ckptconv.deliver_webhook", [job["id"]], queue="interactive"
        )
        svc.redis.lpush(f"{svc.prefix}q:interactive", message, message)
        wait_for(lambda: handled() >= 3)
        hook = httpx.get(f"{svc.url}/v1/jobs/{job['id']}", headers=auth).json()["webhook"]
        assert len(server.seen) == posts and hook["attempts"] == posts, (server.seen, hook)  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
        svc.stop()
