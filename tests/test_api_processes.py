"""``ckptconv serve --workers N``: N API processes share the listening socket's connections evenly,
and a stuck, killed or stopped process does not stop the others serving.

Each test runs the real command and opens real connections; which process holds a connection is
read from /proc (the process's socket descriptors against the kernel's table of TCP connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import uvicorn
from test_api import drop_prefix

from bench.ports import free_port
from ckptconv.cli.api_processes import NOT_SERVING, STALE_SECONDS, BalancedServer, Slots

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads connections from /proc")

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"


class Serve:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log

    def children(self) -> list[int]:
        """The API processes (multiprocessing may also start a resource tracker beside them)."""
        children = []
        for entry in os.listdir("/proc"):
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            # stat: "pid (comm) state ppid ...", comm may hold spaces
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid and b"spawn_main" in cmdline:
                children.append(int(entry))
        return sorted(children)

    def wait_started(self, processes: int, startups: int = 0, timeout: float = 60.0) -> list[int]:
        """The API processes' pids once ``processes`` of them run and ``startups`` (default
        ``processes``) startups have finished (uvicorn logs each)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log.read_text(errors="replace").count("Application startup complete") >= (startups or processes):
                children = self.children()
                if len(children) == processes:
                    return children
            assert self.proc.poll() is None, self.log.read_text(errors="replace")
            time.sleep(0.1)
        raise AssertionError(f"{processes} API processes did not start:\n{self.log.read_text(errors='replace')}")

    def held_by(self, pids: list[int]) -> dict[int, int]:
        """How many established connections to the server's port each process holds."""
        established = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if not os.path.exists(table):
                continue
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if local_port == self.port and fields[3] == "01":  # 01: ESTABLISHED
                    established.add(fields[9])  # the socket's inode
        held = {}
        for pid in pids:
            inodes = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
            held[pid] = len(inodes & established)
        return held


@contextlib.contextmanager
def serving(redis_url: str, tmp_path: Path, hang_seconds: float | None = None) -> Iterator[Serve]:
    """``ckptconv serve --dev --workers 2`` on a free port (with ``hang_seconds``, ``serve()`` called
    as the command calls it, but with that limit)."""
    prefix = f"ckptconv-test-{uuid.uuid4().hex[:10]}:"
    port = free_port()
    env = {
        **os.environ,
        "CKPTCONV_REDIS_URL": redis_url,
        "CKPTCONV_REDIS_PREFIX": prefix,
        "CKPTCONV_STORAGE_PROBE_URI": f"{tmp_path}/",
    }
    if hang_seconds is None:
        args = [sys.executable, "-m", "ckptconv", "serve", "--dev", "--workers", "2", "--port", str(port)]
    else:
        env.update(CKPTCONV_ENVIRONMENT="development", CKPTCONV_AUTH_DISABLED="true")
        code = (
            "import sys, uvicorn; from ckptconv.cli.api_processes import serve; sys.exit(serve(uvicorn.Config("
            f"'service.app:create_app', factory=True, port={port}, workers=2), hang_seconds={hang_seconds}))"
        )
        args = [sys.executable, "-c", code]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield Serve(proc, port, log)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        drop_prefix(redis.Redis.from_url(redis_url), prefix)


@pytest.fixture
def serve(redis_url: str, tmp_path: Path) -> Iterator[Serve]:
    with serving(redis_url, tmp_path) as s:
        yield s


def connect(port: int, n: int) -> list[socket.socket]:
    """``n`` connections opened at once (as a client pool opens them), each answered once."""
    conns = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(n)]
    for c in conns:
        c.sendall(REQUEST)
    for c in conns:
        assert c.recv(65536).startswith(b"HTTP/1.1 200"), "a connection was not served"
    return conns


def test_connections_opened_at_once_are_shared_evenly(serve: Serve) -> None:
    pids = serve.wait_started(2)
    for _ in range(3):  # uvicorn's own mode gave 44/6 and 50/0 splits of 50 connections
        conns = connect(serve.port, 40)
        held = serve.held_by(pids)
        assert sum(held.values()) == 40 and min(held.values()) >= 18, held
        for c in conns:
            c.close()
        deadline = time.monotonic() + 10
        while sum(serve.held_by(pids).values()) and time.monotonic() < deadline:
            time.sleep(0.05)


