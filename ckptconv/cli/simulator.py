"""Appliance simulator commands: ``verify`` (HF vs converted CS logits) and ``simulate`` (train, checkpoint)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ckptconv.cli.kind_flags import add_kind_flags
from ckptconv.cli.run_kind import run_command
from ckptconv.jobs import LocalSettings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="run a Hugging Face model and the Cerebras model of a converted checkpoint; compare logits",
        description=(
            "Loads the Hugging Face model from a local directory (no downloads) and the Cerebras checkpoint "
            "into the simulator's model (strict key matching), runs both on the same deterministic inputs "
            "in float32 and compares every output. Exit status 0 when within tolerance, 1 otherwise."
        ),
    )
    p.add_argument("--cs", required=True, dest="cs_ckpt", help="Cerebras checkpoint (.mdl, local path or s3://)")
    add_kind_flags(p, "verify")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "simulate",
        help="train a few steps on CPU and write checkpoints the way the Cerebras trainer does",
        description=(
            "Builds the model of a Cerebras config, loads a checkpoint (--checkpoint, or the latest one in the "
            "model directory when autoload_last_checkpoint is on), trains on deterministic synthetic data with "
            "the config's optimizer and scheduler up to global step --steps, and saves checkpoints by the "
            "trainer's policy (cadence, naming, index, retention, state subsets)."
        ),
    )
    p.add_argument("--config", required=True, help="Cerebras YAML config (local path or s3://)")
    add_kind_flags(p, "simulate")
    p.add_argument("--stop-after", type=int, help="stop after this many steps without the final save (a killed job)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.set_defaults(func=cmd_simulate)


def _print_json(result: dict[str, Any]) -> None:
    json.dump(result, sys.stdout, indent=2, default=str)
    print()


def cmd_verify(args: argparse.Namespace) -> int:
    result = run_command(args, "verify", args.cs_ckpt)
    if args.json:
        _print_json(result)
    elif result["verdict"] == "skipped":
        print(f"verdict:  SKIPPED ({result['reason']})")
    else:
        print(f"model:    {result['model']} ({result['cs_class']} vs transformers {result['hf_class']})")
        print(f"inputs:   {result['inputs']}")
        for name, o in result["logits"].items():
            if "error" in o:
                print(f"{name}: {o['error']}")
                continue
            print(
                f"{name}: max |diff| {o['max_abs_diff']:.3e}  relative {o['max_rel_diff']:.3e}  "
                f"cosine {o.get('cosine_similarity', float('nan')):.9f}"
            )
        t = result["timings"]
        print(
            f"time:     hf {t['hf_seconds']}s, cs load {t['cs_load_seconds']}s, cs forward {t['cs_forward_seconds']}s"
        )
        print(f"verdict:  {result['verdict'].upper()} (tolerance {result['tolerance']:g}, rtol {result['rtol']:g})")
    return 0 if result["passed"] else 1


def cmd_simulate(args: argparse.Namespace) -> int:
    local = LocalSettings(stop_after=args.stop_after)
    result = run_command(args, "simulate", args.config, local=local)
    if args.json:
        _print_json(result)
        return 0
    if result["loaded_from"]:
        print(f"loaded:      {result['loaded_from']} (global step {result['start_step']})")
    state = "stopped" if result["interrupted"] else "finished"
    print(f"{state}:    global step {result['global_step']} of {result['max_steps']} in {result['seconds']}s")
    for uri in result["checkpoints"]:
        print(f"saved:       {uri}")
    for uri in result["state_checkpoints"]:
        print(f"state saved: {uri}")
    for uri in result["deleted"]:
        print(f"deleted:     {uri}")
    for w in result["warnings"]:
        print(f"warning:     {w}")
    return 0
