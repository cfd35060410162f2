"""Model-layout commands: ``models``, ``convert-model``, ``convert-config``.

``convert-model`` names its outputs as the Cerebras Model Zoo does (``<name>_to_cs-2.9.mdl`` with
``<config>_to_cs-2.9.yaml``, or a ``<name>_to_hf/`` directory with ``config.json``) in the output
directory (default: beside the input).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ckptconv.cli.kind_flags import add_kind_flags, kind_options
from ckptconv.cli.output import ProgressBar, print_result
from ckptconv.cli.run_kind import run_kind
from ckptconv.core.errors import InvalidRequest

# The model layouts (ckptconv.engine.layouts: its YAML tables are read and checked when first used)
# are imported by the commands that use them, not by every command that registers its flags here.


def register(sub: argparse._SubParsersAction) -> None:
    # `list-converters` (and its older name `list`) is the Model Zoo's spelling of the same view.
    for name, aliases in (("models", []), ("list-converters", ["list"])):
        p = sub.add_parser(
            name, aliases=aliases, help="list the model names, their classes and the layouts each converts between"
        )
        p.add_argument("name", nargs="?", help="show one model: family, classes, formats, key rules ('all': the list)")
        p.add_argument("--hide-notes", action="store_true", help="leave out the notes")
        p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(func=cmd_models)

    p = sub.add_parser(
        "convert-model",
        help="convert a checkpoint and its config between Hugging Face and Cerebras Model Zoo layouts",
    )
    p.add_argument("source", help="checkpoint: HF file / index / directory, or a Cerebras .mdl (local or s3://)")
    p.add_argument("output_dir_pos", nargs="?", metavar="output_dir", help="same as --output-dir")
    model_conversion_arguments(p, required=True)
    p.add_argument("--no-progress", "--no-progress-bar", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_convert_model)

    p = sub.add_parser("convert-config", help="convert a model config between Hugging Face and Cerebras layouts")
    p.add_argument("config", help="HF config.json or Cerebras YAML")
    p.add_argument("--model", required=True)
    p.add_argument("--src-fmt", required=True, help="hf or cs-X.Y")
    p.add_argument("--tgt-fmt", required=True, help="hf, cs-X.Y or cs-current")
    p.add_argument("--output-dir", help="where to write <name>_to_<fmt>.json|yaml (default: beside the input)")
    p.add_argument("--json", action="store_true", help="print the converted config as JSON instead of writing it")
    p.set_defaults(func=cmd_convert_config)


# Flags of a model conversion that are not options of the kind (what the command line does with it).
MODEL_FORM_FLAGS = {"--output-dir": "output_dir", "--dry-run": "dry_run", "--debug": "debug"}


def model_conversion_arguments(p: argparse.ArgumentParser, *, required: bool, exclude: tuple[str, ...] = ()) -> None:
    """The options of a model conversion (the ``convert-model`` kind's), spelled as the Model Zoo's
    ``convert_checkpoint.py convert`` spells them; shared by ``convert-model`` and the model form of
    ``convert`` (whose container form already has a flag for the options in ``exclude``)."""
    add_kind_flags(p, "convert-model", required=required, exclude=exclude)
    p.add_argument("--output-dir", help="output directory (default: beside the input)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (keys, recipes, config) and write nothing")
    p.add_argument("--debug", action="store_true", help="print each match (source recipe -> new key) before converting")


def output_dir_of(args: argparse.Namespace, positional: str | None) -> str | None:
    """The output directory given positionally or with --output-dir (not two different ones)."""
    if positional and args.output_dir and positional != args.output_dir:
        raise InvalidRequest(
            f"two output directories: {positional} and --output-dir {args.output_dir}", hint="give one of them"
        )
    return positional or args.output_dir


def _formats_short(formats: list[str]) -> str:
    cs = [f for f in formats if f.startswith("cs-")]
    parts = [f for f in formats if not f.startswith("cs-")]
    if cs:
        parts.append(cs[0] if len(cs) == 1 else f"{cs[0]}..{cs[-1]}")
    return ", ".join(parts)


def _classes(m: dict[str, Any]) -> str:
    """``HF class <-> CS class`` of a model (``-`` for a side it has no class on)."""
    return f"{', '.join(m.get('hf_architectures') or []) or '-'} <-> {m.get('cs_class') or '-'}"


def cmd_models(args: argparse.Namespace) -> int:
    from ckptconv.engine.layouts.registry import describe_model, list_models

    if args.name and args.name.lower() != "all":
        view = describe_model(args.name)
        if args.hide_notes:
            view.pop("notes", None)
        if args.json:
            json.dump(view, sys.stdout, indent=2)
            print()
            return 0
        print(f"model:    {view['name']}" + (f" (alias of {view['alias_of']})" if view.get("alias_of") else ""))
        if view["family"] is None:  # a wrapper of another model (dpo)
            print(f"family:   - ({view['description']})")
        else:
            print(f"family:   {view['family']} - {view['description']}")
        print(f"formats:  {', '.join(view['formats'])}")
        print(f"HF class: {', '.join(view.get('hf_architectures') or []) or '-'}")
        print(f"CS class: {view.get('cs_class') or '-'}")
        for n in view.get("notes", []):
            print(f"note:     {n}")
        sides = "Hugging Face <-> Cerebras" if "hf" in view["formats"] else "cs-1.6 <-> later Cerebras releases"
        print(f"key rules ({sides}):")
        for r in view["key_rules"]:
            print(f"  {r}")
        return 0
    models = list_models()
    if args.hide_notes:
        for m in models:
            m.pop("notes", None)
    if args.json:
        json.dump({"models": models}, sys.stdout, indent=2)
        print()
        return 0
    width = max(len(m["name"]) for m in models)
    print(f"{'model':<{width}}  {'family':<11} {'formats':<20} classes (Hugging Face <-> Cerebras)")
    for m in models:
        if not m["supported"]:
            print(f"{m['name']:<{width}}  {'-':<11} not convertible: {m['reason']}")
            continue
        if m["family"] is None:  # a wrapper of another model (dpo)
            print(f"{m['name']:<{width}}  {'-':<11} {m['description']}  [{_classes(m)}]")
        else:
            alias = f"  (= {m['alias_of']})" if m.get("alias_of") else ""
            print(f"{m['name']:<{width}}  {m['family']:<11} {_formats_short(m['formats']):<20} {_classes(m)}{alias}")
        for n in m.get("notes") or []:
            print(f"{'':<{width}}    note: {n}")
    return 0


def cmd_convert_model(args: argparse.Namespace) -> int:
    return run_model_conversion(args, output_dir_of(args, args.output_dir_pos))


def run_model_conversion(args: argparse.Namespace, output_dir: str | None) -> int:
    from ckptconv.engine.layouts.api import open_model_source, plan_model
    from ckptconv.jobs.convert_model import layout_options

    options = kind_options(args, "convert-model")
    if args.dry_run or args.debug:
        src = open_model_source(args.source, options.model, options.src_fmt)
        try:
            plan = plan_model(src, export_safetensors=options.export_safetensors, **layout_options(options))
            sizes = {e.key: e.nbytes for e in src.entries()}
        finally:
            src.close()
        if args.dry_run:
            json.dump(plan.to_dict(source_sizes=sizes), sys.stdout, indent=2, default=str)
            print()
            return 2 if plan.unmatched and not options.drop_unmatched_keys else 0
        for step in plan.steps:  # the Model Zoo's --debug lists each match as "old -> new"
            print(f"{step.recipe} -> {step.out.key}", file=sys.stderr)

    bar = ProgressBar(not args.no_progress)
    try:
        view = run_kind("convert-model", options, args.source, target=output_dir, progress=bar)
    finally:
        bar.close()
    print_result(view, args.json)
    if not options.verify:
        return 0
    sim = view["simulator"]
    if not args.json:
        print(f"simulator: {sim.get('verdict')} (max |diff| {sim.get('max_abs_diff')}, ", end="")
        print(f"cosine {sim.get('cosine_similarity')})")
    return 0 if sim.get("passed") else 2


def cmd_convert_config(args: argparse.Namespace) -> int:
    from ckptconv.engine.layouts.api import convert_config

    out = convert_config(
        args.config,
        model=args.model,
        src_fmt=args.src_fmt,
        tgt_fmt=args.tgt_fmt,
        output_dir=args.output_dir,
        write=not args.json,
    )
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    print(f"wrote {out['path']}")
    for w in out.get("warnings") or []:
        print(f"warning: {w}")
    if out.get("ignored_keys"):
        print(f"not converted (no rule): {', '.join(out['ignored_keys'])}")
    return 0
