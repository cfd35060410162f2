"""A job kind's handler run in this process: the same ``run(ctx)`` (or ``plan(ctx)``) a worker runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from ckptconv import jobs
from ckptconv.cli.kind_flags import kind_options
from ckptconv.jobs.kinds import get_kind


def job_context(
    kind_name: str,
    options: BaseModel,
    source: str,
    *,
    source_format: str | None = None,
    target: str | None = None,
    target_format: str | None = None,
    local: jobs.LocalSettings | None = None,
    progress: Callable[[Any], None] | None = None,
) -> jobs.JobContext:
    """The context of a job that has no id: nothing is recorded, nothing can cancel it but Ctrl-C."""
    return jobs.JobContext(
        job_id=None,
        kind=get_kind(kind_name),
        source={"uri": source, "format": source_format},
        target=None if target is None else {"uri": target, "format": target_format},
        options=options,
        local=local or jobs.LocalSettings(),
        **({"progress": progress} if progress is not None else {}),
    )


def run_kind(kind_name: str, options: BaseModel, source: str, **context: Any) -> dict[str, Any]:
    """Run a job of ``kind_name`` here and now; its result document, as a worker records it."""
    ctx = job_context(kind_name, options, source, **context)
    return jobs.handler(ctx.kind).run(ctx)


def run_command(args: argparse.Namespace, kind_name: str, source: str, **context: Any) -> dict[str, Any]:
    """Run a job of ``kind_name`` with the options its flags gave (see :mod:`ckptconv.cli.kind_flags`)."""
    return run_kind(kind_name, kind_options(args, kind_name), source, **context)


def plan_kind(kind_name: str, options: BaseModel, source: str, **context: Any) -> dict[str, Any]:
    """The dry run of a job of ``kind_name``, as ``POST /v1/plans`` answers it."""
    return jobs.plan(job_context(kind_name, options, source, **context))
