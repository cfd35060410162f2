"""The ``ckptconv`` command line.

Each area of ckptconv registers its subcommands from its own module in ``ckptconv.cli``;
this file only assembles them and turns ckptconv errors into one clear line and a non-zero exit.
Command modules import what only their commands use (torch, h5py, the engine, the model tables,
the service's HTTP and Redis clients) inside their handlers, so ``ckptconv --help`` and each command
start with only the modules they need.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from ckptconv import __version__
from ckptconv.core.errors import CkptconvError

# Exit statuses: 0 success, 1 a command's negative answer (`diff`: they differ), 2 a typed error,
# 70 (BSD's EX_SOFTWARE) an unexpected exception, that is a bug, 130 interrupted.
EXIT_ERROR = 2
EXIT_INTERNAL_ERROR = 70

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

    # Imported once the command is known: the formats (and numpy) are no part of `--help`.
    from ckptconv.formats.memory import bound_allocator

    bound_allocator()  # before any thread starts: see ckptconv.formats.memory
    try:
        rc = args.func(args)
    except CkptconvError as e:
        print(f"ckptconv: error [{e.code}]: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"  what to do: {e.hint}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("ckptconv: interrupted; nothing was published", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`ckptconv models | head`): stop quietly, as other command-line tools do;
        # stdout is pointed at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # after BrokenPipeError, which is an answer too
        # Exit 1 is an answer for some commands (`diff`: the checkpoints differ), so an unexpected
        # exception gets its own status and one typed line instead of Python's traceback and 1.
        print(f"ckptconv: error [internal_error]: {type(e).__name__}: {e}", file=sys.stderr)
        print(
            "  what to do: this is a bug in ckptconv; rerun with CKPTCONV_TRACEBACK=1 and report the traceback",
            file=sys.stderr,
        )
        if os.environ.get("CKPTCONV_TRACEBACK"):
            traceback.print_exc()
        return EXIT_INTERNAL_ERROR
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
