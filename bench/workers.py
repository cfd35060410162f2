"""A private service for benchmarks of fanned-out jobs: Redis, the API and N worker processes, all on
loopback, started and stopped by the benchmark (nothing outside the run is touched).

One job at a time: :meth:`Service.run` starts ``workers`` worker processes (solo pool, as a
deployment runs one job per process), submits a conversion with ``parallelism``, waits for it, and
returns its wall time, the largest peak RSS among the workers and the CPU time they spent on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bench.ports import free_port, wait_port


class Service:
    def __init__(self, logdir: Path, env: dict[str, str]) -> None:
        self.logdir = logdir
        logdir.mkdir(parents=True, exist_ok=True)
        redis_port, api_port = free_port(), free_port()
        self.redis = subprocess.Popen(
            ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        self.env = {
            **env,
            "CKPTCONV_ENVIRONMENT": "development",
            "CKPTCONV_AUTH_DISABLED": "true",
            "CKPTCONV_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
            "CKPTCONV_REDIS_PREFIX": f"bench-{uuid.uuid4().hex[:8]}:",
            "PYTHONUNBUFFERED": "1",
        }
        self.url = f"http://127.0.0.1:{api_port}"
        self.procs: list[subprocess.Popen] = []
        try:
            wait_port(redis_port)
            self.api = self._spawn("api", ["serve", "--host", "127.0.0.1", "--port", str(api_port)])
            wait_port(api_port)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logdir / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, "-m", "ckptconv", *args], env=self.env, stdout=log, stderr=log)
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def run(self, source: str, target: str, *, to: str, workers: int, parallelism: int) -> tuple[float, int, float]:
        """Wall seconds from submit to the job's end, the largest worker peak RSS in bytes, and the
        workers' CPU seconds (user + system) from submit to the job's end: on a machine others use
        too, the wall time follows their load, the CPU time less so."""
        from ckptconv.client import Client

        started = [self._spawn("worker", ["worker", "--pool", "solo", "--loglevel", "info"]) for _ in range(workers)]
        try:
            for proc in started:
                deadline = time.monotonic() + 120
                while b"ready." not in Path(proc.log_path).read_bytes():  # type: ignore[attr-defined]
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"a worker did not start: see {proc.log_path}")  # type: ignore[attr-defined]
                    time.sleep(0.1)
            with Client(self.url) as c:
                cpu = sum(cpu_seconds(p.pid) for p in started)
                t0 = time.perf_counter()
                job = c.submit(source, target, to=to, options={"parallelism": parallelism})
                job = c.wait(job["id"], timeout=3600)
                wall = time.perf_counter() - t0
                cpu = sum(cpu_seconds(p.pid) for p in started) - cpu
            if job["state"] != "succeeded":
                raise SystemExit(f"the fanned-out job ended {job['state']}: {job.get('error')}")
            peak = max(_peak_rss(p.pid) for p in started)
        finally:
            for proc in started:
                proc.terminate()
            for proc in started:
                proc.wait(timeout=60)
        return wall, peak, cpu

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.redis.terminate()
        self.redis.wait(timeout=30)


def _peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
