"""The servers a benchmark (or a test) starts on loopback (S3, Redis, the API): their ports, and
stopping them."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 60.0) -> None:
    """Return once something accepts connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Terminate ``proc``; killed when it has not ended ``timeout`` seconds later."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
