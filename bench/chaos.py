"""Chaos run of the whole service: the long version of tests/test_faults.py.

    .venv/bin/python -m bench.chaos [--rounds 20] [--submissions 2000] [--workers 2] [--tensors 120]
                                    [--fanout-jobs 6]

Starts everything on loopback, in a temporary directory: a moto S3 server, a private
``redis-server`` with an append-only file, an API process and ``--workers`` worker processes. Then:

1. **Kill rounds**: each round submits a conversion, waits for a random moment of it (converting,
   verifying, or just after it was taken), SIGKILLs the worker running it and starts another one.
   Two rounds in three are fanned out (``parallelism`` 2 to 4, a 12 MiB checkpoint) to an S3 or
   a local target; their victim is the job's own worker (which prepares and commits), or at the
   moment ``part`` a worker running one of its parts. Half-way, Redis itself is restarted (clean
   shutdown, AOF kept). A thread lists every target all along to catch anything partial that
   becomes visible.
2. **Submission storm**: ``--submissions`` jobs, each Idempotency-Key sent twice at once, plus, for
   one in ten, a second key naming the same target (exactly one of them must win). Jobs of the
   storm use small checkpoints; the ones still queued at the end are cancelled.
3. **S3 faults** (``--s3-jobs`` conversions each): the workers reach S3 through
   ``bench/faultproxy.py`` all along; in this phase it answers 500s, lost answers, resets mid-body,
   short bodies and stalls, first at ``--s3-rate`` (5%: jobs must succeed through retries), then
   at ``--exhaust-rate`` with a retry budget of ``--exhaust-attempts`` (jobs must fail with
   ``storage_error`` and leave nothing behind). Each fault phase adds ``--fanout-jobs`` fanned-out
   conversions, to S3 and local targets in turn.

Then prints, for each phase: jobs lost (accepted, later 404), stuck (not final at the end),
duplicated (two jobs for one key or one target), overwritten (outputs whose bytes differ from their
job's result), partial outputs visible (seen while running or left at a target without their
manifest), staging and temp bytes left, multipart uploads left open (per phase, and in the
whole bucket at the end), untyped errors (failures without a typed code, or internal_error),
5xx answers (with how many came while Redis was restarting), and S3 requests of the workers
outside the key's prefixes (local targets' reads and writes are not watched). Never asserts;
bounded in time; cleans up after itself.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from bench.faultproxy import FaultProxy
from bench.ports import free_port, wait_port
from ckptconv.storage.digests import holds_output

ROOT = Path(__file__).resolve().parent.parent
TERMINAL = {"succeeded", "failed", "cancelled"}
TYPED_FAILURES_EXCLUDED = {"internal_error", None, ""}
# The chaos key reaches these prefixes of its bucket only; every phase works inside one of them.
PHASE_PREFIXES = ("in/", "kill/", "storm/", "s3ok/", "s3exhaust/")
LOCAL = "local:"  # listings name a file under the local targets' root with this prefix
FANOUT_TENSORS = 48  # x 256 KiB: 12 MiB, several parts on S3's 5 MiB part grid and on local MiB units


class Stack:
    """moto, an AOF Redis, the API and workers, all processes of this run."""

    def __init__(self, tmp: Path, workers: int) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.s3_port, self.redis_port, self.api_port = free_port(), free_port(), free_port()
        moto = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
        self.moto = self._popen([moto, "-H", "127.0.0.1", "-p", str(self.s3_port)], "moto")
        (tmp / "redis").mkdir()
        self.redis_argv = ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1"]
        self.redis_argv += ["--dir", str(tmp / "redis"), "--appendonly", "yes", "--save", ""]
        self.redis_proc = self._popen(self.redis_argv, "redis")
        wait_port(self.s3_port)
        wait_port(self.redis_port)
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.bucket = "chaos"
        self.key = "ckc_chaos-" + uuid.uuid4().hex
        from ckptconv.core.auth import hash_key

        # Local targets (fanned out over workers of this one host) live under their own root.
        self.local = tmp / "local"
        self.local.mkdir()
        prefixes = json.dumps([f"s3://{self.bucket}/{p}" for p in PHASE_PREFIXES] + [f"{self.local}/"])
        (tmp / "keys.yaml").write_text(
            f"keys:\n  - name: chaos\n    sha256: {hash_key(self.key)}\n    prefixes: {prefixes}\n"
        )
        self.prefix = f"chaos-{uuid.uuid4().hex[:8]}:"
        self.env = {
            **os.environ,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "CKPTCONV_ENVIRONMENT": "development",
            "CKPTCONV_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "CKPTCONV_REDIS_PREFIX": self.prefix,
            "CKPTCONV_API_KEYS_FILE": str(tmp / "keys.yaml"),
            "CKPTCONV_HEARTBEAT_SECONDS": "0.5",
            "CKPTCONV_VISIBILITY_TIMEOUT_SECONDS": "3",
            "CKPTCONV_REAPER_INTERVAL_SECONDS": "2",
            "CKPTCONV_MAX_ATTEMPTS": "5",
            "CKPTCONV_RATE_LIMIT_PER_SECOND": "100000",
            "CKPTCONV_SCRATCH_DIR": str(tmp / "scratch"),
            "PYTHONUNBUFFERED": "1",
        }
        os.environ.update({k: self.env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
        os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=self.endpoint)
        self.s3.create_bucket(Bucket=self.bucket)
        # Workers reach S3 through the fault proxy (faults off until the S3 phase), which also
        # sees every object and prefix they ask for.
        self.proxy = FaultProxy(self.endpoint, stall_s=1.5, seed=11)
        self.proxy.on_request = self._count_outside
        self.proxy.start()
        self.outside: list[str] = []
        self.worker_env = {
            "AWS_ENDPOINT_URL": self.proxy.url,
            "CKPTCONV_S3_READ_TIMEOUT_S": "1",
            "CKPTCONV_STORAGE_BACKOFF_S": "0.02",
            "CKPTCONV_STORAGE_BACKOFF_MAX_S": "0.2",
        }
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.api = self._spawn(
            "api", ["serve", "--port", str(self.api_port), "--log-level", "warning", "--workers", "2"]
        )
        wait_port(self.api_port)
        self.workers = [self.start_worker() for _ in range(workers)]
        self.redis_down = threading.Event()

    def _popen(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptconv", *args],
            cwd=ROOT,
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def _count_outside(self, method: str, path: str, headers: dict[str, str]) -> None:
        """Record a worker's S3 request for an object or a listing outside the key's prefixes."""
        parts = urlsplit(path)
        bucket, _, key = parts.path.lstrip("/").partition("/")
        key = unquote(key)
        if not key:
            query = parse_qs(parts.query, keep_blank_values=True)
            if "prefix" not in query and "list-type" not in query:
                return  # a bucket-level call naming no object (a batch delete names them in its body)
            key = query.get("prefix", [""])[0]
        source = unquote(headers.get("x-amz-copy-source", "")).lstrip("/")
        for bucket_key in [(bucket, key)] + ([tuple(source.split("?")[0].split("/", 1))] if source else []):
            b, k = bucket_key
            if b != self.bucket or not k.startswith(PHASE_PREFIXES):
                self.outside.append(f"{method} {b}/{k}")

    def start_worker(self, **env: str) -> subprocess.Popen:
        proc = self._spawn("worker", ["worker", "--pool", "solo", "--loglevel", "info"], {**self.worker_env, **env})
        deadline = time.monotonic() + 120
        while b"ready." not in Path(proc.log_path).read_bytes():  # type: ignore[attr-defined]
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not start: " + Path(proc.log_path).read_text())  # type: ignore[attr-defined]
            time.sleep(0.1)
        return proc

    def restart_redis(self) -> None:
        self.redis_down.set()
        self.redis_proc.send_signal(signal.SIGTERM)
        self.redis_proc.wait(timeout=60)
        self.redis_proc = self._popen(self.redis_argv, "redis")
        wait_port(self.redis_port)
        # The restart window ends 5 s after Redis is back: the API's pooled connections to the old
        # server fail once each before they reconnect (503, retried by clients).
        time.sleep(5)
        self.redis_down.clear()

    def replace_workers(self, **env: str) -> None:
        """Stop every worker and start as many with ``env`` (e.g. another retry budget)."""
        for proc in self.workers:
            proc.terminate()
        for proc in self.workers:
            proc.wait(timeout=60)
        self.workers = [self.start_worker(**env) for _ in self.workers]

    def stop(self) -> None:
        self.proxy.stop()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Api:
    """HTTP calls that count 5xx answers and retry them (as a client would), plus connection errors."""

    def __init__(self, stack: Stack) -> None:
        import httpx

        self.stack = stack
        self.http = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.key}"}, timeout=60)
        self.fivexx = 0
        self.fivexx_during_restart = 0
        self.lock = threading.Lock()

    def call(self, method: str, path: str, **kw: Any) -> Any:
        import httpx

        for _ in range(120):
            during = self.stack.redis_down.is_set()
            try:
                r = self.http.request(method, path, **kw)
            except httpx.TransportError:
                time.sleep(0.5)
                continue
            if r.status_code >= 500:
                with self.lock:
                    if during or self.stack.redis_down.is_set():
                        self.fivexx_during_restart += 1
                    else:
                        self.fivexx += 1
                        print(f"  5xx: {method} {path} -> {r.status_code} {r.text[:200]}", flush=True)
                time.sleep(0.5)
                continue
            return r
        raise RuntimeError(f"{method} {path}: no answer")


def make_checkpoint(stack: Stack, key: str, n: int, seed: int, dim: int = 16) -> None:
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(seed)
    tensors = {f"layers.{i}.weight": torch.randn(dim, dim, generator=g) for i in range(n)}
    stack.s3.put_object(Bucket=stack.bucket, Key=key, Body=save(tensors))


def listing(stack: Stack, prefix: str) -> dict[str, int]:
    """Sizes by key of the S3 objects under ``prefix`` and of the local files under the same
    prefix of the local root (keyed ``local:<path>``)."""
    pages = stack.s3.get_paginator("list_objects_v2").paginate(Bucket=stack.bucket, Prefix=prefix)
    found = {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}
    for path in list((stack.local / prefix).rglob("*")):
        try:
            if path.is_file():
                found[LOCAL + str(path.relative_to(stack.local))] = path.stat().st_size
        except OSError:  # removed while listed
            pass
    return found


def key_of(stack: Stack, uri: str) -> str:
    """The listing key of an output URI (an S3 key, or ``local:`` and the path under the local root)."""
    if uri.startswith("s3://"):
        return uri.split("/", 3)[3]
    return LOCAL + str(Path(uri).relative_to(stack.local))


def read(stack: Stack, key: str) -> bytes:
    if key.startswith(LOCAL):
        return (stack.local / key[len(LOCAL) :]).read_bytes()
    return stack.s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read()


def target_uri(stack: Stack, where: str, path: str) -> str:
    return f"s3://{stack.bucket}/{path}" if where == "s3" else f"{stack.local}/{path}"


def submit(api: Api, source: str, target: str, key: str, parallelism: int = 1) -> Any:
    body: dict[str, Any] = {"kind": "convert", "source": {"uri": source}, "target": {"uri": target, "format": "cs-h5"}}
    if parallelism > 1:
        body["options"] = {"parallelism": parallelism}
    return api.call("POST", "/v1/jobs", json=body, headers={"Idempotency-Key": key})


def job_of(api: Api, job_id: str) -> dict[str, Any] | None:
    r = api.call("GET", f"/v1/jobs/{job_id}")
    return r.json() if r.status_code == 200 else None


def worker_running(stack: Stack, job_id: str, part: bool = False) -> subprocess.Popen | None:
    """The live worker process running the job (its own worker), or with ``part`` one running a
    part of it (another worker than the job's own when there is one)."""
    import redis

    r = redis.Redis(port=stack.redis_port, decode_responses=True)
    token = r.hget(f"{stack.prefix}job:{job_id}", "worker")
    tokens = [token] if token else []
    if part:
        held = [r.get(k) for k in r.scan_iter(f"{stack.prefix}part:{job_id}:*")]
        tokens = sorted((t for t in held if t), key=lambda t: t == token) + tokens
    for t in tokens:
        pid = int(t.split(":")[1])
        proc = next((p for p in stack.workers if p.pid == pid and p.poll() is None), None)
        if proc is not None:
            return proc
    return None


# --- the run ---------------------------------------------------------------------------------------


class Watcher:
    """Lists a prefix every 0.2 s while a phase runs, to catch anything partial that becomes visible."""

    def __init__(self, stack: Stack, prefix: str) -> None:
        self.stack, self.prefix = stack, prefix
        self.snapshots: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.snapshots.append(listing(self.stack, self.prefix))
            except Exception:  # the S3 server is busy: try again
                pass
            time.sleep(0.2)

    def stop(self) -> list[dict[str, int]]:
        self._stop.set()
        self._thread.join()
        return self.snapshots


def kill_rounds(stack: Stack, api: Api, rounds: int, tensors: int, report: dict[str, Any]) -> list[str]:
    make_checkpoint(stack, "in/kill.safetensors", tensors, 1)
    make_checkpoint(stack, "in/kill-fan.safetensors", FANOUT_TENSORS, 4, dim=256)
    jobs: list[str] = []
    watcher = Watcher(stack, "kill/")
    kills = 0
    fanned = {"s3": 0, "local": 0}
    for rnd in range(rounds):
        # One round in three a single worker to S3, then a fan-out to S3, then one to a local target.
        where, parallelism = [("s3", 1), ("s3", random.randint(2, 4)), ("local", random.randint(2, 4))][rnd % 3]
        source = f"s3://{stack.bucket}/in/{'kill' if parallelism == 1 else 'kill-fan'}.safetensors"
        target = target_uri(stack, where, f"kill/{rnd}/model.mdl")
        r = submit(api, source, target, f"kill-{rnd}", parallelism)
        job_id = r.json()["id"]
        jobs.append(job_id)
        moment = random.choice(["converting", "verifying", "taken"] + (["part"] if parallelism > 1 else []))
        if parallelism > 1:
            fanned[where] += 1
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            job = job_of(api, job_id) or {}
            if job.get("state") in TERMINAL:
                break
            stage = (job.get("progress") or {}).get("stage")
            if moment == "taken" and job.get("state") == "running":
                break
            if stage == moment and (job.get("progress") or {}).get("tensors_done", 0) > 0:
                break
            if moment == "part" and stage == "converting" and worker_running(stack, job_id, part=True):
                break
            time.sleep(0.1)
        victim = worker_running(stack, job_id, part=moment == "part")
        if victim is not None:
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait()
            kills += 1
            stack.workers.remove(victim)
            stack.workers.append(stack.start_worker())
        shape = f"{where}, parallelism {parallelism}"
        print(
            f"  round {rnd + 1}/{rounds} ({shape}): killed at {moment}" + ("" if victim else " (already done)"),
            flush=True,
        )
        if rnd == rounds // 2:
            print("  restarting Redis (AOF)", flush=True)
            stack.restart_redis()
    wait_final(api, jobs, timeout=900)
    report["kills"] = kills
    report["fanned"] = fanned
    report["partial_seen"] = partial_seen(api, jobs, watcher.stop(), listing(stack, "kill/"))
    return jobs


def s3_faults(
    stack: Stack, api: Api, prefix: str, n: int, tensors: int, rate: float, fanout: int, report: dict[str, Any]
) -> list[str]:
    """``n`` conversions and ``fanout`` fanned-out ones (to S3 and local targets in turn) while the
    proxy injects faults into every ``rate``-th S3 call of the workers."""
    source_key = f"in/{prefix.rstrip('/')}.safetensors"
    make_checkpoint(stack, source_key, tensors, 3)
    fan_key = f"in/{prefix.rstrip('/')}-fan.safetensors"
    make_checkpoint(stack, fan_key, FANOUT_TENSORS, 5, dim=256)
    before = stack.proxy.requests, sum(stack.proxy.counts.values())
    watcher = Watcher(stack, prefix)
    stack.proxy.rate = rate
    jobs = []
    try:
        for i in range(n):
            target = f"s3://{stack.bucket}/{prefix}{i}/model.mdl"
            jobs.append(submit(api, f"s3://{stack.bucket}/{source_key}", target, f"{prefix}{i}").json()["id"])
        for i in range(n, n + fanout):
            target = target_uri(stack, "s3" if i % 2 == 0 else "local", f"{prefix}{i}/model.mdl")
            source = f"s3://{stack.bucket}/{fan_key}"
            jobs.append(submit(api, source, target, f"{prefix}{i}", random.randint(2, 4)).json()["id"])
        wait_final(api, jobs, timeout=900)
    finally:
        stack.proxy.rate = 0.0
    report["partial_seen"] = partial_seen(api, jobs, watcher.stop(), listing(stack, prefix))
    report["s3_requests"] = stack.proxy.requests - before[0]
    report["s3_faults"] = sum(stack.proxy.counts.values()) - before[1]
    print(
        f"  {n} + {fanout} fanned-out jobs, {report['s3_faults']} faults in {report['s3_requests']} S3 requests",
        flush=True,
    )
    return jobs


def partial_seen(api: Api, jobs: list[str], snapshots: list[dict[str, int]], final_listing: dict[str, int]) -> int:
    """Objects seen at a target with a size other than their final one, or a manifest seen before its outputs."""
    bad = 0
    finals: dict[str, dict[str, int]] = {}
    for job_id in jobs:
        job = job_of(api, job_id) or {}
        if job.get("state") == "succeeded":
            outs = {key_of(api.stack, o["uri"]): o["size"] for o in job["result"]["outputs"]}
            finals[key_of(api.stack, job["result"]["manifest"])] = outs
    for snap in snapshots:
        for key, size in snap.items():
            if key.endswith(".ckptconv-job.json") or ".ckptconv-staging" in key:
                continue
            if key in final_listing and final_listing[key] != size:
                bad += 1
        for manifest, outs in finals.items():
            if manifest in snap and not all(k in snap for k in outs):
                bad += 1
    return bad


def wait_final(api: Api, jobs: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(jobs)
    while pending and time.monotonic() < deadline:
        for job_id in list(pending):
            job = job_of(api, job_id)
            if job is None or job["state"] in TERMINAL:
                pending.discard(job_id)
        time.sleep(1)


def storm(stack: Stack, api: Api, n: int, report: dict[str, Any]) -> list[str]:
    make_checkpoint(stack, "in/storm.safetensors", 2, 2)
    source = f"s3://{stack.bucket}/in/storm.safetensors"
    run = uuid.uuid4().hex[:6]
    calls: list[tuple[int, str, str]] = []
    for i in range(n):
        target = f"s3://{stack.bucket}/storm/{i}/model.mdl"
        calls += [(i, target, f"storm-{run}-{i}")] * 2
        if i % 10 == 0:
            calls.append((i, target, f"storm-{run}-{i}-rival"))
    random.shuffle(calls)
    answers: dict[str, list[Any]] = {}

    def one(call: tuple[int, str, str]) -> None:
        _, target, key = call
        r = submit(api, source, target, key)
        doc = r.json()
        answers.setdefault(key, []).append((r.status_code, doc.get("id"), doc.get("code")))

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(one, calls))
    report["storm_requests"] = len(calls)
    report["storm_seconds"] = round(time.monotonic() - t0, 1)
    # Two jobs for one key are a duplicate. A rival key may win a target whose first job already
    # ended (then it fails with target_exists); two *succeeded* jobs for one target are counted by audit().
    duplicated = 0
    for key, got in answers.items():
        if not key.endswith("-rival") and len({job_id for status, job_id, _ in got if status == 202}) > 1:
            duplicated += 1
    report["duplicated"] = duplicated  # audit() adds targets that two jobs both succeeded on
    report["storm_refused_rivals"] = sum(
        1 for key, got in answers.items() if key.endswith("-rival") and got[0][2] == "target_taken"
    )
    report["storm_unexpected_answers"] = sum(
        1
        for got in answers.values()
        for status, _, code in got
        if status not in (202, 409) or (status == 409 and code != "target_taken")
    )
    jobs = sorted({job_id for got in answers.values() for status, job_id, _ in got if status == 202})
    # Let the workers run some, then cancel what is still queued: every job must end.
    time.sleep(20)
    for job_id in jobs:
        job = job_of(api, job_id)
        if job is not None and job["state"] == "queued":
            api.call("POST", f"/v1/jobs/{job_id}/cancel")
    wait_final(api, jobs, timeout=600)
    return jobs


def audit(stack: Stack, api: Api, jobs: list[str], prefix: str, report: dict[str, Any]) -> None:
    """The promises, checked for the jobs of one phase and its prefix once they all ended."""
    lost = stuck = untyped = overwritten = duplicated = 0
    states: dict[str, int] = {}
    codes: dict[str, int] = {}
    targets_done: dict[str, str] = {}
    for job_id in jobs:
        job = job_of(api, job_id)
        if job is None:
            lost += 1
            continue
        states[job["state"]] = states.get(job["state"], 0) + 1
        if job["state"] not in TERMINAL:
            stuck += 1
        if job["state"] == "failed":
            code = (job.get("error") or {}).get("code")
            codes[str(code)] = codes.get(str(code), 0) + 1
            if code in TYPED_FAILURES_EXCLUDED:
                untyped += 1
        if job["state"] == "succeeded":
            target = job["target"]["uri"]
            if target in targets_done:
                duplicated += 1
            targets_done[target] = job_id
            for o in job["result"]["outputs"]:
                try:
                    data = read(stack, key_of(stack, o["uri"]))
                except Exception:
                    overwritten += 1
                    continue
                if not holds_output(data, o):  # its digest, or the block digest of a file written out of order
                    overwritten += 1
            manifest = json.loads(read(stack, key_of(stack, job["result"]["manifest"])))
            if manifest.get("job_id") != job_id:
                overwritten += 1
    # Targets with data but no manifest (a partial output left behind).
    everything = listing(stack, prefix)
    by_target: dict[str, list[str]] = {}
    for key in everything:
        if ".ckptconv-staging" not in key and not key.endswith(".ckptconv-job.json"):
            by_target.setdefault("/".join(key.split("/")[:2]), []).append(key)
    left_partial = sum(
        1 for keys in by_target.values() if not any(k.endswith(("manifest.json", ".manifest.json")) for k in keys)
    )
    uploads = stack.s3.list_multipart_uploads(Bucket=stack.bucket, Prefix=prefix).get("Uploads", [])
    report.update(
        jobs=len(jobs),
        states=states,
        codes=codes,
        lost=lost,
        stuck=stuck,
        untyped=untyped,
        overwritten=overwritten,
        duplicated=report.get("duplicated", 0) + duplicated,
        partial_left=left_partial,
        staging_bytes=sum(size for key, size in everything.items() if ".ckptconv-staging" in key),
        uploads_open=len(uploads),
        scratch_bytes=sum(f.stat().st_size for f in (stack.tmp / "scratch").rglob("*") if f.is_file()),
    )


ROWS = [
    ("jobs", lambda r: f"{r['jobs']}"),
    ("final states", lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["states"].items()))),
    ("failure codes", lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["codes"].items())) or "-"),
    ("jobs lost", lambda r: f"{r['lost']}"),
    ("jobs stuck", lambda r: f"{r['stuck']}"),
    ("jobs duplicated", lambda r: f"{r['duplicated']}"),
    ("outputs overwritten", lambda r: f"{r['overwritten']}"),
    ("partial outputs visible", lambda r: f"{r['partial_seen']} seen, {r['partial_left']} left"),
    ("staging bytes left", lambda r: f"{r['staging_bytes']}"),
    ("multipart uploads left open", lambda r: f"{r['uploads_open']}"),
    ("temp (scratch) bytes left", lambda r: f"{r['scratch_bytes']}"),
    ("untyped errors", lambda r: f"{r['untyped']}"),
    (
        "5xx answers",
        lambda r: (
            f"{r['fivexx']}"
            + (f" (+{r['fivexx_restart']} during the Redis restart)" if r.get("fivexx_restart") else "")
        ),
    ),
    ("S3 requests outside the prefixes", lambda r: f"{r['outside']}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--submissions", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tensors", type=int, default=120)
    parser.add_argument("--s3-jobs", type=int, default=20, help="conversions in each S3 fault phase")
    parser.add_argument("--s3-rate", type=float, default=0.05, help="fault rate the retries must absorb")
    parser.add_argument("--exhaust-rate", type=float, default=0.25, help="fault rate that exhausts the budget")
    parser.add_argument("--exhaust-attempts", type=int, default=2, help="the storage retry budget of that phase")
    parser.add_argument("--fanout-jobs", type=int, default=6, help="fanned-out conversions added to each S3 phase")
    args = parser.parse_args()
    random.seed(11)
    tmp = Path(tempfile.mkdtemp(prefix="ckptconv-chaos-"))
    stack = Stack(tmp, args.workers)
    phases: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    try:
        api = Api(stack)
        print(
            f"chaos: {args.rounds} kill rounds, Redis restart with AOF, {args.submissions} submissions x2, "
            f"S3 faults at {args.s3_rate:.0%} and at {args.exhaust_rate:.0%} "
            f"(budget {args.exhaust_attempts}), {args.s3_jobs} jobs each",
            flush=True,
        )

        def phase(name: str, prefix: str, run: Callable[[dict[str, Any]], list[str]]) -> None:
            print(f"{name}:", flush=True)
            report: dict[str, Any] = {"partial_seen": 0}
            fivexx, restart, outside = api.fivexx, api.fivexx_during_restart, len(stack.outside)
            jobs = run(report)
            audit(stack, api, jobs, prefix, report)
            report["fivexx"] = api.fivexx - fivexx
            report["fivexx_restart"] = api.fivexx_during_restart - restart
            report["outside"] = len(stack.outside) - outside
            phases[name] = report

        phase("kill rounds", "kill/", lambda r: kill_rounds(stack, api, args.rounds, args.tensors, r))
        phase("storm", "storm/", lambda r: storm(stack, api, args.submissions, r))
        phase(
            "S3 faults",
            "s3ok/",
            lambda r: s3_faults(stack, api, "s3ok/", args.s3_jobs, args.tensors, args.s3_rate, args.fanout_jobs, r),
        )
        stack.replace_workers(CKPTCONV_STORAGE_ATTEMPTS=str(args.exhaust_attempts))
        phase(
            "S3 budget exhausted",
            "s3exhaust/",
            lambda r: s3_faults(
                stack, api, "s3exhaust/", args.s3_jobs, args.tensors, args.exhaust_rate, args.fanout_jobs, r
            ),
        )
        seconds = round(time.monotonic() - t0, 1)
        # Every phase's uploads are counted under its prefix; this catches one anywhere else.
        uploads_left = len(stack.s3.list_multipart_uploads(Bucket=stack.bucket).get("Uploads", []))
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    names = list(phases)
    cells = [[label, *(cell(phases[n]) for n in names)] for label, cell in ROWS]
    widths = [max(len(row[i]) for row in [["", *names], *cells]) for i in range(len(names) + 1)]
    lines = [""] + ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in [["", *names], *cells]]
    kill, st = phases["kill rounds"], phases["storm"]
    lines += [
        "",
        f"workers killed: {kill['kills']} (fanned-out rounds: {kill['fanned']['s3']} to S3, "
        f"{kill['fanned']['local']} to local targets)",
        f"multipart uploads left open in the whole bucket: {uploads_left}",
        f"storm: {st['storm_requests']} requests in {st['storm_seconds']} s; "
        f"{st['storm_refused_rivals']} rival keys refused with target_taken; "
        f"{st['storm_unexpected_answers']} unexpected answers",
        f"S3 faults injected: {phases['S3 faults']['s3_faults']} of {phases['S3 faults']['s3_requests']} requests, "
        f"then {phases['S3 budget exhausted']['s3_faults']} of {phases['S3 budget exhausted']['s3_requests']}",
        f"run time: {seconds} s",
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
