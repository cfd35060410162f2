"""API load benchmark on loopback: ckptconv's submit and status paths next to a bare FastAPI +
Redis + Celery hot path, measured in the same run.

    .venv/bin/python -m bench.api_load [--duration 10] [--runs 3] [--connections 50]

ckptconv runs as production runs it (``ckptconv serve --workers 2``: two uvicorn processes with
uvloop and httptools, no access log, taking the socket's connections in turn); the bare app runs in
the same two processes under the same settings, against the same Redis. 50 connections load them
with ``wrk`` (``apt-get install wrk``) or, when wrk is missing, an asyncio/httpx generator in its
own process (which competes for the same two cores, so figures are lower).

- bare POST: pydantic validation, one HSET, one Celery ``send_task``; bare GET: one HGETALL.
- ckptconv POST /v1/jobs: API-key auth (hashed, cached), the per-key rate limit (one Redis round
  trip per share of the budget, not per request), the body limit, validation, scope checks (local
  paths resolved through symlinks), an Idempotency-Key per request, the target checked for existing
  data (here local paths: one lstat for a new target; S3 targets take a HEAD and a listing in a
  thread, bounded in time), and one Redis script (Idempotency-Key record + target reservation +
  record + indexes + the Celery message); GET /v1/jobs/{id}: auth, rate limit, one HGETALL, the job
  resource.

No worker runs: messages pile up in queues under a prefix of this run, deleted at the end. Prints
the median of ``--runs`` runs of each case and the ratios; never asserts on time. Loopback only,
bounded in time, stops by itself.

Besides requests per second, each case prints the CPU time per request (user + system, in us) of
the server (the uvicorn master and its worker processes, from ``/proc/<pid>/stat``), of Redis
(``INFO cpu``) and of the load generator. On a machine others are using too, requests per second
follow their load; CPU time per request hardly does, so it is what compares two versions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from bench.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
KEY = "ckc_bench-" + uuid.uuid4().hex
SUBMIT_BODY = {
    "kind": "convert",
    # Local paths under the run's directory: the submit path checks that the target does not exist
    # (a stat and a listing here; with s3:// URIs it would need an S3 server).
    "source": {"uri": "__ROOT__/in/model.safetensors"},
    # Every request names its own target (a target is reserved by one live job at a time).
    "target": {"uri": "__ROOT__/out/__N__/model.mdl", "format": "cs-h5"},
    "labels": {"suite": "bench"},
}


# --- the bare hot path (what a minimal service would do) ------------------------------------------


class BareRef(BaseModel):
    uri: str
    format: str | None = None


class BareSubmit(BaseModel):
    kind: str
    source: BareRef
    target: BareRef
    labels: dict[str, str] = {}


def bare_app() -> Any:
    """FastAPI + one HSET + one Celery publish per POST; one HGETALL per GET."""
    import gc

    import redis.asyncio
    from celery import Celery
    from fastapi import FastAPI

    prefix = os.environ["BENCH_PREFIX"]
    celery = Celery("bare", broker=os.environ["BENCH_REDIS_URL"])
    celery.conf.broker_transport_options = {"global_keyprefix": prefix + "q:"}
    client = redis.asyncio.Redis.from_url(os.environ["BENCH_REDIS_URL"], decode_responses=True)

    app = FastAPI()

    @app.on_event("startup")
    async def _freeze() -> None:  # same process tuning as ckptconv's API, for a fair comparison
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)

    @app.post("/jobs", status_code=202)
    async def submit(body: BareSubmit) -> dict:
        job_id = uuid.uuid4().hex
        await client.hset(f"{prefix}job:{job_id}", mapping={"state": "queued", "request": body.model_dump_json()})
        celery.send_task("bare.run", args=[job_id], queue="bare")
        return {"id": job_id, "state": "queued"}

    @app.get("/jobs/{job_id}")
    async def status(job_id: str) -> dict:
        return await client.hgetall(f"{prefix}job:{job_id}")

    return app


# --- servers ----------------------------------------------------------------------------------


class Server:
    def __init__(
        self, name: str, args: list[str], env: dict[str, str], port: int, logdir: Path, cwd: Path = ROOT
    ) -> None:
        self.name = name
        self.port = port
        self.log = open(logdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait()

    def _wait(self) -> None:
        import httpx

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: see {self.log.name}")
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/docs", timeout=1)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            # Both processes: one that is still starting would get none of the connections opened now.
            if Path(self.log.name).read_text(errors="replace").count("Application startup complete") >= 2:
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not start")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process and every process under it (uvicorn's workers)."""
        return sum(_cpu_seconds(pid) for pid in _process_tree(self.proc.pid))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name (which may hold spaces): state, ppid, ..."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def _cpu_seconds(pid: int) -> float:
    try:
        fields = _stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0  # gone since it was listed
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15 of stat)


