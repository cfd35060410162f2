"""The release graph: Cerebras Model Zoo releases as nodes, conversions as edges.

Nodes are ``hf`` and ``cs-X.Y``; a family connects ``hf`` directly to the releases its table lists
under ``releases.hf`` and chains its ``releases.cs`` one release to the next. A conversion is the
shortest path; it runs in ONE pass: key renames of every edge compose into one function from
source keys to target keys, and config steps apply in sequence to the config document.

Checkpoint key vocabularies (reference §3.0, §5):

- ``>= 2.1``: the canonical vocabulary the family tables use;
- ``<= 2.0``: position embeddings and ALiBi / relative-bias helpers under their old names
  (``embedding_layer.position_embeddings.weight``, ``relative_pe_helper.slopes``, T5
  ``relative_position_encoder``);
- ``1.8/1.9 -> 2.0``: same names; going up repairs tied pairs (a missing or None member is filled
  from its partner);
- ``1.7/1.8``: keys may carry a ``model.`` prefix (accepted when reading, never written).

Config edges (reference §5) rewrite the whole run YAML: model flags renamed in 2.0, optimizer and
scheduler aliases and runconfig clean-ups in 2.1/2.2, the ``trainer:`` layout and the muP rework
in 2.3, ``name`` in 2.4. Edges from 2.4 on change nothing.

The format names are parsed in :mod:`~ckptconv.engine.layouts.model_formats`, the edges (renames
and config steps) are :mod:`~ckptconv.engine.layouts.release_edges`; this module is the graph.
"""

from __future__ import annotations

import copy
import itertools
from collections import deque
from typing import Any

from ckptconv.core.errors import NoConversionPath
from ckptconv.core.releases import release_key
from ckptconv.engine.layouts.family import Family
from ckptconv.engine.layouts.model_formats import (
    CANONICAL_RELEASE,
    parse_format,
    parse_model_format,
    release_of,
    split_format,
)
from ckptconv.engine.layouts.release_edges import EDGES, TIED_PAIRS, Edge, EdgeCtx

# The format names and the edges are used through this module by most callers.
__all__ = [
    "CANONICAL_RELEASE",
    "EDGES",
    "TIED_PAIRS",
    "Edge",
    "config_along",
    "cs_segments",
    "edge",
    "find_path",
    "parse_format",
    "parse_model_format",
    "release_of",
    "rename_key",
    "repairs_ties",
    "split_format",
]


def find_path(family: Family, src: str, tgt: str) -> list[str]:
    """Shortest path of nodes from ``src`` to ``tgt`` (both ``hf`` or ``cs-X.Y``) for this family."""
    nodes = {"hf"} if family.hf_releases else set()
    nodes |= {f"cs-{r}" for r in family.cs_releases}
    for n in (src, tgt):
        if n not in nodes:
            supported = (["hf"] if family.hf_releases else []) + [f"cs-{r}" for r in family.cs_releases]
            raise NoConversionPath(
                f"{family.name} has no {n} layout; it supports {', '.join(supported)}",
                hint="run `ckptconv models` for the formats each model supports",
            )
    adj: dict[str, list[str]] = {n: [] for n in nodes}
    for r in family.hf_releases:
        adj["hf"].append(f"cs-{r}")
        adj[f"cs-{r}"].append("hf")
    rels = family.cs_releases
    for a, b in itertools.pairwise(rels):
        adj[f"cs-{a}"].append(f"cs-{b}")
        adj[f"cs-{b}"].append(f"cs-{a}")
    prev: dict[str, str | None] = {src: None}
    todo = deque([src])
    while todo:
        n = todo.popleft()
        if n == tgt:
            break
        if n == "hf" and n != src:
            continue  # hf is an end of a path, never a way through (it would lose CS-only state)
        for m in adj[n]:
            if m not in prev:
                prev[m] = n
                todo.append(m)
    if tgt not in prev:
        raise NoConversionPath(f"no conversion from {src} to {tgt} for {family.name}")
    path = [tgt]
    while prev[path[-1]] is not None:
        path.append(prev[path[-1]])  # type: ignore[arg-type]
    return path[::-1]


def edge(a: str, b: str) -> tuple[Edge, bool]:
    """The edge between two adjacent CS nodes and whether it is walked upwards."""
    ra, rb = release_of(a), release_of(b)
    if (ra, rb) in EDGES:
        return EDGES[(ra, rb)], True
    return EDGES[(rb, ra)], False


def cs_segments(path: list[str]) -> tuple[list[str], list[str]]:
    """Split a path at its ``hf`` node: (CS nodes before it, CS nodes after it)."""
    if "hf" not in path:
        return path, []
    i = path.index("hf")
    return path[:i], path[i + 1 :]


def rename_key(key: str, a: str, b: str) -> str:
    """Rename one canonical-or-old key across the CS path a -> b (adjacent or not)."""
    ra, rb = release_key(release_of(a)), release_key(release_of(b))
    lo, hi = min(ra, rb), max(ra, rb)
    steps = [e for (x, y), e in EDGES.items() if lo <= release_key(x) and release_key(y) <= hi]
    steps.sort(key=lambda e: release_key(e.lo), reverse=ra > rb)
    for e in steps:
        for r in e.renames:
            new = r.up(key) if ra < rb else r.down(key)
            if new is not None:
                key = new
                break
    return key


def config_along(doc: dict[str, Any], nodes: list[str], family: Family, warnings: list[str]) -> dict[str, Any]:
    """Apply the config steps of consecutive CS nodes to a run YAML document."""
    doc = copy.deepcopy(doc)
    ctx = EdgeCtx(family, warnings)
    for a, b in itertools.pairwise(nodes):
        e, up = edge(a, b)
        doc = e.config_up(doc, ctx) if up else e.config_down(doc, ctx)
    return doc


def repairs_ties(nodes: list[str]) -> bool:
    return any(edge(a, b)[0].repair_ties and edge(a, b)[1] for a, b in itertools.pairwise(nodes))
