"""Job-kind handlers: one module per kind of :mod:`ckptconv.jobs.kinds`, run by ``worker.tasks``.

A handler module offers:

- ``run(ctx: JobContext) -> dict``: do the job; return a JSON-able result (``outputs`` as
  ``[{uri, size, role, blake3}]``, ``manifest``, ``warnings``, and ``bytes`` for the metrics, when they
  apply). Call ``ctx.progress`` as work advances and poll ``ctx.cancelled()`` between units of work;
  when it returns True, clean up and raise :class:`~ckptconv.core.errors.Cancelled`. Raise ckptconv
  errors for anything a user caused. ``run`` must be idempotent for a given ``ctx.job_id``: a job is
  run again when its worker was lost.
- optionally ``plan(ctx: JobContext) -> dict``: the dry run behind ``POST /v1/plans``
  (``ctx.progress``/``ctx.cancelled`` are no-ops there);
- optionally ``cleanup(ctx: JobContext) -> dict | None``: remove what a lost worker may have left
  (staging) when its job is then cancelled or failed instead of run again; returns the job's
  result instead when a lost worker's publication had finished (the job then succeeds with it);
- optionally ``run_part(ctx: JobContext, index: int) -> None``: one part of a job that ``run``
  fanned out through ``ctx.parts`` (see ``ckptconv.engine.fanout``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from pydantic import BaseModel

from ckptconv.core.errors import InvalidRequest
from ckptconv.jobs.kinds import JobKind, get_kind


@dataclass(frozen=True)
class LocalSettings:
    """What a run on the caller's own machine (the command line) may add to a kind's options.

    The service offers none of these: its jobs read only complete checkpoints, always verify, never
    rewrite a source in place and always run to the end. A handler reads the ones that apply to it.
    """

    allow_incomplete: bool | None = None  # read a Cerebras H5 without __SUCCESS__
    shard_by: list[str] | None = None  # TensorFlow outputs: one data file per glob of weight names
    skip_verify: bool = False  # publish without comparing the output with the source
    inplace: bool = False  # fix-spec: replace the source itself
    stop_after: int | None = None  # simulate: stop after this many steps without the final save


@dataclass
class JobContext:
    job_id: str | None  # None for dry runs
    kind: JobKind
    source: dict[str, Any]  # {"uri", "format" (or None)}
    target: dict[str, Any] | None  # {"uri", "format"}
    options: BaseModel  # the kind's options model, validated
    labels: dict[str, str] = field(default_factory=dict)
    progress: Callable[[Any], None] = lambda _p: None  # takes ckptconv.engine.execute.Progress (or a dict)
    cancelled: Callable[[], bool] = lambda: False
    local: LocalSettings = field(default_factory=LocalSettings)
    # Hands the parts of a fanned-out job to workers (ckptconv.engine.fanout.PartRunner); None runs
    # every part in this process.
    parts: Any = None


def context_from_request(doc: dict[str, Any], job_id: str | None = None, **callbacks: Any) -> JobContext:
    """A context from a stored job request (or a plan request): the options are validated again."""
    kind = get_kind(doc["kind"])
    return JobContext(
        job_id=job_id,
        kind=kind,
        source=doc["source"],
        target=doc.get("target"),
        options=kind.options.model_validate(doc.get("options") or {}, strict=False),
        labels=doc.get("labels") or {},
        **callbacks,
    )


def handler(kind: JobKind) -> ModuleType:
    return importlib.import_module(kind.handler_module)


def plan(ctx: JobContext) -> dict[str, Any]:
    module = handler(ctx.kind)
    if not hasattr(module, "plan"):
        raise InvalidRequest(f"job kind {ctx.kind.name!r} has no dry run")
    return module.plan(ctx)


def describe_outputs(uris: list[str], role: str = "data") -> list[dict[str, Any]]:
    """``[{uri, size, role, blake3}]`` of files a handler wrote without the engine (which checksums its own)."""
    # Here, not at the top: every command imports this package for its contexts, few describe files.
    from ckptconv.storage import open_storage
    from ckptconv.storage.digests import digest_facts

    out = []
    for uri in uris:
        storage = open_storage(uri)
        out.append(
            {"uri": uri, "size": storage.stat(uri).size, "role": role, **digest_facts(storage.digest(uri), None)}
        )
    return out


def report_stage(ctx: JobContext, stage: str) -> None:
    """Progress of a handler whose work is not counted in tensors and bytes (a training run, a forward pass)."""
    ctx.progress({"stage": stage, "tensors_done": 0, "tensors_total": 0, "bytes_done": 0, "bytes_total": 0})