def _process_tree(root: int) -> list[int]:
    """``root`` and its descendants, from the parent ids in /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(_stat_fields(int(entry))[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    tree = [root]
    for pid in tree:
        tree.extend(child for child, parent in parents.items() if parent == pid)
    return tree


def _redis_cpu_seconds(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the load generators, once reaped
    return usage.ru_utime + usage.ru_stime


# --- load generators ----------------------------------------------------------------------------

WRK_POST = """
local counter = 0
local tid = 0
local threads = {}
function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end
function init(args)
  tid = wrk.thread:get("tid")
end
function request()
  counter = counter + 1
  local headers = {}
  headers["Content-Type"] = "application/json"
%(auth)s
  local n = "%(run)s-" .. tid .. "-" .. counter
  headers["Idempotency-Key"] = "bench-" .. n
  return wrk.format("POST", "%(path)s", headers, '%(body_head)s' .. n .. '%(body_tail)s')
end
"""

WRK_GET = """
wrk.method = "GET"
wrk.headers["Authorization"] = "Bearer %(key)s"
"""


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text.strip())
    if not m:
        raise ValueError(text)
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def run_wrk(url: str, script: str, duration: float, connections: int, tmp: Path) -> dict[str, float]:
    path = tmp / f"wrk-{uuid.uuid4().hex[:6]}.lua"
    path.write_text(script)
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{int(duration)}s", "--latency", "-s", str(path), url],
        capture_output=True,
        text=True,
        timeout=duration + 60,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    non_2xx = int(errors.group(1)) if errors else 0
    return {"rps": rps, "p50_ms": p50, "p99_ms": p99, "non_2xx": non_2xx, "requests": requests}


def _httpx_load(url: str, method: str, headers: dict, body: bytes | None, duration: float, connections: int) -> dict:
    import httpx

    latencies: list[float] = []
    errors = 0

    async def one(client: httpx.AsyncClient, worker: int, stop_at: float) -> None:
        nonlocal errors
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            h = dict(headers)
            content = body
            if method == "POST":
                tag = f"{worker}-{n}-{uuid.uuid4().hex[:6]}"
                h["Idempotency-Key"] = f"bench-httpx-{tag}"
                content = body.replace(b"__N__", tag.encode()) if body else body
            t0 = time.perf_counter()
            r = await client.request(method, url, headers=h, content=content)
            latencies.append((time.perf_counter() - t0) * 1000)
            errors += r.status_code >= 300

    async def main() -> float:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:
            t0 = time.monotonic()
            stop_at = t0 + duration
            await asyncio.gather(*(one(client, i, stop_at) for i in range(connections)))
            return time.monotonic() - t0

    elapsed = asyncio.run(main())
    latencies.sort()
    q = statistics.quantiles(latencies, n=100)
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": q[49],
        "p99_ms": q[98],
        "non_2xx": errors,
        "requests": len(latencies),
    }


def run_httpx(url: str, method: str, headers: dict, body: bytes | None, duration: float, connections: int) -> dict:
    """The fallback generator, in its own process (so its CPU is not the servers')."""
    code = (
        "import json, sys; from bench.api_load import _httpx_load; "
        "a = json.loads(sys.argv[1]); a['body'] = a['body'].encode() if a['body'] else None; "
        "print(json.dumps(_httpx_load(**a)))"
    )
    args = {
        "url": url,
        "method": method,
        "headers": headers,
        "body": body.decode() if body else None,
        "duration": duration,
        "connections": connections,
    }
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], cwd=ROOT, capture_output=True, text=True, timeout=duration + 120
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the run --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement (default 10)")
    parser.add_argument("--runs", type=int, default=3, help="runs per case; the median is reported (default 3)")
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--generator", choices=["auto", "wrk", "httpx"], default="auto")
    parser.add_argument(
        "--compare",
        type=Path,
        metavar="CHECKOUT",
        help="also measure ckptconv as served from this checkout (another version), in the same run",
    )
    args = parser.parse_args()
    args.duration = max(1.0, min(args.duration, 60.0))  # bounded
    args.runs = max(1, min(args.runs, 5))
    generator = args.generator if args.generator != "auto" else ("wrk" if shutil.which("wrk") else "httpx")
    load_before = ", ".join(f"{x:.2f}" for x in os.getloadavg())

    import httpx
    import redis

    from ckptconv.core.auth import hash_key

    tmp = Path(tempfile.mkdtemp(prefix="ckptconv-bench-"))
    (tmp / "keys.yaml").write_text(f"keys:\n  - name: bench\n    sha256: {hash_key(KEY)}\n    prefixes: ['{tmp}/']\n")
    run_id = uuid.uuid4().hex[:8]
    prefix_ours = f"ckptconv-bench-{run_id}:"
    prefix_bare = f"ckptconv-bench-bare-{run_id}:"
    prefix_other = f"ckptconv-bench-other-{run_id}:"
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ours_env = {
        **base_env,
        "CKPTCONV_ENVIRONMENT": "production",
        "CKPTCONV_WEBHOOK_SECRET": "whsec_YmVuY2gtb25seS1zZWNyZXQtbm90LWZvci11c2U=",
        "CKPTCONV_REDIS_URL": args.redis_url,
        "CKPTCONV_REDIS_PREFIX": prefix_ours,
        "CKPTCONV_API_KEYS_FILE": str(tmp / "keys.yaml"),
        # The per-key rate limit stays on the measured path, set above what one key sends here.
        "CKPTCONV_RATE_LIMIT_PER_SECOND": "1000000",
    }
    bare_env = {**base_env, "BENCH_PREFIX": prefix_bare, "BENCH_REDIS_URL": args.redis_url}
    # ckptconv as production starts it (Dockerfile, docker-compose.yml); the bare app with the same
    # uvicorn settings (2 processes, uvloop and httptools when installed, no access log).
    serve = [sys.executable, "-m", "ckptconv", "serve", "--host", "127.0.0.1", "--workers", "2"]
    # The bare app runs in the same two processes (ckptconv.cli.api_processes, which spreads
    # connections over them) with the same uvicorn settings.
    bare_serve = (
        "import sys, uvicorn; from ckptconv.cli.api_processes import serve; sys.exit(serve(uvicorn.Config("
        "'bench.api_load:bare_app', factory=True, host='127.0.0.1', port=%d, workers=2, log_level='info',"
        " access_log=False, loop='auto', http='auto')))"
    )
    servers: list[Server] = []
    results: dict[str, list[dict[str, float]]] = {}
    try:
        p_ours, p_bare = free_port(), free_port()
        ours_args = [*serve, "--port", str(p_ours)]
        servers.append(Server("ckptconv", ours_args, ours_env, p_ours, tmp))
        servers.append(Server("bare", [sys.executable, "-c", bare_serve % p_bare], bare_env, p_bare, tmp))
        ours_url, bare_url = f"http://127.0.0.1:{p_ours}", f"http://127.0.0.1:{p_bare}"
        ours, bare = servers
        if args.compare:
            p_other = free_port()
            other_env = {**ours_env, "CKPTCONV_REDIS_PREFIX": prefix_other, "PYTHONPATH": str(args.compare)}
            other_args = [*serve, "--port", str(p_other)]
            servers.append(Server("other", other_args, other_env, p_other, tmp, cwd=args.compare.resolve()))
        auth = {"Authorization": f"Bearer {KEY}"}
        submit_body = json.dumps(SUBMIT_BODY, separators=(",", ":")).replace("__ROOT__", str(tmp))
        first = json.loads(submit_body.replace("__N__", f"first-{run_id}"))
        job_id = httpx.post(ours_url + "/v1/jobs", json=first, headers=auth).raise_for_status().json()["id"]
        bare_id = httpx.post(bare_url + "/jobs", json=first).raise_for_status().json()["id"]
        body_head, _, body_tail = submit_body.partition("__N__")

        cases = {
            "bare POST /jobs": (bare_url + "/jobs", "POST", {}, bare),
            "ckptconv POST /v1/jobs": (ours_url + "/v1/jobs", "POST", auth, ours),
            "bare GET /jobs/{id}": (f"{bare_url}/jobs/{bare_id}", "GET", {}, bare),
            "ckptconv GET /v1/jobs/{id}": (f"{ours_url}/v1/jobs/{job_id}", "GET", auth, ours),
        }
        if args.compare:
            other = servers[2]
            other_url = f"http://127.0.0.1:{other.port}"
            other_id = httpx.post(other_url + "/v1/jobs", json=first, headers=auth).raise_for_status().json()["id"]
            cases["other POST /v1/jobs"] = (other_url + "/v1/jobs", "POST", auth, other)
            cases["other GET /v1/jobs/{id}"] = (f"{other_url}/v1/jobs/{other_id}", "GET", auth, other)
        redis_client = redis.Redis.from_url(args.redis_url)
        print(
            f"load generator: {generator}, {args.connections} connections, {args.runs} x {args.duration:g} s per case"
        )
        for run in range(args.runs):
            order = list(cases) if run % 2 == 0 else list(cases)[::-1]  # alternate to spread drift
            for name in order:
                url, method, headers, server = cases[name]
                cpu_before = server.cpu_seconds(), _redis_cpu_seconds(redis_client), _children_cpu_seconds()
                if generator == "wrk":
                    if method == "POST":
                        path = url.split(":", 2)[2].split("/", 1)[1]
                        auth_line = f'  headers["Authorization"] = "Bearer {KEY}"' if headers else ""
                        script = WRK_POST % {
                            "auth": auth_line,
                            "run": f"{run_id}{run}",
                            "path": "/" + path,
                            "body_head": body_head,
                            "body_tail": body_tail,
                        }
                    else:
                        script = WRK_GET % {"key": KEY} if headers else ""
                    res = run_wrk(url, script, args.duration, args.connections, tmp)
                else:
                    res = run_httpx(
                        url,
                        method,
                        {**headers, "Content-Type": "application/json"},
                        submit_body.encode() if method == "POST" else None,
                        args.duration,
                        args.connections,
                    )
                cpu_after = server.cpu_seconds(), _redis_cpu_seconds(redis_client), _children_cpu_seconds()
                n = max(1, res["requests"])
                res["server_cpu_us"], res["redis_cpu_us"], res["loadgen_cpu_us"] = (
                    (after - before) / n * 1e6 for before, after in zip(cpu_before, cpu_after, strict=True)
                )
                results.setdefault(name, []).append(res)
                print(
                    f"  run {run + 1}: {name:<28} {res['rps']:>8.0f} req/s  p50 {res['p50_ms']:6.1f} ms"
                    f"  p99 {res['p99_ms']:6.1f} ms  non-2xx {res['non_2xx']}  CPU us/request: server"
                    f" {res['server_cpu_us']:.0f}, redis {res['redis_cpu_us']:.0f}, load {res['loadgen_cpu_us']:.0f}",
                    flush=True,
                )
    finally:
        for s in servers:
            s.stop()
        r = redis.Redis.from_url(args.redis_url)
        for prefix in (prefix_ours, prefix_bare, prefix_other):
            keys = list(r.scan_iter(match=prefix + "*", count=5000))
            for i in range(0, len(keys), 1000):
                r.delete(*keys[i : i + 1000])
        shutil.rmtree(tmp, ignore_errors=True)

    med = {name: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for name, runs in results.items()}
    print()
    print(f"load average before the run: {load_before}, after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| hot path | requests/s | p50 | p99 | server CPU us/request | Redis CPU us/request |")
    print("|---|---|---|---|---|---|")
    for name, m in med.items():
        print(
            f"| {name} | {m['rps']:,.0f} | {m['p50_ms']:.1f} ms | {m['p99_ms']:.1f} ms"
            f" | {m['server_cpu_us']:.0f} | {m['redis_cpu_us']:.0f} |"
        )
    submit = med["ckptconv POST /v1/jobs"]["rps"] / med["bare POST /jobs"]["rps"]
    status = med["ckptconv GET /v1/jobs/{id}"]["rps"] / med["bare GET /jobs/{id}"]["rps"]
    print()
    print(f"submit: {med['ckptconv POST /v1/jobs']['rps']:,.0f}/s (target >= 3,000/s), {submit:.0%} of the bare path")
    print(
        f"status: {med['ckptconv GET /v1/jobs/{id}']['rps']:,.0f}/s (target >= 6,000/s), {status:.0%} of the bare path"
    )
    for path, ours_name, bare_name in (
        ("submit", "ckptconv POST /v1/jobs", "bare POST /jobs"),
        ("status", "ckptconv GET /v1/jobs/{id}", "bare GET /jobs/{id}"),
    ):
        ours_cpu, bare_cpu = med[ours_name]["server_cpu_us"], med[bare_name]["server_cpu_us"]
        line = f"{path}: server CPU {ours_cpu:.0f} us/request, bare {bare_cpu:.0f} us ({ours_cpu / bare_cpu:.2f}x)"
        other_name = ours_name.replace("ckptconv", "other")
        if other_name in med:
            other_cpu = med[other_name]["server_cpu_us"]
            line += f", {args.compare} {other_cpu:.0f} us ({ours_cpu / other_cpu:.2f}x)"
        print(line)
    worst = max(med["ckptconv POST /v1/jobs"]["p99_ms"], med["ckptconv GET /v1/jobs/{id}"]["p99_ms"])
    print(f"ckptconv p99: {worst:.1f} ms at worst (target < 25 ms)")
    out = ROOT / ".bench" / "api_load.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"generator": generator, "median": med, "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
