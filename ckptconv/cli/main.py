"""The ``ckptconv`` command line.

Each area of ckptconv registers its subcommands from its own module in ``ckptconv.cli``;
this file only assembles them and turns ckptconv errors into one clear line and a non-zero exit.
Command modules import heavy libraries (torch, h5py) inside their handlers, so ``ckptconv --help``
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ckptconv import __version__
from ckptconv.core.errors import CkptconvError

# Modules providing ``register(subparsers)``; order = order in --help.
COMMAND_MODULES = [
    "ckptconv.cli.engine",
    "ckptconv.cli.models",
    "ckptconv.cli.service",
    "ckptconv.cli.simulator",
    "ckptconv.cli.legacy",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptconv",
        description="Convert deep-learning checkpoints between formats and model layouts, one tensor at a time.",
    )
    parser.add_argument("--version", action="version", version=f"ckptconv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from ckptconv.formats.memory import bound_allocator

    bound_allocator()  # before any thread starts: see ckptconv.formats.memory
    try:
        rc = args.func(args)
    except CkptconvError as e:
        print(f"ckptconv: error [{e.code}]: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"  what to do: {e.hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ckptconv: interrupted; nothing was published", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`ckptconv models | head`): stop quietly, as other command-line tools do;
        # stdout is pointed at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
