"""Scratch directories of processes killed with SIGKILL are removed; live or foreign ones never are."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from test_e2e_service import Service, bucket  # noqa: F401 - bucket is a fixture the service needs

from ckptconv.storage import scratch

_HOLD = """
import sys
from ckptconv.storage import scratch
d = scratch.make_dir("job-1")
(d / "part").write_bytes(b"x" * 4096)
print(d, flush=True)
sys.stdin.read()
"""


def _holder() -> tuple[subprocess.Popen, Path]:
    p = subprocess.Popen([sys.executable, "-c", _HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, Path(p.stdout.readline().strip())


def test_sweep_removes_dead_processes_dirs_only(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTCONV_SCRATCH_DIR", str(tmp_path))
    killed, killed_dir = _holder()
    alive, alive_dir = _holder()
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        # Same host and a live PID, but another start time: the PID was reused, the owner is dead.
        host = killed_dir.name.split("--", 1)[0]
        reused = tmp_path / f"{host}--{os.getpid()}-1--job-2--0000"
        foreign = tmp_path / f"otherhost--{killed.pid}-1--job-3--0000"
        for d in (reused, foreign):
            d.mkdir()
        assert scratch.sweep() == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive_dir.name, foreign.name])
        assert (alive_dir / "part").exists()
    finally:
        alive.kill()
        alive.wait()
    assert scratch.sweep() == 1  # once its process is gone


def test_a_worker_removes_dead_scratch_when_it_starts(redis_url, bucket, tmp_path, monkeypatch):  # noqa: F811
    scratch_dir = tmp_path / "scratch"
    monkeypatch.setenv("CKPTCONV_SCRATCH_DIR", str(scratch_dir))
    svc = Service(redis_url, bucket, tmp_path)
    try:
        killed, left = _holder()
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert left.exists()
        svc.start_worker()
        assert not left.exists()
    finally:
        svc.stop()
