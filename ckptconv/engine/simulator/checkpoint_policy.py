"""The Model Zoo trainer's checkpoint policy (2.3+ ``Trainer``, 2.10 behaviour), as data and rules.

- ``Checkpoint``: ``steps`` cadence (saves at ``start + N, start + 2N, ...`` with N capped at the
  run length, and at the final step), ``checkpoint_name`` with exactly one ``{step}`` field, the
  ``{step}_{YYYYmmdd_HHMMSS}`` suffix when the name is taken, ``autoload_last_checkpoint``,
  ``disable_strict_checkpoint_loading``, ``save_initial_checkpoint``, ``checkpoint_root``,
  ``strict_version``.
- ``checkpoints_index.yaml`` in the model directory: a YAML list of checkpoint paths, guarded by
  ``checkpoints_index.yaml.lock``; paths that vanished are pruned when it is opened; a missing index
  is seeded from the model directory's files whose *basename* matches the discovery regex (2.10
  matches the full path, which only works for model_dir ``.``; the basename is what it means).
- "Most recent": the index entries matching the regex, sorted by (step, timestamp; none = oldest).
- ``KeepNCheckpoints(n)``: this run's checkpoints only, oldest deleted first.
- ``SaveCheckpointState(k, checkpoint_states, checkpoint_name)``: every k-th checkpoint (and at the
  last step) a copy holding the chosen top-level states plus every ``__*`` key, named
  ``{checkpoint_states}_{ckpt_name}``, outside the index and the retention policy.
- ``LoadCheckpointStates(load_checkpoint_states)``: which top-level states a load keeps.

Configs in both layouts are read: ``trainer.init.checkpoint`` / ``trainer.init.callbacks`` (2.3+)
and ``runconfig`` (``checkpoint_steps``, ``max_checkpoints``, ``save_initial_checkpoint``,
``autoload_last_checkpoint``, ``disable_strict_checkpoint_loading``, ``load_checkpoint_states``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import yaml

from ckptconv.core.bounded import load_yaml
from ckptconv.core.errors import InvalidRequest, StorageError
from ckptconv.core.uri import as_prefix, basename, is_local, local_path_of
from ckptconv.storage import Storage, open_storage

DEFAULT_CHECKPOINT_NAME = "checkpoint_{step}.mdl"
DEFAULT_STATE_NAME = "{checkpoint_states}_{ckpt_name}"
INDEX_NAME = "checkpoints_index.yaml"
STEP_PATTERN = r"(?P<step>\d+)(?:_(?P<timestamp>\d{8}_\d{6}))?"
TIMESTAMP_FORMAT = "%Y%m%d_%H%M%S"


def _format_fields(text: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(text) if name}


@dataclass
class CheckpointSettings:
    steps: int | None = None
    autoload_last_checkpoint: bool = True
    disable_strict_checkpoint_loading: bool = False
    save_initial_checkpoint: bool = False
    checkpoint_root: str | None = None
    checkpoint_name: str = DEFAULT_CHECKPOINT_NAME
    strict_version: bool = True

    def __post_init__(self) -> None:
        if self.steps is not None and (
            isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0
        ):
            raise InvalidRequest(f"checkpoint steps must be None or a non-negative integer, not {self.steps!r}")
        if _format_fields(self.checkpoint_name) != {"step"}:
            raise InvalidRequest(
                f"checkpoint_name {self.checkpoint_name!r} must contain exactly the field {{step}}",
                hint='e.g. "checkpoint_{step}.mdl"',
            )

    @property
    def regex(self) -> re.Pattern[str]:
        # As the trainer builds it: the name itself is used as a pattern (not escaped).
        return re.compile(self.checkpoint_name.format(step=STEP_PATTERN))

    def file_name(self, step: int | str) -> str:
        return self.checkpoint_name.format(step=step)


@dataclass
class KeepNCheckpoints:
    n: int | None = None

    def __post_init__(self) -> None:
        if self.n is not None and (isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1):
            raise InvalidRequest(f"KeepNCheckpoints n must be a positive integer, not {self.n!r}")


@dataclass
class SaveCheckpointState:
    k: int
    checkpoint_states: list[str] = field(default_factory=lambda: ["model"])
    checkpoint_name: str = DEFAULT_STATE_NAME

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise InvalidRequest(f"SaveCheckpointState k must be a positive integer, not {self.k!r}")
        states = self.checkpoint_states
        if isinstance(states, str):
            states = ["all"] if states.lower() == "all" else states.split(",")
        elif isinstance(states, list | tuple | set):
            states = list(states)
        else:
            raise InvalidRequest(f"checkpoint_states must be a string or a list, not {type(states).__name__}")
        self.checkpoint_states = states
        if _format_fields(self.checkpoint_name) != {"checkpoint_states", "ckpt_name"}:
            raise InvalidRequest(
                f"SaveCheckpointState checkpoint_name {self.checkpoint_name!r} must contain exactly "
                "{checkpoint_states} and {ckpt_name}"
            )

    def file_name(self, ckpt_uri: str) -> str:
        return self.checkpoint_name.format(
            checkpoint_states="_".join(self.checkpoint_states), ckpt_name=basename(ckpt_uri)
        )

    def select(self, keys: list[str]) -> list[str]:
        """The top-level keys to copy; unknown requested states are refused (the trainer's KeyError)."""
        wanted = set(keys) if self.checkpoint_states == ["all"] else set(self.checkpoint_states)
        unknown = wanted - set(keys)
        if unknown:
            raise InvalidRequest(
                f"SaveCheckpointState asks for states the checkpoint does not have: {sorted(unknown)}",
                hint=f"the checkpoint has: {keys}",
            )
        return [k for k in keys if k in wanted or k.startswith("__")]


@dataclass
class LoadCheckpointStates:
    load_checkpoint_states: str | set[str] = "all"

    def __post_init__(self) -> None:
        states = self.load_checkpoint_states
        if isinstance(states, str) and states.lower() == "all":
            self.load_checkpoint_states = "all"
            return
        if isinstance(states, str):
            states = states.split(",")
        if not isinstance(states, list | tuple | set) or not all(isinstance(s, str) for s in states):
            raise InvalidRequest(
                "load_checkpoint_states must be 'all', a comma-separated string or a list of state names"
            )
        self.load_checkpoint_states = set(states)

    def select(self, keys: list[str]) -> list[str]:
        if self.load_checkpoint_states == "all":
            return list(keys)
        unknown = self.load_checkpoint_states - set(keys)
        if unknown:
            raise InvalidRequest(
                f"load_checkpoint_states names states the checkpoint does not have: {sorted(unknown)}",
                hint=f"the checkpoint has: {keys}",
            )
        return [k for k in keys if k in self.load_checkpoint_states]


@dataclass
class Policy:
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    keep: KeepNCheckpoints | None = None
    save_states: list[SaveCheckpointState] = field(default_factory=list)
    load_states: LoadCheckpointStates = field(default_factory=LoadCheckpointStates)


_CALLBACKS = {
    "KeepNCheckpoints": KeepNCheckpoints,
    "SaveCheckpointState": SaveCheckpointState,
    "LoadCheckpointStates": LoadCheckpointStates,
}
_CHECKPOINT_FIELDS = set(CheckpointSettings.__dataclass_fields__)


def parse_policy(config: dict[str, Any], overrides: dict[str, Any] | None = None) -> Policy:
    """The policy a config describes (either layout); ``overrides`` are Checkpoint fields to force."""
    policy = Policy()
    trainer = config.get("trainer")
    init = trainer.get("init", {}) if isinstance(trainer, dict) else None
    ckpt: dict[str, Any] = {}
    if init is not None:
        raw = init.get("checkpoint") or {}
        if not isinstance(raw, dict):
            raise InvalidRequest("trainer.init.checkpoint must be a mapping")
        unknown = set(raw) - _CHECKPOINT_FIELDS
        if unknown:
            raise InvalidRequest(f"unknown trainer.init.checkpoint option(s): {sorted(unknown)}")
        ckpt.update(raw)
        for item in init.get("callbacks") or []:
            if not isinstance(item, dict) or len(item) != 1:
                raise InvalidRequest("each trainer.init.callbacks item must be a one-key mapping {Name: {args}}")
            ((name, args),) = item.items()
            klass = _CALLBACKS.get(name)
            if klass is None:
                continue  # callbacks that do not touch checkpoints
            cb = klass(**(args or {}))
            if isinstance(cb, KeepNCheckpoints):
                policy.keep = cb
            elif isinstance(cb, SaveCheckpointState):
                policy.save_states.append(cb)
            else:
                policy.load_states = cb
    else:
        run = config.get("runconfig") or {}
        mapping = {
            "checkpoint_steps": "steps",
            "save_initial_checkpoint": "save_initial_checkpoint",
            "autoload_last_checkpoint": "autoload_last_checkpoint",
            "disable_strict_checkpoint_loading": "disable_strict_checkpoint_loading",
        }
        for src, dst in mapping.items():
            if src in run:
                ckpt[dst] = run[src]
        if run.get("max_checkpoints") is not None:
            policy.keep = KeepNCheckpoints(run["max_checkpoints"])
        if run.get("load_checkpoint_states") is not None:
            policy.load_states = LoadCheckpointStates(run["load_checkpoint_states"])
        elif run.get("is_pretrained_checkpoint"):
            policy.load_states = LoadCheckpointStates(["model", "dataloader"])
    for k, v in (overrides or {}).items():
        if v is not None:
            ckpt[k] = v
    policy.checkpoint = CheckpointSettings(**ckpt)
    return policy


def should_save(global_step: int, *, start: int, end: int, steps: int | None) -> bool:
    """The trainer's cadence after the optimizer step that made ``global_step``."""
    if not steps:
        return False
    every = min(steps, max(end - start, 1))
    return (global_step - start) % every == 0 or global_step == end


def checkpoint_uri(
    storage: Storage, root: str, settings: CheckpointSettings, step: int, now: datetime | None = None
) -> str:
    """Where the checkpoint of ``step`` goes; a taken name gets the ``_{YYYYmmdd_HHMMSS}`` suffix."""
    uri = storage.join(root, settings.file_name(step))
    if storage.exists(uri):
        stamp = (now or datetime.now()).strftime(TIMESTAMP_FORMAT)
        uri = storage.join(root, settings.file_name(f"{step}_{stamp}"))
    return uri


def parse_checkpoint_name(settings: CheckpointSettings, uri: str) -> tuple[int, datetime] | None:
    m = settings.regex.fullmatch(basename(uri))
    if m is None:
        return None
    stamp = m.group("timestamp")
    if stamp is None:
        return int(m.group("step")), datetime.min
    try:
        return int(m.group("step")), datetime.strptime(stamp, TIMESTAMP_FORMAT)
    except ValueError:
        return None


def sort_checkpoints(settings: CheckpointSettings, uris: list[str]) -> list[str]:
    """Index entries that match the naming convention, oldest first by (step, timestamp)."""
    found = []
    for uri in uris:
        parsed = parse_checkpoint_name(settings, uri)
        if parsed is not None:
            found.append((parsed, uri))
    found.sort(key=lambda item: item[0])
    return [uri for _, uri in found]


class CheckpointIndex:
    """``checkpoints_index.yaml`` in the model directory, read-modify-written under its lock file.

    The lock is an ``flock`` on ``checkpoints_index.yaml.lock`` for a local model directory; an
    object store offers no lock, so an S3 model directory is updated without one.
    """

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.storage = open_storage(model_dir)
        self.uri = self.storage.join(model_dir, INDEX_NAME)
        self.lock_uri = self.uri + ".lock"
        with self.open() as entries:
            # Entries may live on another storage than the index (checkpoint_root on S3).
            entries[:] = [e for e in entries if open_storage(e).exists(e)]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if not is_local(self.lock_uri):
            yield
            return
        path = local_path_of(self.lock_uri)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _read(self) -> list[str]:
        if not self.storage.exists(self.uri):
            return []
        data = load_yaml(self.storage.read_all(self.uri), what=self.uri, error=StorageError)
        if data is None:
            return []
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise StorageError(f"{self.uri} must be a YAML list of checkpoint paths")
        return data

    @contextlib.contextmanager
    def open(self) -> Iterator[list[str]]:
        with self._locked():
            entries = self._read()
            before = list(entries)
            yield entries
            if entries != before:
                self.storage.write_bytes(self.uri, yaml.safe_dump(entries).encode(), overwrite=True)

    def exists(self) -> bool:
        with self._locked():
            return self.storage.exists(self.uri)

    def list(self) -> list[str]:
        with self.open() as entries:
            return list(entries)

    def append(self, uri: str) -> None:
        with self.open() as entries:
            entries.append(str(uri))

    def extend(self, uris: list[str]) -> None:
        with self.open() as entries:
            entries.extend(map(str, uris))

    def remove(self, uri: str) -> None:
        with self.open() as entries:
            if uri in entries:
                entries.remove(uri)

    def seed_from_directory(self, settings: CheckpointSettings) -> None:
        """A missing index starts from the model directory's checkpoints (basename match)."""
        if self.exists():
            return
        prefix = as_prefix(self.model_dir)
        found = []
        for info in self.storage.list(prefix):
            rest = info.uri[len(prefix) :]
            if "/" not in rest and settings.regex.fullmatch(rest):
                found.append(info.uri)
        if found:
            self.extend(sorted(found))

    def release_lock_file(self) -> None:
        """The trainer removes the lock file when it exits."""
        if is_local(self.lock_uri):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(local_path_of(self.lock_uri))


def latest_checkpoint(index: CheckpointIndex, settings: CheckpointSettings) -> str | None:
    ordered = sort_checkpoints(settings, index.list())
    return ordered[-1] if ordered else None
