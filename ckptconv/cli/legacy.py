"""Commands carried over from Cerebras' legacy checkpoint utilities.

- ``tensorflow-to-h5`` / ``h5-to-tensorflow``: a TensorFlow saver bundle to a Cerebras H5
  checkpoint and back (the engine's conversion, verified); also installed as console scripts of
  those names, as the original wheel's command-line utility was;
- ``fix-spec``: repair a release <= 1.7 checkpoint so 2.0+ loads it;
- ``convert-dataloader-state``: add the 1.9 data-iterator state to a checkpoint as 2.0's
  ``dataloader`` entry.

Option names keep the original scripts' spelling (``--fix_inplace``, ``--old_checkpoint`` ...) so
existing run books keep working.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ckptconv.cli.engine import SHARD_BY_HELP
from ckptconv.cli.kind_flags import add_kind_flags
from ckptconv.cli.main import main
from ckptconv.cli.output import ProgressBar
from ckptconv.cli.run_kind import run_command
from ckptconv.core.errors import InvalidRequest
from ckptconv.jobs import LocalSettings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tensorflow-to-h5", help="convert a TensorFlow checkpoint to a Cerebras H5 checkpoint")
    p.add_argument("saver_path", help="TensorFlow checkpoint prefix (dir/ckpt-1), its .index file, or its directory")
    p.add_argument("h5_path", help="Cerebras H5 file to write (.mdl / .h5)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_tensorflow_to_h5)

    p = sub.add_parser("h5-to-tensorflow", help="convert a Cerebras H5 checkpoint to a TensorFlow checkpoint")
    p.add_argument("h5_path", help="Cerebras H5 checkpoint (any format version)")
    p.add_argument("saver_path", help="TensorFlow checkpoint prefix to write (dir/ckpt writes dir/ckpt.index ...)")
    add_kind_flags(p, "convert", only=("shard_size",))
    p.add_argument("--shard-by", action="append", metavar="GLOB", help=SHARD_BY_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_h5_to_tensorflow)

    p = sub.add_parser(
        "fix-spec",
        help="repair a release <= 1.7 checkpoint (spec, tied weights, scheduler steps) so 2.0+ loads it",
    )
    p.add_argument("checkpoint_path", help="legacy Cerebras H5 checkpoint (local file)")
    p.add_argument("--fixed_checkpoint_path", help="where to write the repaired copy (default: <stem>_fixed<suffix>)")
    add_kind_flags(p, "fix-spec")
    p.add_argument("--fix_inplace", action="store_true", help="replace the checkpoint itself (asks for confirmation)")
    p.add_argument("--yes", "-y", action="store_true", help="confirm --fix_inplace without asking")
    p.add_argument("--json", action="store_true", help="print what was changed as JSON")
    p.set_defaults(func=cmd_fix_spec)

    p = sub.add_parser(
        "convert-dataloader-state",
        help="add a release 1.9 dataloader state to a checkpoint as the 2.0 'dataloader' entry",
    )
    p.add_argument("--old_checkpoint", "-c", required=True, help="the checkpoint saved with the 1.9 state files")
    p.add_argument("--output_file", "-o", required=True, help="Cerebras H5 checkpoint to write (format 0.5)")
    add_kind_flags(p, "dataloader-state")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_convert_dataloader_state)


def _print_result(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    data = [o for o in result["outputs"] if o["role"] != "manifest"]
    print(f"wrote {result['target']} ({result['format']}, {result['tensors']} tensors, {len(data)} files)")
    verify = result.get("verify") or {}
    if verify.get("ok"):
        print(f"verified: {verify.get('entries_checked', 0)} entries re-read and identical")
    for w in result.get("warnings") or []:
        print(f"warning: {w}")


def _convert_with_progress(args: argparse.Namespace, source: str, **context: Any) -> dict[str, Any]:
    bar = ProgressBar(not args.no_progress)
    try:
        return run_command(args, "convert", source, progress=bar, **context)
    finally:
        bar.close()


def cmd_tensorflow_to_h5(args: argparse.Namespace) -> int:
    result = _convert_with_progress(
        args, args.saver_path, source_format="tf", target=args.h5_path, target_format="cs-h5"
    )
    _print_result(result, args.json)
    return 0


def cmd_h5_to_tensorflow(args: argparse.Namespace) -> int:
    result = _convert_with_progress(
        args,
        args.h5_path,
        source_format="cs-h5",
        target=args.saver_path,
        target_format="tf",
        local=LocalSettings(shard_by=args.shard_by),
    )
    _print_result(result, args.json)
    return 0


def tensorflow_to_h5() -> int:
    """Console script ``tensorflow-to-h5 saver_path h5_path``, the original utility's command line."""
    return main(["tensorflow-to-h5", *sys.argv[1:]])


def h5_to_tensorflow() -> int:
    """Console script ``h5-to-tensorflow h5_path saver_path``, the original utility's command line."""
    return main(["h5-to-tensorflow", *sys.argv[1:]])


def _confirm(path: str) -> None:
    if not sys.stdin.isatty():
        raise InvalidRequest(
            f"--fix_inplace would rewrite {path} and needs a confirmation",
            hint="pass --yes to confirm without a terminal, or write a copy with --fixed_checkpoint_path",
        )
    answer = input(f"Rewrite {path} in place? [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise InvalidRequest("not confirmed; nothing was changed", hint="answer y, or pass --yes")


def cmd_fix_spec(args: argparse.Namespace) -> int:
    if args.fix_inplace and args.fixed_checkpoint_path:
        raise InvalidRequest("give --fixed_checkpoint_path or --fix_inplace, not both")
    if args.fix_inplace and not args.yes:
        _confirm(args.checkpoint_path)
    local = LocalSettings(inplace=args.fix_inplace)
    output = args.fixed_checkpoint_path
    report = run_command(args, "fix-spec", args.checkpoint_path, target=output, target_format="cs-h5", local=local)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(f"wrote {report['output']}")
    print("spec: rewritten" + (" (TensorScalarDict replaced by dict)" if report["tensor_scalar_dict"] else ""))
    for link in report["links"]:
        print(f"tied: {link['key']} -> {link['target']}")
    for key, value in report["last_epoch"].items():
        print(f"scheduler: {key} = {value}")
    for note in report["notes"]:
        print(f"note: {note}")
    return 0


def cmd_convert_dataloader_state(args: argparse.Namespace) -> int:
    result = run_command(args, "dataloader-state", args.old_checkpoint, target=args.output_file, target_format="cs-h5")
    _print_result(result, args.json)
    if args.json:
        return 0
    extras = result.get("extras") or {}
    print(f"dataloader: {json.dumps(extras.get('dataloader'))}")
    release = extras.get("release")
    if release:
        print(f"model layout: release {release} (convert-model --src-fmt cs-auto reads it as cs-{release})")
    return 0