def test_a_stopped_process_does_not_keep_connections_waiting(serve: Serve) -> None:
    stopped, running = serve.wait_started(2)
    idle = connect(serve.port, 2)  # one each: the stopped process looks no busier than the other
    os.kill(stopped, signal.SIGSTOP)
    try:
        # The running process holds back from each new connection only briefly, then takes it.
        conns = connect(serve.port, 10)
        assert serve.held_by([running])[running] >= 10
    finally:
        os.kill(stopped, signal.SIGCONT)
    for c in [*idle, *conns]:
        c.close()


def test_a_sibling_whose_event_loop_stopped_running_is_not_waited_for() -> None:
    slots = Slots(multiprocessing.get_context("spawn"), 3)
    slots.counts[:] = [2, 0, NOT_SERVING]
    now = time.monotonic()
    slots.beats[:] = [now, now, now]
    assert slots.waits_for(0, 2) == [1]  # less busy and running: worth a short wait
    assert slots.waits_for(1, 0) == []  # nobody is less busy than none
    slots.beats[1] = now - 2 * STALE_SECONDS  # stopped, stuck in a long call, ...
    assert slots.waits_for(0, 2) == []


def test_a_process_that_stops_running_is_killed_and_replaced(redis_url: str, tmp_path: Path) -> None:
    with serving(redis_url, tmp_path, hang_seconds=2) as serve:
        stopped, running = serve.wait_started(2)
        os.kill(stopped, signal.SIGSTOP)  # alive, holding its slot, but its event loop no longer runs
        deadline = time.monotonic() + 60
        while stopped in serve.children() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stopped not in serve.children(), "the stopped API process was not replaced"
        pids = serve.wait_started(2, startups=3)
        assert running in pids
        assert "has not run for 2 s; killing it" in serve.log.read_text()
        conns = connect(serve.port, 20)
        assert min(serve.held_by(pids).values()) >= 8
        for c in conns:
            c.close()


def test_a_killed_process_is_replaced_and_the_other_serves_meanwhile(serve: Serve) -> None:
    killed, survivor = serve.wait_started(2)
    os.kill(killed, signal.SIGKILL)
    for c in connect(serve.port, 5):
        c.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = serve.children()
        if len(children) == 2 and killed not in children and survivor in children:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the killed API process was not replaced: {serve.children()}")
    pids = serve.wait_started(2, startups=3)  # the replacement logs its own startup
    conns = connect(serve.port, 20)
    assert min(serve.held_by(pids).values()) >= 8
    for c in conns:
        c.close()


def test_sigterm_stops_every_process(serve: Serve) -> None:
    pids = serve.wait_started(2)
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(60) == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_sigquit_stops_every_process(serve: Serve) -> None:
    # By default it ended the supervisor alone (its processes serving on, with nobody to stop them).
    pids = serve.wait_started(2)
    serve.proc.send_signal(signal.SIGQUIT)
    assert serve.proc.wait(60) == 0
    assert all(gone(pid) for pid in pids)


def test_sigusr1_and_sigusr2_change_nothing(serve: Serve) -> None:
    # Sent to the supervisor or to the whole process group (as a terminal or `kill -- -PGID` sends
    # them), they ended the processes by default.
    pids = serve.wait_started(2)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        for pid in [serve.proc.pid, *pids]:
            os.kill(pid, sig)
    time.sleep(1.0)
    assert serve.proc.poll() is None, serve.log.read_text(errors="replace")
    assert serve.children() == pids
    for c in connect(serve.port, 4):  # still served
        c.close()
    assert "Received SIGUSR1; ignored" in serve.log.read_text(errors="replace")


