"""Service commands: run it (``serve``, ``worker``), use it (``submit``, ``status``, ``wait``, ``jobs``,
``cancel``) and manage its API keys (``keys``).

Client commands talk HTTP to ``--url`` (default ``$CKPTCONV_URL``, else http://127.0.0.1:8000) with
``--api-key`` (default ``$CKPTCONV_API_KEY``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from ckptconv.cli.output import human_size, output_digest
from ckptconv.core.errors import Cancelled, CkptconvError, InvalidRequest, NotFound, ServiceUnavailable
from ckptconv.core.scopes import canonical_prefix
from ckptconv.jobs.kinds import KINDS

# The service's clients (httpx, redis) and its settings are imported by the commands that use them:
# every other command (a local `convert` among them) would pay for them at start-up.


def register(sub: argparse._SubParsersAction) -> None:
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--url", default=None, help="service URL (default: $CKPTCONV_URL or http://127.0.0.1:8000)")
    client.add_argument("--api-key", default=None, help="API key (default: $CKPTCONV_API_KEY)")
    client.add_argument("--json", action="store_true", help="print JSON")
    client.add_argument(
        "--retries",
        type=int,
        default=6,
        help="resend a request this many times on connection errors, 429 and 503 (default 6)",
    )

    p = sub.add_parser("serve", help="run the HTTP API (uvicorn)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1, help="API processes (default 1)")
    p.add_argument("--api-keys-file", help="YAML/JSON file of hashed API keys (in addition to keys in Redis)")
    p.add_argument(
        "--dev", action="store_true", help="development mode: no authentication (refused outside development)"
    )
    p.add_argument("--log-level", default="info")
    p.add_argument("--access-log", action="store_true", help="log every request (costs throughput)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "worker",
        help="run a worker (Celery) that executes jobs, dry runs and webhooks",
        description=(
            "Conversions are long and dry runs, inspections and webhook deliveries short, so they have "
            "their own queues. Run conversion workers with --queues jobs and at least one "
            "`ckptconv worker --interactive` beside them: plans then answer in seconds however busy the "
            "conversions are. Without either option a worker consumes both queues (one process for "
            "everything; a plan then waits while that worker converts)."
        ),
    )
    p.add_argument("--queues", help="comma-separated queues (default: the jobs and interactive queues)")
    p.add_argument(
        "--interactive",
        action="store_true",
        help="consume only the interactive queue (plans, inspections, webhooks), with threads (default 4)",
    )
    p.add_argument(
        "--pool",
        choices=["prefork", "solo", "threads"],
        help="Celery pool (default prefork; threads with --interactive)",
    )
    p.add_argument("--concurrency", type=int, help="tasks at once per worker (default 1; 4 with --interactive)")
    p.add_argument("--hostname", help="worker name (default: celery's)")
    p.add_argument("--loglevel", default="info")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("submit", parents=[client], help="submit a job to the service")
    p.add_argument("source", help="source URI (s3://bucket/key or an absolute path the workers can read)")
    p.add_argument("target", nargs="?", help="target URI")
    p.add_argument("--to", help="target format (cs-h5, safetensors, torch, tf, cs-s3)")
    p.add_argument("--from", dest="source_format", help="source format (default: detected)")
    p.add_argument(
        "--kind",
        default="convert",
        help=f"job kind: {', '.join(KINDS)} (default convert; the service's own list: `GET /v1/kinds`)",
    )
    p.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="K=V",
        help="kind option (JSON value), named as in the kind's model: `ckptconv <command> --help` shows them as flags",
    )
    p.add_argument("--label", "-l", action="append", default=[], metavar="K=V", help="label the job")
    p.add_argument("--webhook", help="URL to POST the finished job to")
    p.add_argument("--webhook-secret", help="webhook signing secret (whsec_...)")
    p.add_argument("--max-runtime", type=int, help="fail the job after this many seconds")
    p.add_argument("--idempotency-key", help="retry-safe key (default: a fresh one)")
    p.add_argument("--wait", action="store_true", help="wait for the job to end, with a progress bar")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", parents=[client], help="show a job")
    p.add_argument("job_id")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("wait", parents=[client], help="wait for a job to end, with a progress bar")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, help="give up after this many seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("jobs", parents=[client], help="list jobs, newest first")
    p.add_argument("--state", choices=["queued", "running", "cancelling", "succeeded", "failed", "cancelled"])
    p.add_argument("--kind")
    p.add_argument("--label", "-l", action="append", default=[], metavar="K=V")
    p.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("cancel", parents=[client], help="cancel a job")
    p.add_argument("job_id")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("keys", help="manage the service's API keys (stored hashed in Redis)")
    keys_sub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    k = keys_sub.add_parser("create", help="create a key scoped to URI prefixes; prints it once")
    k.add_argument("--name", required=True)
    k.add_argument("--prefix", action="append", required=True, help="allowed URI prefix (repeatable)")
    k.add_argument("--file", help="append the hash to this keys file instead of Redis (for --api-keys-file)")
    k.set_defaults(func=cmd_keys_create)
    k = keys_sub.add_parser("list", help="list keys (names, ids, prefixes; never the keys)")
    k.set_defaults(func=cmd_keys_list)
    k = keys_sub.add_parser("revoke", help="revoke a key by id (key_...) or sha256")
    k.add_argument("ident")
    k.set_defaults(func=cmd_keys_revoke)


# --- running the service ------------------------------------------------------------------------


def _settings() -> Any:
    from pydantic import ValidationError

    from ckptconv.core.settings import Settings

    try:
        return Settings()
    except ValidationError as e:
        msgs = "; ".join(str(err.get("msg", "")).removeprefix("Value error, ") for err in e.errors())
        raise InvalidRequest(f"invalid settings: {msgs}", hint="see CKPTCONV_* variables in README.md") from None


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ckptconv.cli.http_protocol import HeadDeadlineProtocol

    if args.dev:
        os.environ["CKPTCONV_ENVIRONMENT"] = "development"
        os.environ["CKPTCONV_AUTH_DISABLED"] = "true"
    if args.api_keys_file:
        os.environ["CKPTCONV_API_KEYS_FILE"] = os.path.abspath(args.api_keys_file)
    _settings()  # fail here, with one line, rather than in every API process
    options: dict[str, Any] = {
        "factory": True,
        "host": args.host,
        "port": args.port,
        "workers": args.workers,
        "log_level": args.log_level,
        "access_log": args.access_log,
        "loop": "auto",
        # uvicorn's httptools protocol (what "auto" picks) with a deadline on request heads.
        "http": HeadDeadlineProtocol,
    }
    if args.workers > 1:
        from ckptconv.cli.api_processes import serve

        # Not uvicorn's own multi-process mode: these processes take the socket's connections in turn.
        return serve(uvicorn.Config("service.app:create_app", **options))
    uvicorn.run("service.app:create_app", **options)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    settings = _settings()
    if args.interactive:
        queues = settings.interactive_queue
    else:
        queues = args.queues or f"{settings.jobs_queue},{settings.interactive_queue}"
    pool = args.pool or ("threads" if args.interactive else "prefork")
    concurrency = args.concurrency or (4 if args.interactive else 1)
    argv = [
        sys.executable,
        "-m",
        "celery",
        "--app=worker.celery_app",
        "worker",
        f"--queues={queues}",
        f"--pool={pool}",
        f"--concurrency={concurrency}",
        f"--loglevel={args.loglevel}",
        # Workers need no gossip, clock sync or event heartbeats among themselves; start fast.
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    if args.hostname:
        argv.append(f"--hostname={args.hostname}")
    # The worker is its own front end: this process becomes it (same pid, same signals).
    os.execv(sys.executable, argv)
    return 0  # not reached


# --- client commands --------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from ckptconv.client import Client

    return Client(args.url, args.api_key, retries=args.retries)


def _pairs(items: list[str], what: str, parse_json: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise InvalidRequest(f"{what} {item!r} is not K=V")
        if parse_json:
            try:
                out[k] = json.loads(v)
            except ValueError:
                out[k] = v
        else:
            out[k] = v
    return out


def _print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2)
    print()


def _print_job(job: dict[str, Any]) -> None:
    print(f"job:      {job['id']}  ({job['kind']})")
    print(f"state:    {job['state']}")
    print(f"source:   {job['source']['uri']}")
    if job.get("target"):
        print(f"target:   {job['target']['uri']} ({job['target']['format']})")
    if job.get("labels"):
        print("labels:   " + ", ".join(f"{k}={v}" for k, v in job["labels"].items()))
    p = job.get("progress")
    if p and not job["done"]:
        print(
            f"progress: {p['stage']} {p['tensors_done']}/{p['tensors_total']} tensors, "
            f"{human_size(p['bytes_done'])}/{human_size(p['bytes_total'])}"
        )
    print(f"created:  {job['created_at']}")
    if job.get("finished_at"):
        print(f"finished: {job['finished_at']}")
    result = job.get("result")
    if result:
        print("outputs:")
        for o in result.get("outputs", []):
            print(f"  {o['uri']}  {human_size(o['size'])}  {output_digest(o)}")
        if result.get("manifest"):
            print(f"manifest: {result['manifest']}")
        for w in result.get("warnings", []):
            print(f"warning:  {w}")
    if job.get("error"):
        e = job["error"]
        print(f"error:    [{e['code']}] {e['detail']}")
        if e.get("hint"):
            print(f"          what to do: {e['hint']}")


def _outcome(job: dict[str, Any]) -> int:
    """Exit status for a finished job: a failed job exits like a local error would."""
    if job["state"] == "failed" and job.get("error"):
        raise CkptconvError.from_problem(job["error"])
    if job["state"] == "cancelled":
        raise Cancelled(f"job {job['id']} was cancelled")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    webhook = None
    if args.webhook:
        webhook = {"url": args.webhook, **({"secret": args.webhook_secret} if args.webhook_secret else {})}
    with _client(args) as c:
        job = c.submit(
            args.source,
            args.target,
            to=args.to,
            source_format=args.source_format,
            kind=args.kind,
            options=_pairs(args.option, "option", parse_json=True),
            labels=_pairs(args.label, "label"),
            webhook=webhook,
            max_runtime_seconds=args.max_runtime,
            idempotency_key=args.idempotency_key,
        )
        if not args.wait:
            if args.json:
                _print_json(job)
            else:
                print(job["id"])
            return 0
        if not args.json:
            print(f"submitted {job['id']}", file=sys.stderr)
        return _wait(c, job["id"], args, timeout=None, progress=not args.json)


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.get(args.job_id)
    if args.json:
        _print_json(job)
    else:
        _print_job(job)
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    with _client(args) as c:
        return _wait(c, args.job_id, args, timeout=args.timeout, progress=not (args.no_progress or args.json))


def _wait(c: Any, job_id: str, args: argparse.Namespace, *, timeout: float | None, progress: bool) -> int:
    bar = _ProgressBar() if progress else None
    try:
        job = c.wait(job_id, timeout=timeout, on_progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    if args.json:
        _print_json(job)
    else:
        _print_job(job)
    return _outcome(job)


class _ProgressBar:
    """A tqdm bar over the bytes of the current stage, restarted when the stage changes."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.stage: str | None = None

    def update(self, job: dict[str, Any]) -> None:
        from tqdm import tqdm

        p = job.get("progress")
        if not p or p["stage"] == "done" or job["done"]:
            return
        if p["stage"] != self.stage or self.bar is None:
            if self.bar is not None:
                self.bar.close()
            self.stage = p["stage"]
            self.bar = tqdm(total=p["bytes_total"] or None, desc=p["stage"], unit="B", unit_scale=True, file=sys.stderr)
        self.bar.n = p["bytes_done"]
        self.bar.set_postfix_str(f"{p['tensors_done']}/{p['tensors_total']} tensors", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as c:
        jobs = []
        for job in c.iter_jobs(state=args.state, kind=args.kind, labels=_pairs(args.label, "label")):
            jobs.append(job)
            if len(jobs) >= args.limit:
                break
    if args.json:
        _print_json(jobs)
        return 0
    for job in jobs:
        target = (job.get("target") or {}).get("uri", "")
        print(f"{job['id']}  {job['state']:<10}  {job['kind']:<8}  {job['created_at']}  {target}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.cancel(args.job_id)
    if args.json:
        _print_json(job)
    else:
        print(f"{job['id']}: {job['state']}")
    return 0


# --- API keys ----------------------------------------------------------------------------------


def _without_password(url: str) -> str:
    """``url`` fit for an error message: a password in it (``redis://user:secret@host``) is not."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


@contextlib.contextmanager
def _key_store() -> Iterator[tuple[Any, Any]]:
    """A Redis client and the key names for the block, once Redis has answered. A Redis that does
    not answer, or fails a command of the block (it went away, or refuses this client), is a typed
    503-style error naming the URL, not a crash in the middle of a key command."""
    import redis

    from ckptconv.core.jobstore import RedisKeys

    settings = _settings()
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True, socket_connect_timeout=5)
    try:
        client.ping()
        yield client, RedisKeys(settings.redis_prefix, settings.broker_prefix)
    except redis.RedisError as e:
        raise ServiceUnavailable(
            f"Redis at {_without_password(settings.redis_url)} does not answer: {e}",
            hint="start Redis or set CKPTCONV_REDIS_URL to one that runs and lets this client in; API keys live there",
        ) from e


def cmd_keys_create(args: argparse.Namespace) -> int:
    from ckptconv.core.auth import create_key, generate_key, hash_key

    prefixes = [canonical_prefix(p) for p in args.prefix]
    for given, prefix in zip(args.prefix, prefixes, strict=True):
        if given != prefix:
            print(f"note: prefix {given!r} stored as {prefix!r} (prefixes match whole segments)", file=sys.stderr)
    if args.file:
        import yaml

        key = generate_key()
        doc = {"keys": []}
        if os.path.exists(args.file):
            with open(args.file) as f:
                doc = yaml.safe_load(f) or {"keys": []}
        doc.setdefault("keys", []).append({"name": args.name, "sha256": hash_key(key), "prefixes": prefixes})
        with open(args.file, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
    else:
        with _key_store() as (client, keys):
            key, _ = create_key(client, keys, args.name, prefixes)
    print(key)
    print("store this key now: only its hash is kept", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from ckptconv.core.auth import list_keys

    with _key_store() as (client, keys):
        records = list_keys(client, keys)
    for rec in records:
        print(f"{rec.get('id')}  {rec.get('name')}  created {rec.get('created_at')}  {', '.join(rec['prefixes'])}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from ckptconv.core.auth import revoke_key

    with _key_store() as (client, keys):
        revoked = revoke_key(client, keys, args.ident)
    if not revoked:
        raise NotFound(f"no API key {args.ident}")
    print(f"revoked {args.ident} (API processes forget it within their cache time)")
    return 0
