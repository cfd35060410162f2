"""Job kind ``convert-model``: model-layout conversion through ``ckptconv.engine.layouts``."""

from __future__ import annotations

import os
from typing import Any

from ckptconv.core.errors import InvalidRequest
from ckptconv.core.uri import parent
from ckptconv.engine.layouts.api import (
    convert_model,
    convert_model_part,
    open_model_source,
    output_target,
    plan_model,
    planned_target,
)
from ckptconv.engine.run import end_unpublished
from ckptconv.jobs import JobContext
from ckptconv.jobs.convert import auto_parallelism
from ckptconv.storage import is_local, local_path_of


def _target(ctx: JobContext) -> tuple[str | None, bool]:
    """(output directory, export_safetensors) from the optional target and the options."""
    opts = ctx.options
    safetensors = bool(opts.export_safetensors)
    if ctx.target is None:
        return None, safetensors
    fmt = ctx.target.get("format")
    to_hf = opts.tgt_fmt == "hf"
    if to_hf and fmt not in (None, "safetensors", "torch"):
        raise InvalidRequest(f"tgt_fmt hf writes safetensors or torch files, not {fmt}", hint="set target.format")
    if not to_hf and fmt not in (None, "cs-h5"):
        raise InvalidRequest(f"tgt_fmt {opts.tgt_fmt} writes a cs-h5 checkpoint, not {fmt}", hint="set target.format")
    return ctx.target["uri"], safetensors or fmt == "safetensors"


def layout_options(o: Any) -> dict[str, Any]:
    """The keyword arguments of the engine's model conversion and plan, from the kind's options."""
    return {
        "model": o.model,
        "src_fmt": o.src_fmt,
        "tgt_fmt": o.tgt_fmt,
        "config": o.config,
        "drop_unmatched_keys": o.drop_unmatched_keys,
        "fold_lora": o.fold_lora,
        "fold_mup": o.fold_mup,
        "h5_compression": o.h5_compression,
    }


def _job_arguments(ctx: JobContext) -> dict[str, Any]:
    """What both the whole conversion and each of its parts pass to the engine."""
    out_dir, safetensors = _target(ctx)
    return {
        "dst": out_dir,
        "export_safetensors": safetensors,
        "hf_shard_size": ctx.options.hf_shard_size,
        "cancelled": ctx.cancelled,
        "job_id": ctx.job_id,
        "parts": ctx.parts,
        **layout_options(ctx.options),
    }


def run(ctx: JobContext) -> dict[str, Any]:
    result = convert_model(
        ctx.source["uri"],
        progress=ctx.progress,
        parallelism=ctx.options.parallelism,
        auto_parallelism=auto_parallelism(ctx.options.parallelism),
        **_job_arguments(ctx),
    )
    doc = result.to_dict()
    if ctx.options.verify:
        doc["simulator"] = _simulate(ctx, result)
        if not doc["simulator"].get("passed"):
            doc.setdefault("warnings", []).append(f"simulator verdict: {doc['simulator'].get('verdict')}")
    return doc


def run_part(ctx: JobContext, index: int) -> None:
    """One part of a model conversion ``run`` fanned out (``parallelism`` > 1)."""
    convert_model_part(ctx.source["uri"], index=index, **_job_arguments(ctx))


def _simulate(ctx: JobContext, result: Any) -> dict[str, Any]:
    """Compare the Hugging Face side with the simulator's model of the Cerebras side of a conversion."""
    o = ctx.options
    if o.tgt_fmt == "hf":
        hf, cs_ckpt, cs_cfg = result.target, ctx.source["uri"], o.config
    else:
        configs = [f.uri for f in result.outputs if f.role == "config"]
        hf, cs_ckpt, cs_cfg = ctx.source["uri"], result.target, configs[0] if configs else None
    if cs_cfg is None:
        return {"verdict": "skipped", "passed": False, "reason": "the Cerebras config is needed (options.config)"}
    # An HF source may name a weights file; the model is its directory.
    if is_local(hf) and not os.path.isdir(local_path_of(hf)):
        hf = os.path.dirname(local_path_of(hf))
    elif not is_local(hf) and hf.endswith((".safetensors", ".bin", ".json")):
        hf = parent(hf)
    # Deferred: the simulator loads torch, which the API and the CLI parser never need.
    from ckptconv.engine.simulator.verify import verify

    return verify(hf, cs_ckpt, cs_cfg, o.model)


def plan(ctx: JobContext) -> dict[str, Any]:
    out_dir, safetensors = _target(ctx)
    o = ctx.options
    src = open_model_source(ctx.source["uri"], o.model, o.src_fmt, ctx.source.get("format"))
    try:
        p = plan_model(src, export_safetensors=safetensors, **layout_options(ctx.options))
        doc = p.to_dict(source_sizes={e.key: e.nbytes for e in src.entries()}, limit=1000)
        doc["target"] = planned_target(src, p, ctx.options.config, out_dir)
    finally:
        src.close()
    doc["ok"] = not p.unmatched or ctx.options.drop_unmatched_keys
    doc["errors"] = [] if doc["ok"] else [f"{len(p.unmatched)} keys match no rule"]
    return doc


def cleanup(ctx: JobContext) -> dict[str, Any] | None:
    """Remove the staging area a lost worker may have left for this job; the job's result if a lost
    worker's publication finished (see :func:`end_unpublished`; without the simulator's verdict,
    which that worker took with it)."""
    if ctx.job_id is None:
        return None
    out_dir, _ = _target(ctx)
    return end_unpublished(
        output_target(
            ctx.source["uri"],
            ctx.options.tgt_fmt,
            ctx.options.config,
            out_dir,
            model=ctx.options.model,
            src_fmt=ctx.options.src_fmt,
        ),
        ctx.job_id,
    )
