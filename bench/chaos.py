"""Chaos run of the whole service: the long version of tests/test_faults.py.

    .venv/bin/python -m bench.chaos [--rounds 20] [--submissions 2000] [--workers 2] [--tensors 120]

Starts everything on loopback, in a temporary directory: a moto S3 server, a private
``redis-server`` with an append-only file, an API process and ``--workers`` worker processes. Then:

1. **Kill rounds**: each round submits a conversion, waits for a random moment of it (converting,
   verifying, or just after it was taken), SIGKILLs the worker running it and starts another one.
   Half-way, Redis itself is restarted (clean shutdown, AOF kept). A thread lists every target
   all along to catch anything partial that becomes visible.
2. **Submission storm**: ``--submissions`` jobs, each Idempotency-Key sent twice at once, plus, for
   one in ten, a second key naming the same target (exactly one of them must win). Jobs of the
   storm use small checkpoints; the ones still queued at the end are cancelled.

Then prints: jobs lost (accepted, later 404), stuck (not final at the end), duplicated (two jobs
for one key or one target), overwritten (outputs whose bytes differ from their job's result),
partial outputs visible (seen or left at a target without their manifest), staging and temp bytes
left, untyped errors (failures without a typed code, or internal_error), and 5xx answers (with how
many came while Redis was restarting). Never asserts; bounded in time; cleans up after itself.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
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
from pathlib import Path
from typing import Any

from bench.ports import free_port, wait_port

ROOT = Path(__file__).resolve().parent.parent
TERMINAL = {"succeeded", "failed", "cancelled"}
TYPED_FAILURES_EXCLUDED = {"internal_error", None, ""}


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

        (tmp / "keys.yaml").write_text(
            f'keys:\n  - name: chaos\n    sha256: {hash_key(self.key)}\n    prefixes: ["s3://{self.bucket}/"]\n'
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

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptconv", *args], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def start_worker(self) -> subprocess.Popen:
        proc = self._spawn("worker", ["worker", "--pool", "solo", "--loglevel", "info"])
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

    def stop(self) -> None:
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


def make_checkpoint(stack: Stack, key: str, n: int, seed: int) -> None:
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(seed)
    tensors = {f"layers.{i}.weight": torch.randn(16, 16, generator=g) for i in range(n)}
    stack.s3.put_object(Bucket=stack.bucket, Key=key, Body=save(tensors))


def listing(stack: Stack, prefix: str) -> dict[str, int]:
    pages = stack.s3.get_paginator("list_objects_v2").paginate(Bucket=stack.bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def submit(api: Api, source: str, target: str, key: str) -> Any:
    body = {"kind": "convert", "source": {"uri": source}, "target": {"uri": target, "format": "cs-h5"}}
    return api.call("POST", "/v1/jobs", json=body, headers={"Idempotency-Key": key})


def job_of(api: Api, job_id: str) -> dict[str, Any] | None:
    r = api.call("GET", f"/v1/jobs/{job_id}")
    return r.json() if r.status_code == 200 else None


def worker_running(stack: Stack, job_id: str) -> subprocess.Popen | None:
    import redis

    token = redis.Redis(port=stack.redis_port, decode_responses=True).hget(f"{stack.prefix}job:{job_id}", "worker")
    if not token:
        return None
    pid = int(token.split(":")[1])
    return next((p for p in stack.workers if p.pid == pid and p.poll() is None), None)


# --- the run ---------------------------------------------------------------------------------------


def kill_rounds(stack: Stack, api: Api, rounds: int, tensors: int, report: dict[str, Any]) -> list[str]:
    make_checkpoint(stack, "in/kill.safetensors", tensors, 1)
    source = f"s3://{stack.bucket}/in/kill.safetensors"
    jobs: list[str] = []
    snapshots: list[dict[str, int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                snapshots.append(listing(stack, "kill/"))
            except Exception:  # the S3 server is busy: try again
                pass
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    kills = 0
    for rnd in range(rounds):
        r = submit(api, source, f"s3://{stack.bucket}/kill/{rnd}/model.mdl", f"kill-{rnd}")
        job_id = r.json()["id"]
        jobs.append(job_id)
        moment = random.choice(["converting", "verifying", "taken"])
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
            time.sleep(0.1)
        victim = worker_running(stack, job_id)
        if victim is not None:
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait()
            kills += 1
            stack.workers.remove(victim)
            stack.workers.append(stack.start_worker())
        print(f"  round {rnd + 1}/{rounds}: killed at {moment}" + ("" if victim else " (already done)"), flush=True)
        if rnd == rounds // 2:
            print("  restarting Redis (AOF)", flush=True)
            stack.restart_redis()
    wait_final(api, jobs, timeout=900)
    stop.set()
    watcher.join()
    report["kills"] = kills
    report["partial_seen"] = partial_seen(stack, api, jobs, snapshots)
    return jobs


def partial_seen(stack: Stack, api: Api, jobs: list[str], snapshots: list[dict[str, int]]) -> int:
    """Objects seen at a target with a size other than their final one, or a manifest seen before its outputs."""
    bad = 0
    finals: dict[str, dict[str, int]] = {}
    for job_id in jobs:
        job = job_of(api, job_id) or {}
        if job.get("state") == "succeeded":
            outs = {o["uri"].split("/", 3)[3]: o["size"] for o in job["result"]["outputs"]}
            finals[job["result"]["manifest"].split("/", 3)[3]] = outs
    final_listing = listing(stack, "kill/")
    for snap in snapshots:
        for key, size in snap.items():
            if key.endswith(".ckptconv-job.json"):
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
    report["storm_duplicated"] = duplicated
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


def audit(stack: Stack, api: Api, jobs: list[str], report: dict[str, Any]) -> None:
    lost = stuck = untyped = overwritten = 0
    states: dict[str, int] = {}
    targets_done: dict[str, str] = {}
    for job_id in jobs:
        job = job_of(api, job_id)
        if job is None:
            lost += 1
            continue
        states[job["state"]] = states.get(job["state"], 0) + 1
        if job["state"] not in TERMINAL:
            stuck += 1
        if job["state"] == "failed" and (job.get("error") or {}).get("code") in TYPED_FAILURES_EXCLUDED:
            untyped += 1
        if job["state"] == "succeeded":
            target = job["target"]["uri"]
            if target in targets_done:
                report["duplicated_targets"] = report.get("duplicated_targets", 0) + 1
            targets_done[target] = job_id
            for o in job["result"]["outputs"]:
                key = o["uri"].split("/", 3)[3]
                try:
                    data = stack.s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read()
                except Exception:
                    overwritten += 1
                    continue
                if len(data) != o["size"] or hashlib.sha256(data).hexdigest() != o["sha256"]:
                    overwritten += 1
            manifest = json.loads(
                stack.s3.get_object(Bucket=stack.bucket, Key=job["result"]["manifest"].split("/", 3)[3])["Body"].read()
            )
            if manifest.get("job_id") != job_id:
                overwritten += 1
    # Targets with data but no manifest (a partial output left behind).
    left_partial = 0
    everything = listing(stack, "")
    by_target: dict[str, list[str]] = {}
    for key in everything:
        parts = key.split("/")
        if parts[0] in ("kill", "storm") and ".ckptconv-staging" not in key and not key.endswith(".ckptconv-job.json"):
            by_target.setdefault("/".join(parts[:2]), []).append(key)
    for keys in by_target.values():
        if not any(k.endswith(("manifest.json", ".manifest.json")) for k in keys):
            left_partial += 1
    staging = sum(size for key, size in everything.items() if ".ckptconv-staging" in key)
    scratch = sum(f.stat().st_size for f in (stack.tmp / "scratch").rglob("*") if f.is_file())
    report.update(
        jobs=len(jobs),
        states=states,
        lost=lost,
        stuck=stuck,
        untyped=untyped,
        overwritten=overwritten,
        partial_left=left_partial,
        staging_bytes=staging,
        scratch_bytes=scratch,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--submissions", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tensors", type=int, default=120)
    args = parser.parse_args()
    random.seed(11)
    tmp = Path(tempfile.mkdtemp(prefix="ckptconv-chaos-"))
    stack = Stack(tmp, args.workers)
    report: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        api = Api(stack)
        print(
            f"chaos: {args.rounds} kill rounds, Redis restart with AOF, {args.submissions} submissions x2", flush=True
        )
        jobs = kill_rounds(stack, api, args.rounds, args.tensors, report)
        jobs += storm(stack, api, args.submissions, report)
        audit(stack, api, jobs, report)
        report["fivexx"] = api.fivexx
        report["fivexx_during_redis_restart"] = api.fivexx_during_restart
        report["seconds"] = round(time.monotonic() - t0, 1)
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    duplicated = report.get("storm_duplicated", 0) + report.get("duplicated_targets", 0)
    print(
        "\n".join(
            [
                "",
                f"jobs:                        {report['jobs']} ({report['kills']} workers killed)",
                f"final states:                {report['states']}",
                f"jobs lost:                   {report['lost']}",
                f"jobs stuck:                  {report['stuck']}",
                f"jobs duplicated:             {duplicated}",
                f"outputs overwritten:         {report['overwritten']}",
                f"partial outputs visible:     {report['partial_seen']} seen, {report['partial_left']} left",
                f"staging bytes left:          {report['staging_bytes']}",
                f"temp (scratch) bytes left:   {report['scratch_bytes']}",
                f"untyped errors:              {report['untyped']}",
                f"5xx answers:                 {report['fivexx']}",
                f"  503 while Redis restarted: {report['fivexx_during_redis_restart']} (down, and 5 s after)",
                f"storm: {report['storm_requests']} requests in {report['storm_seconds']} s; "
                f"{report['storm_refused_rivals']} rival keys refused with target_taken; "
                f"{report['storm_unexpected_answers']} unexpected answers",
                f"run time: {report['seconds']} s",
            ]
        )
    )


if __name__ == "__main__":
    main()
