"""moto's S3 server with its own request log: what the server saw, request by request.

Tests that bound what a piece of code may ask of the store (confinement: no request outside the
granted prefixes; planning: few requests per file) read the log the server itself writes, so no
client-side wrapper can hide a request.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.ports import free_port

_LOG_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+"')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def aws_environ(endpoint: str) -> Iterator[None]:
    """The AWS variables boto3 reads, pointed at ``endpoint`` with test credentials for the block;
    the caller's values (or their absence) are restored after."""
    names = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class AccessLoggedS3:
    """moto's S3 server with its request log in a file (werkzeug logs one line per request)."""

    def __init__(self, log: Path) -> None:
        exe = str(Path(sys.executable).parent / "moto_server")
        self.port = free_port()
        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=self._out, stderr=subprocess.STDOUT
        )
        self.endpoint = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(self.endpoint, timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "moto did not start"
                time.sleep(0.1)

    def requests(self, since: int = 0) -> list[tuple[str, str, str, dict[str, list[str]]]]:
        """(method, bucket, key, query) of every request logged after byte ``since``."""
        out = []
        text = _ANSI.sub("", self.log.read_bytes()[since:].decode("utf-8", "replace"))
        for m in _LOG_LINE.finditer(text):
            parts = urllib.parse.urlsplit(m.group(2))
            bucket, _, key = urllib.parse.unquote(parts.path).lstrip("/").partition("/")
            out.append((m.group(1), bucket, key, urllib.parse.parse_qs(parts.query)))
        return out

    def offset(self) -> int:
        return self.log.stat().st_size

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self._out.close()
