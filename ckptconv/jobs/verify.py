"""Job kind ``verify``: logits of a Cerebras checkpoint's simulated model against its Hugging Face model."""

from __future__ import annotations

from typing import Any

from ckptconv.core.errors import Cancelled, LogitMismatch
from ckptconv.jobs import JobContext, report_stage

# Recorded on the job (and, for a failing verdict, in the problem's details).
SUMMARY = ("verdict", "passed", "max_abs_diff", "max_rel_diff", "cosine_similarity", "tolerance", "rtol")


def run(ctx: JobContext) -> dict[str, Any]:
    # Deferred: the simulator loads torch, which the API and the CLI parser never need.
    from ckptconv.engine.simulator.verify import verify

    o = ctx.options
    report_stage(ctx, "verifying")
    result = verify(
        o.hf,
        ctx.source["uri"],
        o.config,
        o.model,
        o.tolerance,
        rtol=o.rtol,
        batch_size=o.batch_size,
        seq_len=o.seq_len,
        seed=o.seed,
        strict=o.strict,
    )
    # The two forward passes cannot be interrupted; a cancel that arrived meanwhile still wins.
    if ctx.cancelled():
        raise Cancelled("cancelled by request")
    # A model the simulator does not build is "skipped": not a mismatch, so never a failed job.
    if result["verdict"] == "fail" and o.fail_on_mismatch:
        raise LogitMismatch(
            f"{result['model']}: max |diff| {result['max_abs_diff']:.3e} exceeds tolerance {result['tolerance']:g}"
            f" (cosine {result['cosine_similarity']:.9f})",
            **{k: result[k] for k in SUMMARY},
            logits=result["outputs"],
        )
    # ``outputs`` of a job result lists files; the per-output comparisons are recorded as ``logits``.
    comparisons = result.pop("outputs", {})
    warnings = [] if result["passed"] else [f"verdict: {result['verdict']}"]
    return {**result, "logits": comparisons, "outputs": [], "warnings": warnings}
