"""The client and the CLI resend requests on connection errors, 429 and 503, and a submission keeps
one Idempotency-Key through its retries, so a lost answer never makes a second job.

A real API process (real Redis) sits behind a loopback HTTP proxy of this module that injects the
faults: answers lost after the API handled the request, connections closed before it saw it, 503s.
The 429s are the API's own (its per-key rate limit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import redis
from conftest import ROOT, api_process
from test_api import drop_prefix

from ckptconv.client import Client
from ckptconv.core.auth import hash_key, principal_id
from ckptconv.core.errors import RateLimited
from ckptconv.core.jobstore import RedisKeys


class FaultyProxy:
    """Forwards HTTP requests to ``upstream``; each request takes the next fault of ``faults``:

    - ``drop``: forward, let the API answer, then close the connection without answering;
    - ``refuse``: close the connection without forwarding;
    - ``503``: answer 503 with ``Retry-After: 1`` without forwarding;
    - none left: forward and relay.

    ``seen`` records (method, path, Idempotency-Key, fault, the API's status) per request.
    """

    def __init__(self, upstream: str) -> None:
        self.faults: list[str] = []
        self.seen: list[tuple[str, str, str | None, str, int | None]] = []
        lock = threading.Lock()
        proxy = self
        http = httpx.Client(base_url=upstream, timeout=30)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with lock:
                    fault = proxy.faults.pop(0) if proxy.faults else "pass"
                key = self.headers.get("idempotency-key")
                if fault == "refuse":
                    proxy.seen.append((self.command, self.path, key, fault, None))
                    self.close_connection = True
                    return
                if fault == "503":
                    proxy.seen.append((self.command, self.path, key, fault, None))
                    self._answer(503, {"retry-after": "1", "content-type": "application/problem+json"}, b"{}")
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                upstream_answer = http.request(self.command, self.path, headers=headers, content=body)
                proxy.seen.append((self.command, self.path, key, fault, upstream_answer.status_code))
                if fault == "drop":
                    self.close_connection = True
                    return
                keep = ("content-type", "retry-after", "location", "idempotent-replayed")
                relayed = {k: v for k, v in upstream_answer.headers.items() if k.lower() in keep}
                self._answer(upstream_answer.status_code, relayed, upstream_answer.content)

            def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        self._http = http

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._http.close()


@pytest.fixture
def service(redis_url: str, s3_server: str, tmp_path: Path) -> Iterator[SimpleNamespace]:
    prefix = f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
    key = f"ckc_retry-{uuid.uuid4().hex}"
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        limit = {"CKPTCONV_RATE_LIMIT_PER_SECOND": "10"}
        with api_process(redis_url, tmp_path, prefix, {key: ["s3://bucket/team/"]}, limit) as url:
            proxy = FaultyProxy(url)
            try:
                yield SimpleNamespace(
                    url=url, proxy=proxy, key=key, redis=r, rate_key=RedisKeys(prefix).rate(principal_id(hash_key(key)))
                )
            finally:
                proxy.close()
    finally:
        drop_prefix(r, prefix)


def _jobs(service: SimpleNamespace) -> list[dict]:
    answer = httpx.get(service.url + "/v1/jobs", headers={"Authorization": f"Bearer {service.key}"})
    return answer.raise_for_status().json()["jobs"]


def test_a_submission_whose_answers_were_lost_makes_one_job(service: SimpleNamespace) -> None:
    service.proxy.faults = ["refuse", "drop", "drop"]
    with Client(service.proxy.url, service.key, backoff_seconds=0.05) as c:
        job = c.submit("s3://bucket/team/in.safetensors", "s3://bucket/team/out/model.mdl", to="cs-h5")
    posts = [s for s in service.proxy.seen if s[0] == "POST"]
    assert [s[3] for s in posts] == ["refuse", "drop", "drop", "pass"]
    # One key for every attempt; the API created the job once and replayed it afterwards.
    assert len({s[2] for s in posts}) == 1 and posts[0][2]
    assert [s[4] for s in posts] == [None, 202, 202, 202]
    assert [j["id"] for j in _jobs(service)] == [job["id"]]


def test_429_and_503_are_retried_after_retry_after(service: SimpleNamespace) -> None:
    # This key's window is used up for the next two seconds: the API answers 429 with Retry-After.
    service.redis.set(service.rate_key, 10, px=2000)
    with Client(service.proxy.url, service.key, backoff_seconds=0.05) as c:
        assert c.list()[0] == []
    assert [s[4] for s in service.proxy.seen] == [429, 200]

    service.proxy.seen.clear()
    service.proxy.faults = ["503", "503"]
    with Client(service.proxy.url, service.key, backoff_seconds=0.05) as c:
        assert c.list()[0] == []
    assert [s[3] for s in service.proxy.seen] == ["503", "503", "pass"]

    # Out of retries, the typed error reaches the caller.
    service.redis.set(service.rate_key, 10, px=5000)
    with Client(service.url, service.key, retries=0) as c, pytest.raises(RateLimited):
        c.list()


def _cli(service: SimpleNamespace, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CKPTCONV_URL": service.proxy.url, "CKPTCONV_API_KEY": service.key}
    return subprocess.run(
        [sys.executable, "-m", "ckptconv", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_cli_retries_too(service: SimpleNamespace) -> None:
    service.proxy.faults = ["drop", "503"]
    out = _cli(service, "submit", "s3://bucket/team/in.safetensors", "s3://bucket/team/o/m.mdl", "--to", "cs-h5")
    assert out.returncode == 0, out.stderr
    (job,) = _jobs(service)
    assert out.stdout.strip() == job["id"]
    service.proxy.faults = ["refuse"]
    out = _cli(service, "status", job["id"], "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["id"] == job["id"]
    # --retries 0: the first fault is the answer.
    service.proxy.faults = ["503"]
    out = _cli(service, "status", job["id"], "--retries", "0")
    assert out.returncode != 0 and "service_unavailable" in out.stderr + out.stdout