def test_api_processes_stop_when_their_supervisor_is_killed(serve: Serve) -> None:
    pids = serve.wait_started(2)
    serve.proc.kill()  # SIGKILL: the supervisor can do nothing for its processes
    serve.proc.wait(10)
    try:
        deadline = time.monotonic() + 30
        while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(gone(pid) for pid in pids), "API processes went on serving without their supervisor"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_sighup_restarts_every_process_and_the_server_keeps_serving(serve: Serve) -> None:
    before = serve.wait_started(2)
    serve.proc.send_signal(signal.SIGHUP)  # by default it ended the parent alone, its processes serving on
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert serve.proc.poll() is None, serve.log.read_text(errors="replace")
        children = serve.children()
        if len(children) == 2 and not set(children) & set(before):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the API processes were not restarted: {before} -> {serve.children()}")
    pids = serve.wait_started(2, startups=4)
    for c in connect(serve.port, 10):
        c.close()
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(60) == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_sighup_to_the_process_group_restarts_the_processes_one_at_a_time(serve: Serve) -> None:
    # `kill -HUP -- -PGID` (a closed terminal, say) reaches the API processes too: by default each
    # ended at once, dropping the requests under way, all together; the supervisor restarts them in
    # turn, each finishing what it serves.
    before = serve.wait_started(2)
    for pid in [serve.proc.pid, *before]:
        os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert serve.proc.poll() is None, serve.log.read_text(errors="replace")
        if len(serve.children()) == 2 and not set(serve.children()) & set(before):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the API processes were not restarted: {before} -> {serve.children()}")
    serve.wait_started(2, startups=4)
    log = serve.log.read_text(errors="replace")
    assert "exited with" not in log, log  # each was stopped by its supervisor, none died of the signal
    for c in connect(serve.port, 4):
        c.close()


def test_a_process_shutting_down_is_not_waited_for() -> None:
    """Once a process stops accepting, its siblings see it as not serving while it finishes the
    connections it has (they would hold back for it otherwise)."""

    async def app(scope: dict, receive: object, send: object) -> None:  # never called
        raise AssertionError(scope)

    slots = Slots(multiprocessing.get_context("spawn"), 2)
    counts = slots.counts
    counts[:] = [NOT_SERVING, 0]
    server = BalancedServer(uvicorn.Config(app, lifespan="off"), slots, 0)
    server.config.load()
    server.lifespan = server.config.lifespan_class(server.config)

    class Connection:
        def shutdown(self) -> None:  # as uvicorn's protocols: closing it removes it from the set
            server.server_state.connections.discard(self)

    async def run() -> None:
        await server.startup(sockets=[])
        server.server_state.connections.add(Connection())
        assert counts[0] == 1
        await server.shutdown(sockets=[])

    asyncio.run(run())
    assert list(counts) == [NOT_SERVING, 0]


def read_until(conn: socket.socket, done: Callable[[bytes], bool]) -> bytes:
    data = b""
    while not done(data):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_responses_arrive_whole_in_order_and_streams_as_they_are_written(serve: Serve, tmp_path: Path) -> None:
    # A process writes each response's head and body as one (ckptconv.cli.api_processes.CoalescedWrites):
    # pipelined requests, a closing connection and an event stream still get every byte, in time.
    serve.wait_started(2)
    with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as c:
        c.sendall(REQUEST * 3)
        data = read_until(c, lambda d: d.count(b"HTTP/1.1 200") == 3 and d.endswith(b"}"))
        assert data.count(b"HTTP/1.1 200") == 3 and data.count(b'"status":"ok"') == 3, data
    with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as c:
        c.sendall(b"GET /v1/formats HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        head, _, body = read_until(c, lambda d: False).partition(b"\r\n\r\n")  # until the server closes
        length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        assert head.startswith(b"HTTP/1.1 200") and len(body) == length > 1000

    job = {
        "kind": "convert",
        "source": {"uri": f"{tmp_path}/in/model.safetensors"},
        "target": {"uri": f"{tmp_path}/out/model.mdl", "format": "cs-h5"},
    }
    body = json.dumps(job).encode()
    with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as c:
        c.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        answer = read_until(c, lambda d: d.endswith(b"}"))
        assert answer.startswith(b"HTTP/1.1 202"), answer
        job_id = json.loads(answer.partition(b"\r\n\r\n")[2])["id"]
    with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as c:
        c.sendall(f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        # The job stays queued (no worker runs): its first event arrives while the stream stays open.
        first = read_until(c, lambda d: b"\n\n" in d.partition(b"\r\n\r\n")[2])
        assert b"event: job" in first and job_id.encode() in first, first
