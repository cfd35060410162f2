"""Job kind ``convert``: container conversion through ``ckptconv.engine.convert.convert``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptconv.core.errors import CkptconvError
from ckptconv.engine.convert import convert, convert_part, plan_conversion
from ckptconv.engine.run import end_unpublished
from ckptconv.jobs import JobContext

if TYPE_CHECKING:
    from ckptconv.engine.fanout import AutoParallelism


def run(ctx: JobContext) -> dict[str, Any]:
    assert ctx.target is not None  # the kind requires a target; the API validated it
    result = convert(
        ctx.source["uri"],
        ctx.target["uri"],
        to=ctx.target["format"],
        source_format=ctx.source.get("format"),
        shard_size=ctx.options.shard_size,
        dtype=ctx.options.dtype,
        memory_budget=ctx.options.memory_budget,
        verify=False if ctx.local.skip_verify else ctx.options.verify,
        allow_incomplete=ctx.local.allow_incomplete,
        shard_by=ctx.local.shard_by,
        progress=ctx.progress,
        cancelled=ctx.cancelled,
        job_id=ctx.job_id,
        parallelism=ctx.options.parallelism,
        parts=ctx.parts,
        auto_parallelism=auto_parallelism(ctx.options.parallelism),
        h5_compression=ctx.options.h5_compression,
    )
    return result.to_dict()


def auto_parallelism(parallelism: int | str) -> AutoParallelism | None:
    """The deployment's limits for ``parallelism: "auto"`` (settings are read only then)."""
    if parallelism != "auto":
        return None
    # Imported only then too: the settings (pydantic-settings) and the fan-out machinery are no
    # part of a run of one part, which every command-line conversion is.
    from ckptconv.core.settings import get_settings
    from ckptconv.engine.fanout import AutoParallelism

    s = get_settings()
    return AutoParallelism(s.auto_parallelism_part_bytes, s.auto_parallelism_max)


def run_part(ctx: JobContext, index: int) -> None:
    """One part of a conversion ``run`` fanned out (``parallelism`` > 1)."""
    assert ctx.target is not None
    convert_part(
        ctx.source["uri"],
        ctx.target["uri"],
        index,
        to=ctx.target["format"],
        source_format=ctx.source.get("format"),
        dtype=ctx.options.dtype,
        job_id=ctx.job_id,
        cancelled=ctx.cancelled,
        parts=ctx.parts,
    )


def plan(ctx: JobContext) -> dict[str, Any]:
    assert ctx.target is not None
    doc = plan_conversion(
        ctx.source["uri"],
        to=ctx.target["format"],
        source_format=ctx.source.get("format"),
        shard_size=ctx.options.shard_size,
        dtype=ctx.options.dtype,
        memory_budget=ctx.options.memory_budget,
        target=ctx.target.get("uri"),
        h5_compression=ctx.options.h5_compression,
    )
    if not doc.get("ok") and set(doc) <= {"ok", "errors"} and doc.get("errors"):
        # The source could not even be opened: that is an error of the request, not a plan.
        raise CkptconvError.from_problem(doc["errors"][0])
    return doc


def cleanup(ctx: JobContext) -> dict[str, Any] | None:
    """Remove the staging area a lost worker may have left for this job; the job's result if a lost
    worker's publication finished (see :func:`end_unpublished`)."""
    if ctx.target is None or ctx.job_id is None:
        return None
    return end_unpublished(ctx.target["uri"], ctx.job_id)
