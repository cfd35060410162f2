"""Container conversions: every entry of a checkpoint, unchanged (or cast), into another format.

``convert`` runs an identity plan through :func:`ckptconv.engine.run.run_plan` (staged, verified,
published with its manifest last); ``plan_conversion`` is its dry run from metadata only;
``inspect`` lists what a checkpoint holds. Between TensorFlow and the Cerebras formats the keys go
through :mod:`ckptconv.formats.tf_names` (TF names a Cerebras checkpoint cannot hold as they are).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptconv.core.errors import CkptconvError, InvalidRequest, KeyCollision, UnsupportedValue
from ckptconv.core.sizes import parse_size
from ckptconv.core.uri import basename
from ckptconv.engine.execute import Progress
from ckptconv.engine.plan import Plan, identity_plan
from ckptconv.engine.run import ConvertResult, fit_memory, jsonable, run_plan, source_facts
from ckptconv.formats import sink_class
from ckptconv.formats.detect import check_format, open_source, target_format_from_name
from ckptconv.formats.sharding import plan_shards
from ckptconv.formats.tf_names import cerebras_keys, tf_name
from ckptconv.formats.tree import DICT, ODICT, TreeSpec

if TYPE_CHECKING:
    from ckptconv.engine.fanout import AutoParallelism, PartRunner

__all__ = ["convert", "convert_part", "h5_compression_options", "inspect", "plan_conversion"]

CEREBRAS_FORMATS = ("cs-h5", "cs-s3")


def _sink_options(
    to: str, shard_size: int | str | None, shard_by: list[str] | None = None, h5_compression: str | None = None
) -> dict[str, Any]:
    options: dict[str, Any] = {"shard_size": shard_size} if shard_size is not None else {}
    if shard_by:
        if to != "tf":
            raise InvalidRequest("shard_by (sharding by weight names) applies to TensorFlow outputs (--to tf)")
        options["shard_by"] = list(shard_by)
    return {**options, **h5_compression_options(to, h5_compression)}


def h5_compression_options(to: str, h5_compression: str | None) -> dict[str, Any]:
    """The cs-h5 sink's options for ``h5_compression`` ("none" or None: the contiguous layout;
    "lz4": the LZ4-chunked one); InvalidRequest for another target format."""
    if h5_compression in (None, "none"):
        return {}
    if to != "cs-h5":
        raise InvalidRequest(f"h5_compression applies to cs-h5 outputs, not {to}")
    return {"compression": h5_compression}


def with_tf_names(plan: Plan, source_format: str, to: str) -> Plan:
    """``plan`` with its output keys renamed between TensorFlow names and Cerebras keys, when
    converting between those formats (see :mod:`ckptconv.formats.tf_names`); else ``plan`` itself."""
    keys = [s.out.key for s in plan.steps]
    if source_format == "tf" and to in CEREBRAS_FORMATS:
        mapping = cerebras_keys(keys)
    elif source_format in CEREBRAS_FORMATS and to == "tf":
        mapping = {k: tf_name(k) for k in keys}
        if len(set(mapping.values())) != len(mapping):
            clash = sorted(k for k in keys if list(mapping.values()).count(mapping[k]) > 1)[:4]
            raise KeyCollision(f"the keys {', '.join(clash)} stand for the same TensorFlow name")
    else:
        return plan
    mapping = {k: v for k, v in mapping.items() if k != v}
    if not mapping:
        return plan
    spec = plan.spec
    if spec is not None:
        flat = spec.type in (DICT, ODICT) and all(c.is_leaf for c in spec.children)
        if not flat or [str(k) for k in spec.context] != keys:
            raise UnsupportedValue(
                f"{next(iter(mapping))!r} must be renamed for {to}, which only a flat checkpoint allows",
                hint="convert through safetensors, whose keys can be any string",
            )
        spec = TreeSpec(spec.type, [mapping.get(k, k) for k in keys], list(spec.children))
    steps = [
        replace(
            s,
            out=replace(
                s.out,
                key=mapping.get(s.out.key, s.out.key),
                target=mapping.get(s.out.target, s.out.target) if s.out.target else s.out.target,
            ),
        )
        for s in plan.steps
    ]
    first = next(iter(mapping))
    note = f"{len(mapping)} TensorFlow names renamed for {to} (e.g. {first!r} -> {mapping[first]!r})"
    return replace(plan, steps=steps, spec=spec, warnings=[*plan.warnings, note])


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
    verify: bool | str = True,
    allow_incomplete: bool | None = None,
    shard_by: list[str] | None = None,
    memory_budget: int | str | None = None,
    parallelism: int | str = 1,
    parts: PartRunner | None = None,
    auto_parallelism: AutoParallelism | None = None,
    h5_compression: str = "none",
) -> ConvertResult:
    """Container conversion: every entry of ``source`` written to ``target`` in format ``to``.

    ``shard_by`` (TensorFlow targets): glob patterns of weight names, one data file per pattern in
    that order (a tensor goes to the first pattern it matches), the rest in a last file.
    ``parallelism`` > 1 cuts the output into that many parts by bytes (every target format that
    lays its files out up front, see :mod:`ckptconv.engine.fanout`), which ``parts`` hands out to workers (default:
    all of them in this process, one after another); ``"auto"`` picks the count from the output's
    size (``auto_parallelism``, see :func:`~ckptconv.engine.fanout.resolve_parallelism`).
    ``h5_compression="lz4"`` (cs-h5 targets): LZ4-chunked datasets instead of contiguous
    uncompressed ones; such an output is written by one process (``"auto"`` picks 1, a count over 1
    is refused).
    """
    to = to or target_format_from_name(target)
    if to is None:
        raise InvalidRequest(f"cannot tell the target format from {target!r}", hint="pass --to FORMAT")
    check_format(to)
    t0 = time.monotonic()
    src = open_source(source, source_format, allow_incomplete=allow_incomplete)
    try:
        plan = with_tf_names(identity_plan(src.entries(), src.spec, dtype=dtype), src.format, to)
        planned = time.monotonic() - t0
        common: dict[str, Any] = {
            "to": to,
            "target": target,
            "sink_options": _sink_options(to, shard_size, shard_by, h5_compression),
            "staging": staging,
            "progress": progress,
            "cancelled": cancelled,
            "job_id": job_id,
            "verify": verify,
        }
        count = 1
        # The fan-out machinery is imported by the runs that may fan out: a run of one part (every
        # command-line conversion) does not pay for loading it.
        if parallelism != 1:
            from ckptconv.engine.fanout import resolve_parallelism

            count = resolve_parallelism(parallelism, plan.bytes_total, to, auto_parallelism, common["sink_options"])
        if count > 1:
            from ckptconv.engine.fanout import run_fanout

            result = run_fanout(plan, src, parallelism=count, runner=parts, memory_budget=memory_budget, **common)
        else:
            result = run_plan(plan, src, memory_budget=memory_budget, **common)
    finally:
        src.close()
    result.timings.setdefault("plan_s", round(planned, 3))
    return result


def convert_part(
    source: str,
    target: str,
    index: int,
    *,
    to: str,
    source_format: str | None = None,
    dtype: str | None = None,
    job_id: str | None = None,
    staging: str | None = None,
    cancelled: Callable[[], bool] | None = None,
    parts: PartRunner | None = None,
) -> bool:
    """Part ``index`` of a fanned-out :func:`convert` (the same plan, rebuilt from the source's
    metadata); False when the part was already recorded."""
    from ckptconv.engine.fanout import run_part

    src = open_source(source, source_format)
    try:
        plan = with_tf_names(identity_plan(src.entries(), src.spec, dtype=dtype), src.format, to)
        return run_part(
            plan, src, target=target, index=index, job_id=job_id, staging=staging, cancelled=cancelled, runner=parts
        )
    finally:
        src.close()


def plan_conversion(
    source: str,
    *,
    to: str,
    source_format: str | None = None,
    shard_size: int | str | None = None,
    dtype: str | None = None,
    limit: int | None = 1000,
    memory_budget: int | str | None = None,
    target: str | None = None,
    h5_compression: str = "none",
) -> dict[str, Any]:
    """Dry run: what a container conversion would write, from the source's metadata only.

    ``target``, when given, is only looked at for where it is: an S3 target's upload buffers
    count in the memory facts."""
    try:
        check_format(to)
        options = h5_compression_options(to, h5_compression)
        src = open_source(source, source_format)
    except CkptconvError as e:
        return {"ok": False, "errors": [e.to_problem()]}
    try:
        entries = src.entries()
        errors = []
        try:
            plan = with_tf_names(identity_plan(entries, src.spec, dtype=dtype), src.format, to)
        except CkptconvError as e:
            return {"ok": False, "errors": [e.to_problem()]}
        try:
            sink_class(to).check(plan.entries())
        except CkptconvError as e:
            errors.append(e.to_problem())
        sizes = {e.key: e.nbytes for e in entries}
        out = plan.to_dict(source_sizes=sizes, limit=limit)
        out["shards"] = _shard_layout(to, plan, shard_size, target)
        try:
            out["memory"] = fit_memory(plan, sizes, memory_budget, target or "", to, options)[0]
        except CkptconvError as e:
            errors.append(e.to_problem())
        out.update({"ok": not errors, "errors": errors, "source": source_facts(src), "target_format": to})
        return out
    finally:
        src.close()


def _shard_layout(to: str, plan: Plan, shard_size: int | str | None, target: str | None) -> list[dict[str, Any]]:
    if to == "tf" and shard_size is not None:
        # The TensorFlow writer is imported by the plans that show its shards, not by every conversion.
        from ckptconv.formats.tf_bundle_codec import data_uri
        from ckptconv.formats.tf_bundle_write import TfSink

        groups = TfSink.planned_shards(plan.entries(), {"shard_size": shard_size})
        prefix = basename(target.rstrip("/")) if target else "<prefix>"
        return [
            {"file": data_uri(prefix, i, len(groups)), "tensors": len(keys), "bytes": size}
            for i, (keys, size) in enumerate(groups)
        ]
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
