"""Shared fixtures: real services on loopback.

- ``s3_server``: moto's standalone S3 server (a real HTTP endpoint) on a free port, started once
  per test session; boto3 talks to it through the standard ``AWS_*`` variables, exactly as
  production talks to AWS S3 or MinIO.
- ``redis_url``: the Redis at ``REDIS_URL`` (default 127.0.0.1:6379) if it answers, else a
  ``redis-server`` started for the session on a free port.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.ports import free_port, stop_process, wait_port

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server; AWS_* variables point at it for the whole session."""
    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port, 30.0)
        endpoint = f"http://127.0.0.1:{port}"
        _warm_up(endpoint)
        saved = {k: os.environ.get(k) for k in _AWS_VARS}
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
        )
        yield endpoint
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _warm_up(endpoint: str) -> None:
    """One request, so that moto loads its S3 backend now (seconds on a loaded machine): the first
    test to touch S3 would otherwise spend them inside its own timeouts."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{endpoint}/ckptconv-warm-up/none", timeout=60).close()
    except urllib.error.HTTPError:
        pass  # 404: no such bucket; the backend is loaded


_AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A fresh, empty bucket on the session's S3 server; returns its name."""
    import boto3

    name = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except Exception:
        return False


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if _redis_answers(url):
        yield url
        return
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_port(port, 30.0)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


class PrivateRedis:
    """A redis-server of the test's own (with an append-only file, or with no persistence at all)."""

    def __init__(self, data: Path, *, aof: bool, save: str = "", extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(data)]
        self.argv += ["--appendonly", "yes" if aof else "no", "--save", save, *extra]
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL)
        wait_port(self.port, 30.0)
        return proc

    def restart(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # a clean shutdown: the append-only file is synced
        self.proc.wait(timeout=30)
        self.proc = self._start()

    def kill(self) -> None:
        """Gone at once, as in a crash: no reply to what it was sent, its connections reset."""
        self.proc.kill()
        self.proc.wait(timeout=30)

    def start(self) -> None:
        self.proc = self._start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@contextmanager
def api_process(
    redis_url: str,
    logdir: Path,
    redis_prefix: str,
    keys: dict[str, list[str]],
    env: dict[str, str] | None = None,
    workers: int = 1,
) -> Iterator[str]:
    """A real API process (``ckptconv serve``, development mode) on a free loopback port; yields its URL.

    ``keys`` maps each API key it accepts to the key's URI prefixes; ``env`` adds ``CKPTCONV_*``
    settings. Its log is ``logdir/api.log``.
    """
    from ckptconv.core.auth import hash_key

    entries = [
        f"  - name: k{i}\n    sha256: {hash_key(k)}\n    prefixes: {json.dumps(p)}\n"
        for i, (k, p) in enumerate(keys.items())
    ]
    (logdir / "keys.yaml").write_text("keys:\n" + "".join(entries))
    env = {
        "CKPTCONV_ENVIRONMENT": "development",
        "CKPTCONV_REDIS_PREFIX": redis_prefix,
        "CKPTCONV_API_KEYS_FILE": str(logdir / "keys.yaml"),
        **(env or {}),
    }
    port = free_port()
    log = open(logdir / "api.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptconv", "serve", "--port", str(port), "--workers", str(workers)],
        cwd=ROOT,
        env={**os.environ, "CKPTCONV_REDIS_URL": redis_url, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (logdir / "api.log").read_text()
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)
        log.close()
