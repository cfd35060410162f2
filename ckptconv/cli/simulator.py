"""Appliance simulator commands: ``verify`` (HF vs converted CS logits) and ``simulate`` (train, checkpoint)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


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
    p.add_argument(
        "--hf", required=True, dest="hf_dir", help="local Hugging Face model directory (config.json + weights)"
    )
    p.add_argument("--cs", required=True, dest="cs_ckpt", help="Cerebras checkpoint (.mdl, local path or s3://)")
    p.add_argument("--cs-config", required=True, help="Cerebras YAML config (model: or trainer: layout)")
    p.add_argument(
        "--model", required=True, help="Model Zoo model name (e.g. llama, roberta, bert-qa); picks both classes"
    )
    p.add_argument("--tolerance", type=float, default=1e-5, help="maximum absolute logit difference (default 1e-5)")
    p.add_argument("--rtol", type=float, default=0.0, help="add rtol * max|hf logit| to the tolerance (default 0)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="seed of the input token ids")
    p.add_argument(
        "--non-strict",
        action="store_true",
        help="accept missing/extra checkpoint keys (disable_strict_checkpoint_loading)",
    )
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
    p.add_argument("--model-dir", required=True, help="model directory (checkpoints_index.yaml lives here)")
    p.add_argument("--steps", type=int, help="train until this global step (default: the config's max_steps)")
    p.add_argument("--model", help="Model Zoo model name (default: the config's `name:`)")
    p.add_argument("--checkpoint", dest="ckpt_path", help="checkpoint to start from (overrides autoload)")
    p.add_argument("--checkpoint-steps", type=int, help="save every N steps (overrides the config)")
    p.add_argument("--batch-size", type=int, help="samples per step (default: the config's, else 2)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: the config's, else 16)")
    p.add_argument("--seed", type=int, help="data and initialisation seed (default: the config's, else 0)")
    p.add_argument("--stop-after", type=int, help="stop after this many steps without the final save (a killed job)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.set_defaults(func=cmd_simulate)


def _print_json(result: dict[str, Any]) -> None:
    json.dump(result, sys.stdout, indent=2, default=str)
    print()


def cmd_verify(args: argparse.Namespace) -> int:
    from ckptconv.engine.simulator.verify import verify

    result = verify(
        args.hf_dir,
        args.cs_ckpt,
        args.cs_config,
        args.model,
        args.tolerance,
        rtol=args.rtol,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        strict=not args.non_strict,
    )
    if args.json:
        _print_json(result)
    elif result["verdict"] == "skipped":
        print(f"verdict:  SKIPPED ({result['reason']})")
    else:
        print(f"model:    {result['model']} ({result['cs_class']} vs transformers {result['hf_class']})")
        print(f"inputs:   {result['inputs']}")
        for name, o in result["outputs"].items():
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
    from ckptconv.engine.simulator.trainer import simulate

    result = simulate(
        args.config,
        args.model_dir,
        args.steps,
        model=args.model,
        ckpt_path=args.ckpt_path,
        checkpoint_steps=args.checkpoint_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        stop_after=args.stop_after,
    )
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
