"""Conversion benchmark: ckptconv against a plain copy of the same bytes, measured in one run.

Generates a synthetic Llama-style bf16 checkpoint (sharded safetensors, default about 3 GB in
1 GB shards), then times, each as a separate process so that its peak RSS is its own:

- ``cp`` of the shards (the baseline),
- safetensors -> Cerebras H5,
- Cerebras H5 -> safetensors,
- Cerebras H5 -> sharded PyTorch ``.bin``,

and prints wall time, throughput, the ratio to the baseline and peak RSS. Every command ends with
``sync``, and the page cache is dropped before each when the machine allows it (root), as the
figures otherwise mostly measure memory copies. Timings on a shared machine vary; compare ratios
measured in the same run, medians over ``--repeat`` runs.

    python -m bench.convert_bench [--size 3GB] [--repeat 3] [--workdir .bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VOCAB = 32000
HIDDEN = 2048
INTERMEDIATE = 5632
HEADS = 32
KV_HEADS = 4


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for u, m in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def llama_shapes(target_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of a Llama-style model whose bf16 size is about ``target_bytes``."""
    head_dim = HIDDEN // HEADS
    kv = KV_HEADS * head_dim
    layer = [
        ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
        ("self_attn.k_proj.weight", (kv, HIDDEN)),
        ("self_attn.v_proj.weight", (kv, HIDDEN)),
        ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
        ("mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
        ("mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
        ("mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        ("input_layernorm.weight", (HIDDEN,)),
        ("post_attention_layernorm.weight", (HIDDEN,)),
    ]
    per_layer = sum(2 * _numel(s) for _, s in layer)
    fixed = 2 * (2 * VOCAB * HIDDEN + HIDDEN)
    n_layers = max(1, round((target_bytes - fixed) / per_layer))
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(n_layers):
        shapes += [(f"model.layers.{i}.{name}", shape) for name, shape in layer]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def generate(out: Path, size: int, shard: int) -> Path:
    """Write the synthetic checkpoint as HF-style sharded safetensors (skipped when already there)."""
    import torch
    from safetensors.torch import save_file

    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        return index_path
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shapes = llama_shapes(size)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    acc = 0
    for name, shape in shapes:
        nbytes = 2 * _numel(shape)
        if groups[-1] and acc + nbytes > shard:
            groups.append([])
            acc = 0
        groups[-1].append((name, shape))
        acc += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    total = 0
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            t = torch.empty(shape, dtype=torch.bfloat16)
            t.normal_(0.0, 0.02, generator=gen)
            tensors[name] = t
            weight_map[name] = fname
            total += 2 * _numel(shape)
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        del tensors
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    tmp.rename(out)
    return index_path


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_measured(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds (command + sync) and peak RSS in bytes of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"command failed: {' '.join(cmd)}\n{stderr[-3000:]}")
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="3GB", help="checkpoint size (default 3GB)")
    ap.add_argument("--shard-size", default="1GB", help="source shard size (default 1GB)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each case; medians are printed")
    ap.add_argument("--workdir", default=str(ROOT / ".bench"), help="where files go (default .bench/)")
    ap.add_argument("--keep", action="store_true", help="keep the outputs")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args(argv)

    size = parse_size(args.size)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"llama-{args.size.lower()}"
    print(f"generating a synthetic Llama-style bf16 checkpoint of about {size / 1e9:.2f} GB in {src} ...", flush=True)
    index = generate(src, size, parse_size(args.shard_size))
    shards = sorted(src.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    largest = max(2 * _numel(s) for _, s in llama_shapes(size))
    exe = [sys.executable, "-m", "ckptconv"]
    mdl = work / "out.mdl"

    def outputs(path: Path) -> list[Path]:
        return [path, Path(str(path) + ".manifest.json"), path / "manifest.json"]

    # (name, command, outputs, kept for the next cases)
    cases = [
        ("cp (baseline)", ["cp", "-r", str(src), str(work / "copy")], [work / "copy"], False),
        (
            "safetensors -> cs-h5",
            [*exe, "convert", str(index), str(mdl), "--to", "cs-h5", "--no-progress"],
            outputs(mdl),
            True,
        ),
        (
            "cs-h5 -> safetensors",
            [
                *exe,
                "convert",
                str(mdl),
                str(work / "st"),
                "--to",
                "safetensors",
                "--shard-size",
                "1GB",
                "--no-progress",
            ],
            outputs(work / "st"),
            False,
        ),
        (
            "cs-h5 -> torch .bin (sharded)",
            [*exe, "convert", str(mdl), str(work / "bin"), "--to", "torch", "--shard-size", "1GB", "--no-progress"],
            outputs(work / "bin"),
            False,
        ),
    ]
    dropped = drop_caches()
    results = []
    for name, cmd, outs, needed_later in cases:
        walls, rss = [], []
        for _ in range(args.repeat):
            for p in outs:
                _remove(p)
            drop_caches()
            wall, peak = run_measured(cmd)
            walls.append(wall)
            rss.append(peak)
        if not (needed_later or args.keep):
            for p in outs:
                _remove(p)
        results.append({"case": name, "wall_s": statistics.median(walls), "peak_rss": max(rss), "runs": walls})
    base = results[0]["wall_s"]
    print()
    print(
        f"checkpoint: {len(shards)} shards, {total / 1e9:.2f} GB, largest tensor {largest / 1e6:.0f} MB;"
        f" page cache {'dropped' if dropped else 'NOT dropped (not root)'} before each run;"
        f" median of {args.repeat}"
    )
    print(f"{'case':<32} {'wall':>8} {'MB/s':>8} {'x cp':>6} {'peak RSS':>10}  {'RSS target':>10}")
    target_rss = 2 * largest + 300e6
    for r in results:
        print(
            f"{r['case']:<32} {r['wall_s']:>7.2f}s {total / r['wall_s'] / 1e6:>8.0f} {r['wall_s'] / base:>5.2f}x"
            f" {r['peak_rss'] / 1e6:>8.0f}MB  {'' if r is results[0] else f'{target_rss / 1e6:>8.0f}MB'}"
        )
    if args.json:
        print(json.dumps({"bytes": total, "largest_tensor": largest, "results": results}, indent=2))
    if not args.keep:
        for p in outputs(mdl):
            _remove(p)
    return 0


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


if __name__ == "__main__":
    sys.exit(main())
