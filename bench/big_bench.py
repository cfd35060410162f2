"""Bigger than memory: convert a checkpoint the size of this machine's RAM (or as large as its disk
allows) from safetensors to Cerebras H5 on local disk, and show that memory stays flat.

Generates a synthetic Llama-style bf16 checkpoint (``bench.convert_bench.generate``), then runs,
each as a separate process with the page cache dropped before it when the machine allows (root):

- ``cp`` of the same shards (the baseline),
- ``ckptconv convert <index> out.mdl --to cs-h5`` (with its verification read-back),

sampling the converter's resident set (``/proc/<pid>/status``) every ``--interval`` seconds. It
prints wall time, throughput against ``cp``, peak RSS and the peak of each tenth of the run, so a
growing footprint shows as a rising row.

The size defaults to the machine's RAM, capped so that the source and one output (the ``cp``
copy is deleted before the conversion) fit on the work directory's disk with ``--reserve`` left
free; the printout says when the disk, not RAM, set the size.

    python -m bench.big_bench [--size auto|20GB] [--reserve 12GB] [--workdir .bench-big] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.convert_bench import ROOT, compile_sources, generate_in_child, llama_shapes, parse_size
from bench.disk import drop_caches

CKPTCONV = [sys.executable, "-m", "ckptconv"]


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_size(text: str, workdir: Path, reserve: int) -> tuple[int, str]:
    """The checkpoint size and why: RAM, or what the disk allows, or what was asked."""
    if text != "auto":
        return parse_size(text), "asked"
    ram = ram_bytes()
    disk = (shutil.disk_usage(workdir).free - reserve) // 2  # the source and one output at a time
    if disk < ram:
        return disk, f"disk: {shutil.disk_usage(workdir).free / 1e9:.0f} GB free, {reserve / 1e9:.0f} GB kept free"
    return int(ram * 1.1), "RAM x 1.1"


def rss_of(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def run_sampled(cmd: list[str], interval: float) -> tuple[float, list[tuple[float, int]]]:
    """Wall seconds (command + sync) and RSS samples ``(t, bytes)`` of one child process."""
    samples: list[tuple[float, int]] = []
    start = time.perf_counter()
    with open(os.devnull, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE)
        while proc.poll() is None:
            samples.append((time.perf_counter() - start, rss_of(proc.pid)))
            time.sleep(interval)
        stderr = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"command failed: {' '.join(cmd)}\n{stderr[-3000:]}")
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start, samples


def deciles(samples: list[tuple[float, int]], wall: float) -> list[int]:
    """Peak RSS of each tenth of the run."""
    out = [0] * 10
    for t, rss in samples:
        i = min(9, int(10 * t / wall)) if wall > 0 else 0
        out[i] = max(out[i], rss)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="auto", help="checkpoint size, or auto (RAM, capped by the disk)")
    ap.add_argument("--reserve", default="12GB", help="disk space left free for others (default 12GB)")
    ap.add_argument("--shard-size", default="5GB", help="source shard size (default 5GB)")
    ap.add_argument("--interval", type=float, default=0.25, help="RSS sampling interval in seconds")
    ap.add_argument("--workdir", default=str(ROOT / ".bench-big"), help="where files go (default .bench-big/)")
    ap.add_argument("--keep", action="store_true", help="keep the source checkpoint")
    args = ap.parse_args(argv)

    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    size, why = choose_size(args.size, work, parse_size(args.reserve))
    print(f"RAM {ram_bytes() / 1e9:.1f} GB; checkpoint {size / 1e9:.1f} GB ({why})", flush=True)
    src = work / "llama-big"
    t0 = time.perf_counter()
    generate_in_child(src, size, parse_size(args.shard_size))
    compile_sources()
    shards = sorted(src.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    largest = max(2 * n for n in (_numel(s) for _, s in llama_shapes(size)))
    print(f"generated {total / 1e9:.2f} GB in {len(shards)} shards in {time.perf_counter() - t0:.0f} s", flush=True)

    copy, mdl, index = work / "copy", work / "out.mdl", src / "model.safetensors.index.json"
    cases = [
        ("cp (baseline)", ["cp", "-r", str(src), str(copy)], [copy]),
        (
            "safetensors -> cs-h5",
            [*CKPTCONV, "convert", str(index), str(mdl), "--to", "cs-h5", "--no-progress"],
            [mdl, Path(str(mdl) + ".manifest.json")],
        ),
    ]
    dropped = False
    results = []
    try:
        for name, cmd, outputs in cases:
            dropped = drop_caches()
            wall, samples = run_sampled(cmd, args.interval)
            results.append((name, wall, samples))
            for p in outputs:  # one output on disk at a time
                _remove(p)
    finally:
        for p in (copy, mdl, Path(str(mdl) + ".manifest.json")):
            _remove(p)
        if not args.keep:
            _remove(src)

    print(f"\npage cache {'dropped' if dropped else 'NOT dropped (not root)'} before each case")
    print(f"{'case':<24} {'wall':>8} {'MB/s':>8} {'x cp':>6} {'peak RSS':>10}")
    base = results[0][1]
    for name, wall, samples in results:
        peak = max((r for _, r in samples), default=0)
        print(f"{name:<24} {wall:>7.1f}s {total / wall / 1e6:>8.0f} {wall / base:>6.2f} {peak / 1e6:>8.0f}MB")
    name, wall, samples = results[-1]
    print(f"\n{name}: {len(samples)} RSS samples; peak RSS of each tenth of the run (MB):")
    print("  " + " ".join(f"{r / 1e6:.0f}" for r in deciles(samples, wall)))
    print(f"RSS target (2 x largest tensor + 300 MB): {(2 * largest + 300e6) / 1e6:.0f} MB")
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.unlink()


if __name__ == "__main__":
    sys.exit(main())
