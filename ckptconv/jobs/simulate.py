"""Job kind ``simulate``: train a few steps on CPU and write checkpoints by the trainer's policy."""

from __future__ import annotations

from typing import Any

from ckptconv.jobs import JobContext, describe_outputs, report_stage


def run(ctx: JobContext) -> dict[str, Any]:
    # Deferred: the simulator loads torch, which the API and the CLI parser never need.
    from ckptconv.engine.simulator.trainer import simulate

    o = ctx.options
    report_stage(ctx, "training")
    result = simulate(
        ctx.source["uri"],
        o.model_dir,
        o.steps,
        model=o.model,
        ckpt_path=o.checkpoint,
        checkpoint_steps=o.checkpoint_steps,
        batch_size=o.batch_size,
        seq_len=o.seq_len,
        seed=o.seed,
        stop_after=ctx.local.stop_after,
        on_step=lambda step, start, end: ctx.progress(_step_progress(step, start, end)),
        cancelled=ctx.cancelled,
    )
    # Retention may have deleted early checkpoints again; list only what is there now.
    deleted = set(result.get("deleted") or [])
    written = [u for u in [*result["checkpoints"], *result["state_checkpoints"]] if u not in deleted]
    return {**result, "outputs": describe_outputs(written, role="checkpoint"), "warnings": list(result["warnings"])}


def _step_progress(step: int, start: int, end: int) -> dict[str, Any]:
    """A training run counts steps, not tensors: the progress document carries both."""
    done, total = step - start, max(end - start, 0)
    return {
        "stage": "training",
        "tensors_done": 0,
        "tensors_total": 0,
        "bytes_done": 0,
        "bytes_total": 0,
        "global_step": step,
        "steps_done": done,
        "steps_total": total,
        "fraction": round(done / total, 4) if total else None,
    }
