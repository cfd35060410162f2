"""The edges of the API, against real Redis and real API processes: authentication before the body is
read, the body size limit, per-key rate limits shared by API processes, the caps on event streams and
on the Redis connections they hold, and server errors that show a correlation id instead of internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import pytest
import redis
from conftest import api_process, free_port  # the suite's conftest, as pytest loaded it
from fastapi.testclient import TestClient
from test_api import assert_problem, drop_prefix, job_body

from ckptconv.core.auth import create_key
from ckptconv.core.errors import CkptconvError, ObjectNotFound, StorageError
from ckptconv.core.jobstore import RedisKeys
from ckptconv.core.settings import Settings
from service.app import create_app
from service.problems import problem_response

MIB = 1 << 20


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    prefix = f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
    yield prefix
    drop_prefix(redis.Redis.from_url(redis_url), prefix)


def in_process(redis_url: str, prefix: str, **settings: object) -> SimpleNamespace:
    s = Settings(environment="development", redis_url=redis_url, redis_prefix=prefix, **settings)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = RedisKeys(s.redis_prefix, s.broker_prefix)
    key, rec = create_key(r, keys, "team-a", ["s3://bucket/team-a/"])
    return SimpleNamespace(settings=s, redis=r, keys=keys, key_id=rec["id"], auth={"Authorization": f"Bearer {key}"})


# --- in process ---------------------------------------------------------------------------------


def test_authentication_comes_before_the_body_is_parsed(redis_url: str, prefix: str) -> None:
    env = in_process(redis_url, prefix)
    with TestClient(create_app(env.settings), raise_server_exceptions=False) as c:
        garbage = b'{"kind": [[[[[[' * 1000
        assert_problem(c.post("/v1/jobs", content=garbage), 401, "unauthorized")
        assert_problem(
            c.post("/v1/plans", content=garbage, headers={"Authorization": "Bearer no"}), 401, "unauthorized"
        )
        # With a key, the same body is parsed (and refused as what it is).
        assert_problem(c.post("/v1/jobs", content=garbage, headers=env.auth), 422, "invalid_request")
        # The catalog needs no key.
        assert c.get("/v1/formats").status_code == 200


def test_a_body_over_the_limit_is_413(redis_url: str, prefix: str, s3_server: str) -> None:
    # s3_server: the accepted submission's target is checked on S3 (without a server the API's
    # client would go to AWS, and the test passed only after another one had started moto).
    env = in_process(redis_url, prefix, max_body_bytes=64 * 1024)
    with TestClient(create_app(env.settings), raise_server_exceptions=False) as c:
        body = job_body(labels={f"k{i}": "v" * 60 for i in range(2000)})
        doc = assert_problem(c.post("/v1/jobs", json=body, headers=env.auth), 413, "payload_too_large")
        assert "65536" in doc["detail"]
        assert c.post("/v1/jobs", json=job_body(), headers=env.auth).status_code == 202


def test_the_rate_limit_is_per_key_and_shared_by_api_processes(redis_url: str, prefix: str) -> None:
    env = in_process(redis_url, prefix, rate_limit_per_second=10)
    # The current window of this key has 3 requests left and ends in a minute: two processes
    # (two applications on one Redis) together get exactly 3, then 429 until the window ends.
    env.redis.set(env.keys.rate(env.key_id), 7, px=60_000)
    with (
        TestClient(create_app(env.settings), raise_server_exceptions=False) as one,
        TestClient(create_app(env.settings), raise_server_exceptions=False) as two,
    ):
        answers = [(one, two)[i % 2].get("/v1/jobs", headers=env.auth) for i in range(8)]
        assert [r.status_code for r in answers] == [200, 200, 200, 429, 429, 429, 429, 429]
        refused = assert_problem(answers[-1], 429, "rate_limited")
        assert "10 requests per second" in refused["detail"]
        assert 1 <= int(answers[-1].headers["retry-after"]) <= 60
        # Another key has its own budget; the catalog is not counted.
        other, _ = create_key(env.redis, env.keys, "team-b", ["s3://bucket/team-b/"])
        assert one.get("/v1/jobs", headers={"Authorization": f"Bearer {other}"}).status_code == 200
        assert one.get("/v1/formats").status_code == 200


def test_server_errors_show_a_correlation_id_and_log_the_details(caplog: pytest.LogCaptureFixture) -> None:
    s = Settings(environment="development", auth_disabled=True, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with (
        caplog.at_level(logging.ERROR, logger="ckptconv.api"),
        TestClient(create_app(s), raise_server_exceptions=False) as c,
    ):
        r = c.post("/v1/jobs", json=job_body())
    doc = assert_problem(r, 503, "service_unavailable")
    assert "Connection" not in r.text and "127.0.0.1" not in r.text
    assert r.headers["correlation-id"] == doc["correlation_id"]
    logged = [rec.getMessage() for rec in caplog.records if doc["correlation_id"] in rec.getMessage()]
    assert logged and "ConnectionError" in logged[0]

    # A worker's storage failure naming its endpoint: the client sees the class, not the text.
    error = StorageError("could not connect to the endpoint URL: http://10.1.2.3:9000/bucket?x=1", endpoint="x")
    body = json.loads(problem_response(error, "/v1/plans", method="POST").body)
    assert body["code"] == "storage_error" and "10.1.2.3" not in json.dumps(body) and "details" not in body


# --- real API processes -------------------------------------------------------------------------


@pytest.fixture
def served(redis_url: str, s3_server: str, prefix: str, tmp_path: Path) -> Iterator[SimpleNamespace]:
    """One API process with two keys (a, b), small stream caps and a 1 MiB body limit."""
    keys = {name: f"ckc_{name}-{uuid.uuid4().hex}" for name in ("a", "b")}
    env = {
        "CKPTCONV_MAX_BODY_BYTES": str(MIB),
        "CKPTCONV_MAX_STREAMS_PER_KEY": "2",
        "CKPTCONV_REDIS_BLOCKING_CONNECTIONS": "3",
        "CKPTCONV_REDIS_POOL_TIMEOUT_SECONDS": "1",
        "CKPTCONV_PLAN_TIMEOUT_SECONDS": "5",
    }
    prefixes = {k: [f"s3://bucket/team-{n}/"] for n, k in keys.items()}
    with api_process(redis_url, tmp_path, prefix, prefixes, env) as url:
        yield SimpleNamespace(url=url, **{n: {"Authorization": f"Bearer {k}"} for n, k in keys.items()})


def _raw_post(url: str, headers: list[str], body_chunks: Iterator[bytes], give_up_after: int) -> tuple[bytes, int]:
    """POST over a plain socket, sending body chunks only while the server has not answered.

    Returns (the answer's status line, bytes of body sent). Stops sending after ``give_up_after``
    bytes: a server that read them all did not enforce a limit while reading."""
    where = urlsplit(url)
    sock = socket.create_connection((where.hostname, where.port), timeout=30)
    sent = 0
    try:
        sock.sendall(("\r\n".join(["POST /v1/jobs HTTP/1.1", f"Host: {where.netloc}", *headers]) + "\r\n\r\n").encode())
        for chunk in body_chunks:
            readable, writable, _ = select.select([sock], [sock], [], 30)
            if readable or sent >= give_up_after:
                break
            if writable:
                try:
                    sent += sock.send(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    break
        select.select([sock], [], [], 30)
        return sock.recv(65536).split(b"\r\n", 1)[0], sent
    finally:
        sock.close()


def _zeros(size: int) -> Iterator[bytes]:
    while True:
        yield b"0" * size


def _chunked(size: int) -> Iterator[bytes]:
    for chunk in _zeros(size):
        yield f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"


def test_a_50_mib_body_is_never_read(served: SimpleNamespace) -> None:
    fifty = 50 * MIB
    declared = [f"Content-Length: {fifty}", "Content-Type: application/json"]
    # Without a key: 401 before any of the body.
    status, sent = _raw_post(served.url, declared, _zeros(64 * 1024), fifty)
    assert status.startswith(b"HTTP/1.1 401") and sent < fifty
    # With a key, a declared 50 MiB: 413 at once.
    auth = f"Authorization: {served.a['Authorization']}"
    status, sent = _raw_post(served.url, [*declared, auth], _zeros(64 * 1024), fifty)
    assert status.startswith(b"HTTP/1.1 413") and sent < fifty
    # With a key, chunked (no length given): 413 once the bytes read pass the limit.
    chunked = ["Transfer-Encoding: chunked", "Content-Type: application/json", auth]
    status, sent = _raw_post(served.url, chunked, _chunked(64 * 1024), fifty)
    assert status.startswith(b"HTTP/1.1 413") and sent < fifty


def _answers_until_closed(sock: socket.socket, seconds: float = 10) -> bytes:
    """Everything the server sends until it closes the connection (a server that keeps it open
    fails the test after ``seconds``)."""
    sock.settimeout(seconds)
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open after answering {answer[:200]!r}") from None
    except ConnectionResetError:
        pass
    return answer


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/plans"])  # the hot path (service.hot), and FastAPI's routes
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_413_closes_the_connection_whose_body_it_does_not_read(
    served: SimpleNamespace, framing: str, path: str
) -> None:
    # The rest of a refused body is never read, so the connection cannot carry another request: the
    # 413 says Connection: close and the server closes it. (Kept open, the server would have to read
    # and discard the whole body a keep-alive client goes on sending, or take its bytes for the
    # next request: here a request smuggled at the head of the body.)
    where = urlsplit(served.url)
    auth = f"Authorization: {served.a['Authorization']}"
    smuggled = f"GET /v1/jobs HTTP/1.1\r\nHost: {where.netloc}\r\n{auth}\r\n\r\n"
    head = [f"POST {path} HTTP/1.1", f"Host: {where.netloc}", "Content-Type: application/json"]
    head.append(auth)
    if framing == "length":
        head.append(f"Content-Length: {2 * MIB}")
        body = smuggled.encode() + b"0" * (64 * 1024)
    else:
        head.append("Transfer-Encoding: chunked")
        chunk = smuggled.encode() + b"0" * (MIB + 1)
        body = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(body)
        answer = _answers_until_closed(sock)
    status, _, rest = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"connection: close" in status.lower()
    assert b"HTTP/1.1" not in rest, answer  # one answer only


def test_a_body_that_stops_arriving_is_408_and_its_connection_closed(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    # A client that declares 1000 bytes, sends 10 and stops would hold its connection (and a file
    # descriptor of the server) forever: it is answered 408 and the server closes the connection.
    key = f"ckc_slow-{uuid.uuid4().hex}"
    env = {"CKPTCONV_BODY_READ_TIMEOUT_SECONDS": "1"}
    with api_process(redis_url, tmp_path, prefix, {key: ["s3://bucket/team/"]}, env) as url:
        where = urlsplit(url)
        for path in ("/v1/jobs", "/v1/plans"):  # the hot path (service.hot), and FastAPI's routes
            head = [f"POST {path} HTTP/1.1", f"Host: {where.netloc}", "Content-Type: application/json"]
            head += [f"Authorization: Bearer {key}", "Content-Length: 1000"]
            sock = socket.create_connection((where.hostname, where.port), timeout=10)
            try:
                started = time.monotonic()
                sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + b'{"kind": "')
                answer = b""
                while chunk := sock.recv(65536):  # until the server closes (a timeout fails the test)
                    answer += chunk
                elapsed = time.monotonic() - started
            finally:
                sock.close()
            status, _, body = answer.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 408"), answer
            assert b"connection: close" in status.lower() and b"application/problem+json" in status
            assert json.loads(body)["code"] == "body_timeout"
            assert 0.9 < elapsed < 8, (path, elapsed)


def _closed_by_server(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    try:
        return bool(readable) and sock.recv(65536) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("workers", [1, 2])
def test_connections_whose_request_head_does_not_arrive_are_closed(
    redis_url: str, prefix: str, tmp_path: Path, workers: int
) -> None:
    # uvicorn waits for a head without limit: a connection that sends nothing, or a header line now
    # and then (slowloris), was held forever. Both are closed; a prompt request is served.
    env = {"CKPTCONV_HEAD_READ_TIMEOUT_SECONDS": "1"}
    keys = {f"ckc_head-{uuid.uuid4().hex}": ["s3://bucket/team/"]}
    with api_process(redis_url, tmp_path, prefix, keys, env, workers=workers) as url:
        where = urlsplit(url)
        idle = socket.create_connection((where.hostname, where.port), timeout=10)
        drip = socket.create_connection((where.hostname, where.port), timeout=10)
        try:
            drip.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
            started = time.monotonic()
            closed: dict[str, float] = {}
            while len(closed) < 2 and time.monotonic() - started < 8:
                time.sleep(0.25)
                if "drip" not in closed:
                    try:
                        drip.sendall(b"X-Slow: 1\r\n")  # every line comes before uvicorn's keep-alive timeout
                    except (BrokenPipeError, ConnectionResetError):
                        closed["drip"] = time.monotonic() - started
                    else:
                        if _closed_by_server(drip):
                            closed["drip"] = time.monotonic() - started
                if "idle" not in closed and _closed_by_server(idle):
                    closed["idle"] = time.monotonic() - started
            assert set(closed) == {"idle", "drip"}, closed
            assert all(0.75 < t < 4 for t in closed.values()), closed
        finally:
            idle.close()
            drip.close()
        with socket.create_connection((where.hostname, where.port), timeout=10) as prompt:
            for _ in range(2):  # a keep-alive connection's next request is served as well
                prompt.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
                answer = b""
                while not answer.endswith(b"}"):  # the head, then the JSON body (maybe two reads)
                    answer += prompt.recv(65536)
                assert answer.startswith(b"HTTP/1.1 200")
                time.sleep(0.5)


@contextlib.contextmanager
def _stream(url: str, headers: dict[str, str]) -> Iterator[httpx.Response]:
    with httpx.Client(timeout=httpx.Timeout(30.0)) as c, c.stream("GET", url, headers=headers) as r:
        lines = r.iter_lines()  # held until the block ends: dropping it would close the connection
        if r.status_code == 200:
            next(lines)  # the first event: the stream is being served
        else:
            r.read()
        yield r


def test_event_streams_are_capped_per_key_and_per_process(served: SimpleNamespace) -> None:
    jobs = {
        n: httpx.post(served.url + "/v1/jobs", json=job_body(team=f"team-{n}"), headers=getattr(served, n)).json()
        for n in ("a", "b")
    }
    events = {n: f"{served.url}/v1/jobs/{jobs[n]['id']}/events" for n in jobs}
    with contextlib.ExitStack() as open_streams:
        first = open_streams.enter_context(_stream(events["a"], served.a))
        second = open_streams.enter_context(_stream(events["a"], served.a))
        assert first.status_code == second.status_code == 200
        with _stream(events["a"], served.a) as third:
            assert third.status_code == 429 and third.json()["code"] == "too_many_streams"
            assert int(third.headers["retry-after"]) >= 1
        # Key b has its own cap, but this process holds at most 3 streams (its blocking Redis pool).
        open_streams.enter_context(_stream(events["b"], served.b))
        with _stream(events["b"], served.b) as over:
            assert over.status_code == 503 and over.json()["code"] == "service_unavailable"
        # Every blocking connection is taken: a dry run's wait gets 503 instead of another connection.
        plan = httpx.post(served.url + "/v1/plans", json=job_body(team="team-b"), headers=served.b, timeout=30)
        assert_problem(plan, 503, "service_unavailable")
    # Closed streams give their slots back.
    for _ in range(100):
        with _stream(events["a"], served.a) as again:
            if again.status_code == 200:
                break
        time.sleep(0.1)
    assert again.status_code == 200


def test_concurrent_requests_within_the_limit_all_pass(redis_url: str, prefix: str, tmp_path: Path) -> None:
    # 100 requests at once, well within 2,000 per second: the process asks Redis for one share of
    # the budget for all of them (not one share each, which would exhaust the window and refuse).
    key = f"ckc_many-{uuid.uuid4().hex}"

    async def burst(url: str) -> list[int]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as c:
            auth = {"Authorization": f"Bearer {key}"}
            answers = await asyncio.gather(*(c.get("/v1/jobs", headers=auth) for _ in range(100)))
        return [a.status_code for a in answers]

    with api_process(
        redis_url, tmp_path, prefix, {key: ["s3://b/"]}, {"CKPTCONV_RATE_LIMIT_PER_SECOND": "2000"}
    ) as url:
        assert set(asyncio.run(burst(url))) == {200}


def test_a_bounded_pool_makes_commands_wait_for_a_connection_then_gives_up(redis_url: str, prefix: str) -> None:
    import redis.asyncio
    import redis.exceptions

    from service.limits import BoundedPool

    async def scenario() -> None:
        pool = BoundedPool.from_url(redis_url, decode_responses=True, max_connections=2, timeout=1)
        client = redis.asyncio.Redis.from_pool(pool)
        try:
            # 20 commands at once share 2 connections: each waits for one, none fails.
            answers = await asyncio.gather(*(client.incr(prefix + "n") for _ in range(20)))
            assert sorted(answers) == list(range(1, 21))
            assert len(pool._available_connections) + len(pool._in_use_connections) == 2
            # Both connections held by blocking waits: the next command gives up after the timeout.
            held = [asyncio.create_task(client.blpop([prefix + "never"], timeout=5)) for _ in range(2)]
            while len(pool._in_use_connections) < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(redis.exceptions.ConnectionError):
                await client.get(prefix + "n")
            for task in held:
                task.cancel()
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_connection_released_while_it_disconnects_goes_back_to_the_pool(redis_url: str, prefix: str) -> None:
    # Redis asked the connection to reconnect (a maintenance notice) and the command's task is
    # cancelled while it disconnects: the pool's slot must not stay taken for good.
    import redis.asyncio

    from service.limits import BoundedPool

    async def scenario() -> None:
        pool = BoundedPool.from_url(redis_url, decode_responses=True, max_connections=1, timeout=1)
        client = redis.asyncio.Redis.from_pool(pool)
        try:
            connection = await pool.get_connection()
            slow = asyncio.Event()

            async def disconnect(*_: object, **__: object) -> None:
                slow.set()
                await asyncio.sleep(10)

            connection.should_reconnect = lambda: True
            connection.disconnect = disconnect
            releasing = asyncio.create_task(pool.release(connection))
            await slow.wait()
            releasing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await releasing
            assert not pool._in_use_connections and pool._available_connections == [connection]
            del connection.should_reconnect, connection.disconnect
            assert await client.incr(prefix + "after") == 1  # the one connection serves again
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_workers_server_error_reaches_the_client_as_its_correlation_id_only(caplog: pytest.LogCaptureFixture) -> None:
    worker_log = logging.getLogger("ckptconv.worker")
    try:
        raise KeyError("ContentLength")
    except KeyError as e:
        with caplog.at_level(logging.ERROR, logger="ckptconv.worker"):
            shown = CkptconvError(f"unexpected {type(e).__name__}: {e}").logged(worker_log, "job job_x", e)
    problem = shown.to_problem()  # what the worker records on the job, or answers a dry run with
    assert problem["code"] == "internal_error" and "KeyError" not in json.dumps(problem)
    assert problem["correlation_id"] in caplog.text and "KeyError: 'ContentLength'" in caplog.text
    # Through the API the worker's correlation id stays (it is not logged a second time).
    rebuilt = CkptconvError.from_problem(problem)
    body = json.loads(problem_response(rebuilt, "/v1/plans", method="POST").body)
    assert body["correlation_id"] == problem["correlation_id"] and body["detail"] == problem["detail"]
    # Client errors are shown as they are.
    assert StorageError("x").public(worker_log, "w").message != "x"
    assert ObjectNotFound("no object s3://b/k").public(worker_log, "w").message == "no object s3://b/k"


def test_the_edge_asks_for_a_key_exactly_where_the_routes_do() -> None:
    from service.edges import needs_key

    doc = json.loads((Path(__file__).resolve().parent.parent / "openapi" / "openapi.json").read_text())
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert ("401" in op["responses"]) == needs_key(path), (method, path)
