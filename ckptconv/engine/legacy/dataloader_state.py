"""Dataloader state of release 1.9 to the ``dataloader`` entry of release 2.0+ (cs-checkpoint-format §5).

Release 1.9 kept the position of the input pipeline beside the checkpoint, in the directory named
by ``cerebras.save_iter_state_path``:

- ``data_iter_checkpoint_state_file_global``: first line = the global step of the last data
  checkpoint;
- ``data_iter_state_file_worker_<id>_step_<step>.txt``: first line = samples that worker streamed.

From 2.0 on the checkpoint itself holds the state under the top-level key ``dataloader``:

- map-style loaders: ``{"samples_streamed": <sum over workers>, "seed": <shuffle seed>}``;
- iterable loaders: ``{"all_worker_states": [{"samples_streamed": n, "shard_index": id}, ...]}``
  sorted by worker id.

:func:`read_dataloader_state` builds that state from the files; :func:`add_dataloader_state` adds
it to a plan, which is how both the ``convert-dataloader-state`` command and model conversions
(when the old config sets ``cerebras.save_iter_state_path``, see :func:`state_from_config`) apply
it; :func:`convert_dataloader_state` writes an old checkpoint plus the state as a Cerebras H5
checkpoint (format 0.5, also when the old one is a legacy file).

The model in that output keeps the old release's key layout: the release upgrade is the next step
(``convert-model --src-fmt cs-auto``). So the output records the old release as its
``__cstorch_version__`` (``1.9.0`` for a 1.9 checkpoint), which is what ``cs-auto`` reads when the
checkpoint has no ``__metadata__`` record; stamped with the writer's release, a 1.9 layout would be
read as 2.x. A release 1.7 checkpoint that was never repaired (tied weights listed in its tree spec
but absent from the file, which read as None) is refused: ``fix-spec`` links them first.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptconv.core.errors import DataloaderStateError, ObjectNotFound
from ckptconv.engine.legacy.fix_spec import tied_partner
from ckptconv.engine.plan import Plan, Step, identity_plan
from ckptconv.engine.run import run_plan
from ckptconv.formats.base import Entry
from ckptconv.formats.detect import open_source
from ckptconv.formats.tree import DICT, ODICT, TreeSpec, flat_dict_spec, flatten
from ckptconv.storage import open_storage

if TYPE_CHECKING:
    from ckptconv.engine.run import ConvertResult
    from ckptconv.storage.base import Storage

GLOBAL_FILE = "data_iter_checkpoint_state_file_global"
WORKER_PREFIX = "data_iter_state_file_worker_"
DATALOADER_KEY = "dataloader"
METADATA_KEY = "__metadata__"
MAP, ITERABLE = "map", "iterable"
# Data processors of 1.9 configs and the loader style their 2.0 successors restore.
PROCESSOR_TYPES = {"GptHDF5MapDataProcessor": MAP, "GptHDF5DataProcessor": ITERABLE}
MAX_STATE_FILE_BYTES = 1 << 20


def _first_int(storage: Storage, uri: str, what: str) -> int:
    size = storage.stat(uri).size
    if size > MAX_STATE_FILE_BYTES:
        raise DataloaderStateError(f"{uri} is {size} bytes; a {what} file holds one number")
    text = storage.read_range(uri, 0, size).decode("utf-8", "replace")
    first = text.splitlines()[0].strip() if text.strip() else ""
    try:
        value = int(first)
    except ValueError:
        raise DataloaderStateError(
            f"the first line of {uri} is {first[:60]!r}, not an integer ({what})",
            hint="the file is damaged or is not a 1.9 data-iterator state file",
        ) from None
    if value < 0:
        raise DataloaderStateError(f"the first line of {uri} is negative ({value}); expected {what}")
    return value


def _parse_worker_name(name: str) -> tuple[int, int] | None:
    """(worker id, step) of ``data_iter_state_file_worker_<id>_step_<step>.txt``; None for other names."""
    if not name.startswith(WORKER_PREFIX) or not name.endswith(".txt"):
        return None
    parts = name[: -len(".txt")].split("_")
    try:
        return int(parts[-3]), int(parts[-1])
    except (IndexError, ValueError):
        raise DataloaderStateError(
            f"{name} looks like a worker state file but does not end in _<worker id>_step_<step>.txt"
        ) from None


def read_worker_samples(storage: Storage, iter_dir: str) -> tuple[int, dict[int, int]]:
    """``(data step, {worker id: samples streamed})`` from a 1.9 state directory."""
    base = iter_dir.rstrip("/")
    global_uri = storage.join(base, GLOBAL_FILE)
    try:
        step = _first_int(storage, global_uri, "the global step of the last data checkpoint")
    except ObjectNotFound:
        raise DataloaderStateError(
            f"{global_uri} does not exist",
            hint="pass the directory that cerebras.save_iter_state_path named in the 1.9 run",
        ) from None
    samples: dict[int, int] = {}
    steps_seen: set[int] = set()
    prefix = base + "/"
    for info in storage.list(prefix):
        name = info.uri[len(prefix) :]
        if "/" in name:
            continue
        parsed = _parse_worker_name(name)
        if parsed is None:
            continue
        worker, file_step = parsed
        steps_seen.add(file_step)
        if file_step == step:
            samples[worker] = _first_int(storage, info.uri, f"samples streamed by worker {worker}")
    if not samples:
        seen = ", ".join(str(s) for s in sorted(steps_seen)[-5:]) or "none"
        raise DataloaderStateError(
            f"no worker state files for data step {step} in {base} (steps found: {seen})",
            hint=f"the directory needs {WORKER_PREFIX}<id>_step_{step}.txt for every worker",
        )
    return step, samples


def dataloader_state(samples: dict[int, int], dataloader_type: str, shuffle_seed: int = 0) -> dict[str, Any]:
    """The 2.0 ``dataloader`` state of a map or iterable loader from per-worker sample counts."""
    if dataloader_type == MAP:
        return {"samples_streamed": sum(samples.values()), "seed": int(shuffle_seed)}
    if dataloader_type == ITERABLE:
        return {
            "all_worker_states": [{"samples_streamed": samples[w], "shard_index": w} for w in sorted(samples)],
        }
    raise DataloaderStateError(
        f"unknown dataloader type {dataloader_type!r}",
        hint=f"use {MAP!r} (map-style, e.g. GptHDF5MapDataProcessor) or {ITERABLE!r} (e.g. GptHDF5DataProcessor)",
    )


def read_dataloader_state(
    iter_dir: str, dataloader_type: str = MAP, shuffle_seed: int = 0, *, storage: Storage | None = None
) -> dict[str, Any]:
    """The 2.0 ``dataloader`` state from the 1.9 files in ``iter_dir`` (local path or s3:// prefix)."""
    if dataloader_type not in (MAP, ITERABLE):
        dataloader_state({}, dataloader_type)  # raises the typed error
    if storage is None:
        storage = open_storage(iter_dir)
    _, samples = read_worker_samples(storage, iter_dir)
    return dataloader_state(samples, dataloader_type, shuffle_seed)


def state_from_config(config: dict[str, Any], *, storage: Storage | None = None) -> dict[str, Any] | None:
    """The dataloader state a model conversion adds, or None when the old config asks for none.

    Applies when ``cerebras.save_iter_state_path`` is set; the loader style comes from
    ``train_input.data_processor`` and the seed is 0, as Model Zoo's converter does.
    """
    path = (config.get("cerebras") or {}).get("save_iter_state_path") if isinstance(config, dict) else None
    if not path:
        return None
    processor = ((config.get("train_input") or {}) if isinstance(config.get("train_input"), dict) else {}).get(
        "data_processor"
    )
    kind = PROCESSOR_TYPES.get(str(processor))
    if kind is None:
        raise DataloaderStateError(
            f"cerebras.save_iter_state_path is set but the data processor {processor!r} has no known 2.0 loader state",
            hint="convert the dataloader state with `ckptconv convert-dataloader-state --dataloader_type map|iterable`",
        )
    return read_dataloader_state(str(path), kind, 0, storage=storage)


def has_dataloader_state(plan: Plan) -> bool:
    """Whether the checkpoint of ``plan`` has a top-level ``dataloader`` key already."""
    if plan.spec is not None and plan.spec.type in (DICT, ODICT):
        return DATALOADER_KEY in [str(k) for k in plan.spec.context]
    return any(s.out.key == DATALOADER_KEY or s.out.key.startswith(DATALOADER_KEY + ".") for s in plan.steps)


def add_dataloader_state(plan: Plan, state: dict[str, Any]) -> Plan:
    """``plan`` plus value steps writing ``state`` under the top-level key ``dataloader``.

    A plan whose checkpoint already has a ``dataloader`` key is returned unchanged with a warning
    (the state it has is newer than the 1.9 files).
    """
    keys = [s.out.key for s in plan.steps]
    spec = plan.spec if plan.spec is not None else flat_dict_spec(keys)
    if spec.type not in (DICT, ODICT):
        raise DataloaderStateError("the checkpoint is not a dict at its top level; a dataloader key cannot be added")
    if has_dataloader_state(plan):
        return replace(plan, warnings=[*plan.warnings, "the checkpoint already has a dataloader state; kept as is"])
    leaves, tree_spec = flatten({DATALOADER_KEY: state})
    existing = set(keys)
    added = []
    for key, value in leaves:
        if key in existing:
            raise DataloaderStateError(f"the checkpoint already has a key {key!r}")
        added.append(Step(Entry(key, "value", value=value)))
    # Sinks take entries in the spec's order, where the release record comes last.
    pos = next((i for i, k in enumerate(keys) if k == METADATA_KEY or k.startswith(METADATA_KEY + ".")), len(keys))
    steps = [*plan.steps[:pos], *added, *plan.steps[pos:]]
    # Before the release record when there is one: it is appended last, after the whole state.
    context, children = list(spec.context), list(spec.children)
    at = context.index(METADATA_KEY) if METADATA_KEY in context else len(context)
    context.insert(at, DATALOADER_KEY)
    children.insert(at, tree_spec.children[0])
    new_spec = TreeSpec(spec.type, context, children)
    return replace(plan, steps=steps, spec=new_spec)


def convert_dataloader_state(
    old_checkpoint: str,
    iter_dir: str,
    output: str,
    *,
    dataloader_type: str = MAP,
    shuffle_seed: int = 0,
    verify: bool = True,
    **run_options: Any,
) -> ConvertResult:
    """Write ``old_checkpoint`` plus the 2.0 dataloader state as a Cerebras H5 checkpoint at ``output``.

    The state is read and checked before the checkpoint is opened; an old checkpoint that already
    has a ``dataloader`` key is refused. ``run_options`` (``progress``, ``cancelled``, ``job_id``) go to
    :func:`ckptconv.engine.run.run_plan`.
    """
    state = read_dataloader_state(iter_dir, dataloader_type, shuffle_seed)
    src = open_source(old_checkpoint)
    try:
        entries = src.entries()
        _refuse_unfixed(old_checkpoint, entries)
        base = identity_plan(entries, src.spec)
        if has_dataloader_state(base):
            raise DataloaderStateError(
                f"{old_checkpoint} already has a dataloader state",
                hint="it was saved by release 2.0 or later; there is nothing to convert",
            )
        plan = add_dataloader_state(base, state)
        release = (src.info or {}).get("release")
        if release is None:
            plan = replace(
                plan,
                warnings=[
                    *plan.warnings,
                    f"the release of {old_checkpoint} is unknown, so the output is stamped with the current one; "
                    "name the old release (--src-fmt cs-X.Y) when upgrading it",
                ],
            )
        result = run_plan(
            plan,
            src,
            to="cs-h5",
            target=output,
            verify=verify,
            sink_options={"cstorch_version": f"{release}.0" if release else None},
            extras={"dataloader": state, "release": release},
            **run_options,
        )
    finally:
        src.close()
    return result


def _refuse_unfixed(old_checkpoint: str, entries: list[Entry]) -> None:
    """Refuse a legacy checkpoint whose tree spec lists keys the file lacks (they would be written as None)."""
    missing = [e.key for e in entries if e.meta.get("missing")]
    if not missing:
        return
    present = {e.key for e in entries if not e.meta.get("missing")}
    tied = [k for k in missing if tied_partner(k, present)]
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    if len(tied) == len(missing):
        hint = (
            f"run `ckptconv fix-spec {old_checkpoint}` first (it links them to their tied partners), "
            "then convert the fixed copy"
        )
    else:
        lone = ", ".join(k for k in missing if k not in tied)[:200]
        hint = f"`ckptconv fix-spec` links tied weights to their partners, but {lone} have none: use a complete copy"
    raise DataloaderStateError(
        f"{old_checkpoint} lists {len(missing)} keys in its tree spec that are not in the file ({shown}); "
        "they would be written as None (an unrepaired release 1.7 checkpoint)",
        hint=hint,
    )
