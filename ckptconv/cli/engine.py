"""Container commands: ``inspect`` (``info``), ``convert``, ``diff``, ``plan``, ``formats``.

``convert`` given ``--model``/``--src-fmt``/``--tgt-fmt`` is the Model Zoo's ``convert_checkpoint.py
convert`` form: the model conversion of ``convert-model``.
"""

from __future__ import annotations

import argparse
import json
import sys

from ckptconv.cli.kind_flags import add_kind_flags, dest, flag, flags_of, given_options, kind_options
from ckptconv.cli.models import MODEL_FORM_FLAGS, model_conversion_arguments, output_dir_of, run_model_conversion
from ckptconv.cli.output import ProgressBar, human_size, print_result
from ckptconv.cli.run_kind import plan_kind, run_command
from ckptconv.core.errors import InvalidRequest
from ckptconv.jobs import LocalSettings

# The engine and the formats are imported by the commands that use them (see ckptconv.cli.main).

# Options both kinds of `convert` take: one flag, the container form's, read by either form.
SHARED_OPTIONS = ("h5_compression",)

SHARD_BY_HELP = (
    "shard the TensorFlow output by weight names: one data file per glob pattern (repeat the flag; "
    "'*' also matches '/'), a last file for the rest, e.g. --shard-by 'layer_0/*' --shard-by 'layer_1/*'"
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", aliases=["info"], help="show a checkpoint's format, release, keys, dtypes and shapes")
    p.add_argument("uri", help="local path or s3://bucket/key (file, index file, or directory)")
    p.add_argument("--from", dest="source_format", help="source format (default: detected)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--allow-incomplete", action="store_true", help="read a Cerebras H5 without __SUCCESS__")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "convert",
        help="convert a checkpoint between container formats (SRC DST --to FMT) or, given --model/--src-fmt/"
        "--tgt-fmt, between model layouts (as convert-model)",
    )
    p.add_argument("source", help="local path or s3://bucket/key of the source checkpoint")
    p.add_argument(
        "target", nargs="?", help="where to write (a file for cs-h5, a directory or file for safetensors/torch)"
    )
    p.add_argument("--to", dest="to", help="target format (cs-h5, safetensors, torch, tf, cs-s3)")
    p.add_argument("--from", dest="source_format", help="source format (default: detected)")
    add_kind_flags(p, "convert")
    p.add_argument("--shard-by", action="append", metavar="GLOB", help=SHARD_BY_HELP)
    p.add_argument("--no-verify", action="store_true", help="skip verification (not recommended)")
    p.add_argument("--no-progress", "--no-progress-bar", action="store_true", help="no progress bar")
    p.add_argument("--allow-incomplete", action="store_true", help="read a Cerebras H5 without __SUCCESS__")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    model_conversion_arguments(p, required=False, exclude=SHARED_OPTIONS)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "diff",
        help="compare two checkpoints (any formats) tensor by tensor; exit status 1 when they differ",
    )
    p.add_argument("a", help="first checkpoint (local path or s3://)")
    p.add_argument("b", help="second checkpoint")
    p.add_argument("--from-a", dest="format_a", help="format of the first (default: detected)")
    p.add_argument("--from-b", dest="format_b", help="format of the second (default: detected)")
    p.add_argument(
        "--tensor_comparison_op",
        "--tensor-comparison-op",
        dest="op",
        choices=["equal", "allclose"],
        default="equal",
        help="equal: bit for bit (default); allclose: within --rtol/--atol",
    )
    p.add_argument("--rtol", type=float, default=1e-5, help="allclose relative tolerance (default 1e-5)")
    p.add_argument("--atol", type=float, default=1e-8, help="allclose absolute tolerance (default 1e-8)")
    p.add_argument("--allow-incomplete", action="store_true", help="read a Cerebras H5 without __SUCCESS__")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("plan", help="dry run: what a conversion would write, from metadata only")
    p.add_argument("source")
    p.add_argument("--to", required=True)
    p.add_argument("--from", dest="source_format")
    p.add_argument(
        "--target", default="", help="where the output would go: an s3:// target's upload buffers count in the memory"
    )
    add_kind_flags(p, "convert")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("formats", help="list the container formats")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_formats)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ckptconv.engine.convert import inspect

    view = inspect(args.uri, source_format=args.source_format, allow_incomplete=args.allow_incomplete or None)
    if args.json:
        json.dump(view, sys.stdout, indent=2)
        print()
        return 0
    info = view.get("info") or {}
    print(f"uri:      {view['uri']}")
    print(f"format:   {view['format']}")
    for k in ("release", "format_version", "cstorch_version"):
        if info.get(k) is not None:
            print(f"{k + ':':<9} {info[k]}")
    print(f"keys:     {view['keys']} ({view['tensors']} tensors)")
    print(f"bytes:    {view['total_bytes']} ({human_size(view['total_bytes'])})")
    if view["dtypes"]:
        print("dtypes:   " + ", ".join(f"{d} x{n}" for d, n in sorted(view["dtypes"].items())))
    print()
    width = min(max((len(e["key"]) for e in view["entries"]), default=10), 90)
    for e in view["entries"]:
        if e["kind"] in ("tensor", "array"):
            desc = f"{e['dtype']:<9} {e['shape']}" + ("  (numpy)" if e["kind"] == "array" else "")
        elif e["kind"] == "link":
            desc = f"-> {e['target']}"
        elif e["kind"] == "value":
            desc = f"= {e['value']!r}"
        else:
            desc = f"object ({e['bytes']} bytes)"
        print(f"  {e['key']:<{width}}  {desc}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    model_form = given_options(args, "convert-model")
    if {"model", "src_fmt", "tgt_fmt"} & set(model_form):
        return _convert_model_form(args)
    if args.target is None:
        raise InvalidRequest(
            "convert needs a target: convert SRC DST --to FORMAT",
            hint="for a model conversion give --model, --src-fmt and --tgt-fmt (see convert-model)",
        )
    stray = [flags_of("convert-model", n) for n in model_form]
    stray += [f for f, d in MODEL_FORM_FLAGS.items() if getattr(args, d) not in (None, False)]
    if stray:
        raise InvalidRequest(
            f"{', '.join(stray)} belong to a model conversion",
            hint="add --model, --src-fmt and --tgt-fmt, or run convert-model",
        )
    local = LocalSettings(
        allow_incomplete=args.allow_incomplete or None, shard_by=args.shard_by, skip_verify=args.no_verify
    )
    bar = ProgressBar(not args.no_progress)
    try:
        result = run_command(
            args,
            "convert",
            args.source,
            source_format=args.source_format,
            target=args.target,
            target_format=args.to,
            local=local,
            progress=bar,
        )
    finally:
        bar.close()
    print_result(result, args.json)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    options = kind_options(args, "convert")
    # A plan reads only the source: of the target it needs the format, and where it is (S3 or not).
    view = plan_kind(
        "convert", options, args.source, source_format=args.source_format, target=args.target, target_format=args.to
    )
    json.dump(view, sys.stdout, indent=2)
    print()
    return 0 if view.get("ok") else 2


def cmd_formats(args: argparse.Namespace) -> int:
    from ckptconv.formats import FORMATS

    rows = [f.describe() for f in FORMATS.values()]
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    for r in rows:
        rw = ("r" if r["read"] else "-") + ("w" if r["write"] else "-")
        print(f"{r['name']:<12} {rw}  {r['description']}")
    return 0


def _convert_model_form(args: argparse.Namespace) -> int:
    """``convert --model M --src-fmt F --tgt-fmt G [--output-dir D] CKPT``: the model conversion."""
    missing = [flag(n) for n in ("model", "src_fmt", "tgt_fmt") if not getattr(args, dest("convert-model", n))]
    if missing:
        raise InvalidRequest(
            f"a model conversion needs {', '.join(missing)} too",
            hint="give --model, --src-fmt and --tgt-fmt (see `ckptconv models`), or convert SRC DST --to FORMAT",
        )
    container = {
        "--to": args.to,
        "--from": args.source_format,
        "--shard-by": args.shard_by,
        "--no-verify": args.no_verify,
        "--allow-incomplete": args.allow_incomplete,
    }
    for option in SHARED_OPTIONS:
        setattr(args, dest("convert-model", option), getattr(args, dest("convert", option)))
    stray = [flags_of("convert", n) for n in given_options(args, "convert") if n not in SHARED_OPTIONS]
    stray += [name for name, value in container.items() if value not in (None, False)]
    if stray:
        raise InvalidRequest(
            f"{', '.join(stray)} belong to a container conversion, not a model conversion",
            hint="a model conversion takes --hf-shard-size and --export-safetensors (see convert-model --help)",
        )
    return run_model_conversion(args, output_dir_of(args, args.target))


def cmd_diff(args: argparse.Namespace) -> int:
    from ckptconv.engine.diff import diff_checkpoints

    bar = ProgressBar(not (args.no_progress or args.json))
    try:
        result = diff_checkpoints(
            args.a,
            args.b,
            format_a=args.format_a,
            format_b=args.format_b,
            op=args.op,
            rtol=args.rtol,
            atol=args.atol,
            progress=bar,
            allow_incomplete=args.allow_incomplete or None,
        )
    finally:
        bar.close()
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        print()
        return 0 if result.identical else 1
    for key in result.only_in_a:
        print(f"only in A: {key}")
    for key in result.only_in_b:
        print(f"only in B: {key}")
    for d in result.differences:
        for what in d.what:
            if what == "values":
                sizes = ""
                if d.max_abs_diff is not None:
                    sizes = f"  max |a-b| {d.max_abs_diff:.6g}, max relative {d.max_rel_diff:.6g}"
                print(f"values:    {d.key}{sizes}")
            else:
                print(f"{what + ':':<10} {d.key}  {d.a.get(what)} vs {d.b.get(what)}")
    same = result.compared - len(result.differences)
    print(
        f"A: {result.a}\nB: {result.b}\n{result.compared} keys in both ({result.op}): {same} same, "
        f"{len(result.differences)} different; {len(result.only_in_a)} only in A, {len(result.only_in_b)} only in B"
    )
    print("identical" if result.identical else "checkpoints differ")
    return 0 if result.identical else 1
