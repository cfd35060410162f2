"""What a checkpoint says about itself, from metadata only: the release that wrote it and the run
parameters a Cerebras checkpoint records."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptconv.core.errors import (
    NoConversionPath,
)
from ckptconv.core.releases import CURRENT_RELEASE, known_release, newer_than_known
from ckptconv.formats.base import Entry, TensorSource
from ckptconv.formats.tree import TreeSpec, unflatten


def subtree(source: TensorSource, entries: list[Entry], prefix: str) -> Any:
    """The nested Python value stored under flat key ``prefix`` (e.g. ``__metadata__``), or None."""
    spec = source.spec
    if spec is None:
        return None
    node: TreeSpec | None = spec
    for part in prefix.split("."):
        if node is None or node.is_leaf:
            return None
        labels = [str(x) for x in node.child_labels()]
        if part not in labels:
            return None
        node = node.children[labels.index(part)]
    by_key = {e.key: e for e in entries}
    values = []
    for k in node.keys():  # noqa: SIM118 - TreeSpec.keys() lists flat leaf keys; it is not a dict
        full = f"{prefix}.{k}" if k else prefix
        e = by_key.get(full)
        if e is None:
            values.append(None)
        elif e.kind == "value":
            values.append(e.value)
        else:
            v = source.read(full)
            values.append(getattr(v, "value", v))
    return unflatten(values, node)


def detect_release(source: TensorSource, entries: list[Entry]) -> tuple[str, str | None]:
    """``cs-auto``: ``__metadata__[-1].version``, else the H5 writer's version attributes.

    Returns (node, warning). A release newer than the newest this build knows is read as that
    newest one (the key layout has not changed since), with a warning.
    """
    candidates: list[str] = []
    meta = subtree(source, entries, "__metadata__")
    if isinstance(meta, list) and meta and isinstance(meta[-1], Mapping):
        candidates.append(str(meta[-1].get("version", "")))
    info = source.info or {}
    candidates += [str(info[k]) for k in ("cstorch_version", "__cstorch_version__", "release") if info.get(k)]
    for version in candidates:
        rel = known_release(version)
        if rel:
            return f"cs-{rel}", None
        newer = newer_than_known(version)
        if newer:
            return (
                f"cs-{CURRENT_RELEASE}",
                f"the checkpoint was written by release {newer}, newer than the newest layout known here "
                f"(cs-{CURRENT_RELEASE}); it is read as cs-{CURRENT_RELEASE}",
            )
    fmt = info.get("format_version", info.get("__version__"))
    legacy = {0.1: "1.7", 0.2: "1.8", 0.3: "1.9", 0.4: "2.0"}
    if fmt is not None:
        try:
            f = round(float(fmt), 1)
        except (TypeError, ValueError):
            f = None
        if f in legacy:
            return f"cs-{legacy[f]}", None
    raise NoConversionPath(
        "cannot detect the Cerebras release of this checkpoint (no __metadata__ and no version attributes)",
        hint="name the release with --src-fmt cs-X.Y",
    )


def metadata_params(source: TensorSource, entries: list[Entry]) -> dict[str, Any] | None:
    meta = subtree(source, entries, "__metadata__")
    if isinstance(meta, list) and meta and isinstance(meta[-1], Mapping):
        params = meta[-1].get("params")
        if isinstance(params, Mapping) and params:
            return dict(params)
    return None


# --- steps ---------------------------------------------------------------------------------
