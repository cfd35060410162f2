"""Cerebras H5 read/write speed against ``cp`` of the same bytes, through the format layer only.

Where ``convert_bench`` times whole CLI conversions (imports, planning, verification included),
this isolates the H5 source and sink: each case runs as its own process, in one session, so the
ratios compare like with like on a noisy machine:

- ``cp`` of the synthetic safetensors file (the baseline, + ``sync``),
- safetensors -> cs-h5 (our safetensors source, our H5 sink; fsync on commit),
- cs-h5 -> safetensors (our H5 source, our safetensors sink),
- cs-h5 read only (every tensor materialized, then dropped),
- the same H5 write with LZ4 chunks (``compression="lz4"``),
- the same H5 write with h5py's automatic chunks (``chunking="h5py"``), as cstorch writes it.

Figures exclude interpreter start-up and imports (printed separately). Page caches are dropped
before each case when the machine allows it.

    python -m bench.cs_h5_bench [--size 1GB] [--repeat 3] [--workdir .bench]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.disk import drop_caches

ROOT = Path(__file__).resolve().parent.parent


def _convert(src_fmt: str, src: str, dst_fmt: str, dst: str, options: dict) -> None:
    from ckptconv.formats import sink_class, source_class
    from ckptconv.storage import open_storage

    source = source_class(src_fmt)(open_storage(src), src)
    sink = sink_class(dst_fmt)(open_storage(dst), dst, **options)
    entries = source.entries()
    sink.begin(entries, source.spec)
    for e in entries:
        if e.kind != "link":
            sink.write(e.key, source.read(e.key))
    sink.commit()
    source.close()


def _read_only(src: str) -> None:
    from ckptconv.formats import source_class
    from ckptconv.storage import open_storage

    source = source_class("cs-h5")(open_storage(src), src)
    for e in source.entries():
        source.read(e.key)
    source.close()


def child(args: list[str]) -> None:
    """Run one case in this process and print its timings as JSON."""
    t0 = time.perf_counter()
    import torch  # noqa: F401 - the import cost is reported apart

    import ckptconv.formats.cs_h5
    import ckptconv.formats.safetensors_fmt  # noqa: F401

    t1 = time.perf_counter()
    case, src, dst = args[0], args[1], args[2]
    if case == "st2h5":
        _convert("safetensors", src, "cs-h5", dst, {})
    elif case == "st2h5-lz4":
        _convert("safetensors", src, "cs-h5", dst, {"compression": "lz4"})
    elif case == "st2h5-h5py":
        _convert("safetensors", src, "cs-h5", dst, {"chunking": "h5py"})
    elif case == "h52st":
        _convert("cs-h5", src, "safetensors", dst, {})
    elif case == "h5read":
        _read_only(src)
    t2 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"imports_s": t1 - t0, "work_s": t2 - t1, "peak_rss": rss}))


def run_case(cmd: list[str]) -> dict:
    start = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    subprocess.run(["sync"], check=True)
    wall = time.perf_counter() - start
    if cmd[0] == "cp":
        return {"work_s": wall, "imports_s": 0.0, "peak_rss": 0}
    data = json.loads(out.strip().splitlines()[-1])
    data["work_s"] = wall - data["imports_s"]  # the work and the final sync, without the imports
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=str(ROOT / ".bench"))
    ap.add_argument("--skip-h5py", action="store_true", help="skip the slow h5py-chunks case")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0

    from bench.convert_bench import _numel, generate, llama_shapes, parse_size

    size = parse_size(args.size)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    src_dir = work / f"llama-{args.size.lower()}"
    index = generate(src_dir, size, 1 << 62)  # one shard
    shard = next(iter(sorted(src_dir.glob("*.safetensors"))))
    total = shard.stat().st_size
    largest = max(2 * _numel(s) for _, s in llama_shapes(size))
    me = [sys.executable, "-m", "bench.cs_h5_bench", "--child"]
    mdl, mdl2, st = work / "bench.mdl", work / "bench-h5py.mdl", work / "bench-st"
    lz4 = work / "bench-lz4.mdl"
    cases = [
        ("cp (baseline)", ["cp", str(shard), str(work / "copy.bin")], [work / "copy.bin"]),
        ("safetensors -> cs-h5", [*me, "st2h5", str(index), str(mdl)], []),
        ("cs-h5 -> safetensors", [*me, "h52st", str(mdl), str(st)], [st]),
        ("cs-h5 read only", [*me, "h5read", str(mdl), "-"], []),
        ("safetensors -> cs-h5 (LZ4 chunks)", [*me, "st2h5-lz4", str(index), str(lz4)], [lz4]),
    ]
    if not args.skip_h5py:
        cases.append(("safetensors -> cs-h5 (h5py chunks)", [*me, "st2h5-h5py", str(index), str(mdl2)], [mdl2]))
    for p in (mdl, mdl2, lz4, st, work / "copy.bin"):
        _remove(p)
    dropped = drop_caches()
    results: dict[str, list[dict]] = {name: [] for name, _, _ in cases}
    for _ in range(args.repeat):
        _remove(mdl)
        for name, cmd, outs in cases:
            for p in outs:
                _remove(p)
            drop_caches()
            results[name].append(run_case(cmd))
    base = statistics.median(r["work_s"] for r in results["cp (baseline)"])
    print(
        f"\n{total / 1e9:.2f} GB bf16 in one safetensors file, largest tensor {largest / 1e6:.0f} MB; "
        f"page cache {'dropped' if dropped else 'NOT dropped'} before each case; median of {args.repeat}; "
        "times exclude interpreter start-up and imports"
    )
    print(f"{'case':<36} {'time':>7} {'MB/s':>7} {'x cp':>6} {'peak RSS':>9} {'imports':>8}")
    for name, runs in results.items():
        t = statistics.median(r["work_s"] for r in runs)
        rss = max(r["peak_rss"] for r in runs)
        imp = statistics.median(r["imports_s"] for r in runs)
        print(
            f"{name:<36} {t:>6.2f}s {total / t / 1e6:>7.0f} {t / base:>5.2f}x "
            f"{rss / 1e6 if rss else 0:>7.0f}MB {imp:>7.2f}s"
        )
    print(f"RSS target (2 x largest tensor + 300 MB): {(2 * largest + 300e6) / 1e6:.0f} MB")
    for p in (mdl, mdl2, lz4, st, work / "copy.bin"):
        _remove(p)
    return 0


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
