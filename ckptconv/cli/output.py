"""What the command line prints for engine work: sizes, a progress bar, a conversion's result."""

from __future__ import annotations

import json
import sys
from typing import Any


def human_size(n: float | None) -> str:
    """Bytes in decimal units (``427.52 KB``); ``-`` when unknown."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


class ProgressBar:
    """A tqdm progress bar fed by engine progress snapshots (one bar per stage)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.stage: str | None = None

    def __call__(self, p: Any) -> None:
        if not self.enabled or p.stage in ("planning", "done"):
            if p.stage == "done":
                self.close()
            return
        from tqdm import tqdm

        if p.stage != self.stage:
            self.close()
            self.stage = p.stage
            self.bar = tqdm(
                total=p.bytes_total,
                unit="B",
                unit_scale=True,
                desc=f"{p.stage:<10}",
                file=sys.stderr,
                dynamic_ncols=True,
            )
        self.bar.n = p.bytes_done
        self.bar.set_postfix_str(f"{p.tensors_done}/{p.tensors_total} tensors", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def print_result(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    verify = result.get("verify") or {}
    print(
        f"wrote {result['tensors']} tensors, {human_size(result['bytes'])} as {result['format']} to {result['target']}"
    )
    for o in result["outputs"]:
        print(f"  {o['role']:<7} {o['uri']}  {human_size(o['size'])}  {output_digest(o, width=16)}")
    print(f"  manifest {result['manifest']}")
    if verify.get("ok") and verify.get("mode") == "hashes":
        print(
            f"verified: OK, {verify['entries_checked']} entries hashed as read and as written matched"
            f" ({verify.get('hash')}; --full-verify re-reads the output)"
        )
    elif verify.get("ok"):
        print(f"verified: OK, {verify['entries_checked']} entries re-read and matched ({verify.get('hash')})")
    elif verify.get("skipped"):
        print("verified: skipped (--no-verify)")
    for w in result.get("warnings") or []:
        print(f"warning: {w}")
    t = result.get("timings") or {}
    if t:
        print("timings: " + ", ".join(f"{k.removesuffix('_s')} {v:.2f}s" for k, v in t.items()))


def output_digest(output: dict[str, Any], width: int | None = None) -> str:
    """An output's digest as printed, named by its hash (``blake3:``; ``sha256:`` in a result of an
    earlier version), or for a file written out of order (no digest) its block digest with the
    block size it was computed over, as the manifest records it; ``width``: hex digits shown."""
    # Here, not at the top: the storage package is no part of `--help` (see ckptconv.cli.main).
    from ckptconv.storage.digests import ALGORITHM, entry_digests

    try:
        algorithm, digest, blocks = entry_digests(output)
    except ValueError:
        return f"{ALGORITHM}:-"
    if digest:
        return f"{algorithm}:{digest[:width]}"
    if blocks:
        return f"{algorithm}-blocks:{blocks[algorithm][:width]} ({human_size(blocks['block_size'])} blocks)"
    return f"{algorithm}:-"
