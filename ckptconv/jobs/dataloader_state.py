"""Job kind ``dataloader-state``: add a release 1.9 dataloader state to a checkpoint as 2.0's entry."""

from __future__ import annotations

from typing import Any

from ckptconv.core.errors import InvalidRequest
from ckptconv.engine.legacy.dataloader_state import convert_dataloader_state
from ckptconv.engine.run import end_unpublished
from ckptconv.jobs import JobContext


def run(ctx: JobContext) -> dict[str, Any]:
    assert ctx.target is not None  # the kind requires a target; the API validated it
    if ctx.target.get("format") != "cs-h5":
        raise InvalidRequest(f"dataloader-state writes a cs-h5 checkpoint, not {ctx.target.get('format')}")
    result = convert_dataloader_state(
        ctx.source["uri"],
        ctx.options.iter_dir,
        ctx.target["uri"],
        dataloader_type=ctx.options.dataloader_type,
        shuffle_seed=ctx.options.shuffle_seed,
        progress=ctx.progress,
        cancelled=ctx.cancelled,
        job_id=ctx.job_id,
    )
    return result.to_dict()


def cleanup(ctx: JobContext) -> dict[str, Any] | None:
    """Remove the staging area a lost worker may have left for this job; the job's result if a lost
    worker's publication finished (see :func:`end_unpublished`)."""
    if ctx.target is None or ctx.job_id is None:
        return None
    return end_unpublished(ctx.target["uri"], ctx.job_id)
