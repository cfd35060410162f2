"""Job kind ``fix-spec``: repair a release <= 1.7 checkpoint into a copy release 2.0+ loads."""

from __future__ import annotations

from typing import Any

from ckptconv.core.errors import InvalidRequest
from ckptconv.engine.legacy.fix_spec import fix_checkpoint_spec
from ckptconv.jobs import JobContext, describe_outputs, report_stage


def _output(ctx: JobContext) -> str | None:
    if ctx.target is None:
        return None
    if ctx.target.get("format") not in (None, "cs-h5"):
        raise InvalidRequest(f"fix-spec writes a cs-h5 checkpoint, not {ctx.target['format']}")
    return ctx.target["uri"]


def run(ctx: JobContext) -> dict[str, Any]:
    report_stage(ctx, "repairing")
    report = fix_checkpoint_spec(ctx.source["uri"], _output(ctx), inplace=ctx.local.inplace)
    return {
        **report.to_dict(),
        "outputs": describe_outputs([report.output], role="data"),
        "warnings": list(report.notes),
    }
