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
from ckptconv.core.errors import InvalidRequest


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
    p.add_argument("--shard-size", help="split the data into files of at most this size (e.g. 5GB)")
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
    p.add_argument("--fix_inplace", action="store_true", help="replace the checkpoint itself (asks for confirmation)")
    p.add_argument("--yes", "-y", action="store_true", help="confirm --fix_inplace without asking")
    p.add_argument("--json", action="store_true", help="print what was changed as JSON")
    p.set_defaults(func=cmd_fix_spec)

    p = sub.add_parser(
        "convert-dataloader-state",
        help="add a release 1.9 dataloader state to a checkpoint as the 2.0 'dataloader' entry",
    )
    p.add_argument("--old_checkpoint", "-c", required=True, help="the checkpoint saved with the 1.9 state files")
    p.add_argument(
        "--worker_data_iter_files_dir",
        "-w",
        required=True,
        help="the directory cerebras.save_iter_state_path named (data_iter_state_file_worker_*.txt)",
    )
    p.add_argument("--output_file", "-o", required=True, help="Cerebras H5 checkpoint to write (format 0.5)")
    p.add_argument("--dataloader_type", "-d", default="map", help="map (default) or iterable")
    p.add_argument("--shuffle_seed", "-s", type=int, default=0, help="shuffle seed of a map-style loader (default 0)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_convert_dataloader_state)


def _print_result(result: Any, as_json: bool) -> None:
    if as_json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        print()
        return
    data = [o for o in result.outputs if o.role != "manifest"]
    print(f"wrote {result.target} ({result.format}, {result.tensors} tensors, {len(data)} files)")
    verify = result.verify or {}
    if verify.get("ok"):
        print(f"verified: {verify.get('entries_checked', 0)} entries re-read and identical")
    for w in result.warnings:
        print(f"warning: {w}")


def _convert_with_progress(args: argparse.Namespace, source: str, target: str, **options: Any) -> Any:
    from ckptconv.cli.output import ProgressBar
    from ckptconv.engine.convert import convert

    bar = ProgressBar(not args.no_progress)
    try:
        return convert(source, target, progress=bar, **options)
    finally:
        bar.close()


def cmd_tensorflow_to_h5(args: argparse.Namespace) -> int:
    result = _convert_with_progress(args, args.saver_path, args.h5_path, to="cs-h5", source_format="tf")
    _print_result(result, args.json)
    return 0


def cmd_h5_to_tensorflow(args: argparse.Namespace) -> int:
    result = _convert_with_progress(
        args,
        args.h5_path,
        args.saver_path,
        to="tf",
        source_format="cs-h5",
        shard_size=args.shard_size,
        shard_by=args.shard_by,
    )
    _print_result(result, args.json)
    return 0


def tensorflow_to_h5() -> int:
    """Console script ``tensorflow-to-h5 saver_path h5_path``, the original utility's command line."""
    from ckptconv.cli.main import main

    return main(["tensorflow-to-h5", *sys.argv[1:]])


def h5_to_tensorflow() -> int:
    """Console script ``h5-to-tensorflow h5_path saver_path``, the original utility's command line."""
    from ckptconv.cli.main import main

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
    from ckptconv.engine.legacy.fix_spec import fix_checkpoint_spec

    if args.fix_inplace and args.fixed_checkpoint_path:
        raise InvalidRequest("give --fixed_checkpoint_path or --fix_inplace, not both")
    if args.fix_inplace and not args.yes:
        _confirm(args.checkpoint_path)
    report = fix_checkpoint_spec(args.checkpoint_path, args.fixed_checkpoint_path, inplace=args.fix_inplace)
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        print()
        return 0
    print(f"wrote {report.output}")
    print("spec: rewritten" + (" (TensorScalarDict replaced by dict)" if report.tensor_scalar_dict else ""))
    for key, target in report.links:
        print(f"tied: {key} -> {target}")
    for key, value in report.last_epoch.items():
        print(f"scheduler: {key} = {value}")
    for note in report.notes:
        print(f"note: {note}")
    return 0


def cmd_convert_dataloader_state(args: argparse.Namespace) -> int:
    from ckptconv.engine.legacy.dataloader_state import convert_dataloader_state

    result = convert_dataloader_state(
        args.old_checkpoint,
        args.worker_data_iter_files_dir,
        args.output_file,
        dataloader_type=args.dataloader_type,
        shuffle_seed=args.shuffle_seed,
    )
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        print()
        return 0
    _print_result(result, False)
    print(f"dataloader: {json.dumps(result.extras.get('dataloader'))}")
    release = result.extras.get("release")
    if release:
        print(f"model layout: release {release} (convert-model --src-fmt cs-auto reads it as cs-{release})")
    return 0
