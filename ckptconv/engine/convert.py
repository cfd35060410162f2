"""Container conversions: every entry of a checkpoint, unchanged (or cast), into another format.

``convert`` runs an identity plan through :func:`ckptconv.engine.run.run_plan` (staged, verified,
published with its manifest last); ``plan_conversion`` is its dry run from metadata only;
``inspect`` lists what a checkpoint holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ckptconv.core.errors import CkptconvError, InvalidRequest
from ckptconv.core.sizes import parse_size
from ckptconv.engine.execute import Progress
from ckptconv.engine.plan import Plan, identity_plan
from ckptconv.engine.run import ConvertResult, jsonable, run_plan, source_facts
from ckptconv.formats import sink_class
from ckptconv.formats.detect import check_format, open_source, target_format_from_name
from ckptconv.formats.sharding import plan_shards

__all__ = ["convert", "inspect", "plan_conversion"]


def _sink_options(to: str, shard_size: int | str | None) -> dict[str, Any]:
    return {"shard_size": shard_size} if shard_size is not None else {}


def convert(
    source: str,
    target: str,
    *,
    to: str | None = None,
    source_format: str | None = None,
    shard_size: int | str | None = None,
    dtype: str | None = None,
    staging: str | None = None,
    progress: Callable[[Progress], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    job_id: str | None = None,
    verify: bool = True,
    allow_incomplete: bool | None = None,
) -> ConvertResult:
    """Container conversion: every entry of ``source`` written to ``target`` in format ``to``."""
    to = to or target_format_from_name(target)
    if to is None:
        raise InvalidRequest(f"cannot tell the target format from {target!r}", hint="pass --to FORMAT")
    check_format(to)
    t0 = time.monotonic()
    src = open_source(source, source_format, allow_incomplete=allow_incomplete)
    try:
        plan = identity_plan(src.entries(), src.spec, dtype=dtype)
        planned = time.monotonic() - t0
        result = run_plan(
            plan,
            src,
            to=to,
            target=target,
            sink_options=_sink_options(to, shard_size),
            staging=staging,
            progress=progress,
            cancelled=cancelled,
            job_id=job_id,
            verify=verify,
        )
    finally:
        src.close()
    result.timings.setdefault("plan_s", round(planned, 3))
    return result


def plan_conversion(
    source: str,
    *,
    to: str,
    source_format: str | None = None,
    shard_size: int | str | None = None,
    dtype: str | None = None,
    limit: int | None = 1000,
) -> dict[str, Any]:
    """Dry run: what a container conversion would write, from the source's metadata only."""
    try:
        check_format(to)
        src = open_source(source, source_format)
    except CkptconvError as e:
        return {"ok": False, "errors": [e.to_problem()]}
    try:
        entries = src.entries()
        plan = identity_plan(entries, src.spec, dtype=dtype)
        errors = []
        try:
            sink_class(to).check(plan.entries())
        except CkptconvError as e:
            errors.append(e.to_problem())
        sizes = {e.key: e.nbytes for e in entries}
        out = plan.to_dict(source_sizes=sizes, limit=limit)
        out["shards"] = _shard_layout(to, plan, shard_size)
        out.update({"ok": not errors, "errors": errors, "source": source_facts(src), "target_format": to})
        return out
    finally:
        src.close()


def _shard_layout(to: str, plan: Plan, shard_size: int | str | None) -> list[dict[str, Any]]:
    if to not in ("safetensors", "torch") or shard_size is None:
        return [{"file": "(single file)", "tensors": plan.tensors_total, "bytes": plan.bytes_total}]
    shards = plan_shards([e for e in plan.entries() if e.is_data], parse_size(shard_size), to)
    return [{"file": name, "tensors": len(keys), "bytes": size} for name, keys, size in shards]


def inspect(uri: str, *, source_format: str | None = None, allow_incomplete: bool | None = None) -> dict[str, Any]:
    """The `ckptconv inspect` view: format, release, key count, bytes, and every entry."""
    src = open_source(uri, source_format, allow_incomplete=allow_incomplete)
    try:
        entries = src.entries()
        dtypes: dict[str, int] = {}
        for e in entries:
            if e.kind in ("tensor", "array"):
                dtypes[str(e.dtype)] = dtypes.get(str(e.dtype), 0) + 1
        return {
            "uri": src.uri,
            "format": src.format,
            "info": jsonable(src.info),
            "keys": len(entries),
            "tensors": sum(1 for e in entries if e.kind in ("tensor", "array")),
            "total_bytes": sum(e.nbytes for e in entries),
            "dtypes": dtypes,
            "entries": [
                {
                    "key": e.key,
                    "kind": e.kind,
                    "dtype": e.dtype,
                    "shape": list(e.shape) if e.shape is not None else None,
                    "bytes": e.nbytes,
                    **({"value": jsonable(e.value)} if e.kind == "value" else {}),
                    **({"target": e.target} if e.kind == "link" else {}),
                }
                for e in entries
            ],
        }
    finally:
        src.close()
