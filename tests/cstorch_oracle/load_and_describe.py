"""Load checkpoints with the real ``cerebras.pytorch.load`` and describe them (oracle venv only).

Usage: ``load_and_describe.py [--out RESULT.json] PATH...``

Writes (to ``--out``, else stdout) one JSON object keyed by PATH: ``{"loaded": <tree node>,
"ties": [[flat key, ...], ...], "error": null}``, or ``{"error": "<Type>: <message>", "phase":
"load" | "read"}`` when cstorch refuses the file (``load``) or fails on the first use of a value
(``read``: cstorch reads datasets lazily). One process for all paths: importing cstorch is slow.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")

import cerebras.pytorch as cstorch  # noqa: E402
from describe_tree import describe, ties  # noqa: E402


def describe_file(path: str) -> dict:
    try:
        tree = cstorch.load(path)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "phase": "load", "traceback": traceback.format_exc()}
    try:
        return {"loaded": describe(tree), "ties": ties(tree), "error": None}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "phase": "read", "traceback": traceback.format_exc()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON here instead of stdout")
    ap.add_argument("paths", nargs="+")
    args = ap.parse_args(argv)
    result = {p: describe_file(p) for p in args.paths}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
