"""Nested state dicts <-> flat keys plus a tree spec (torch pytree, serialization protocol 1).

Cerebras checkpoints store the nesting of a state dict as the JSON text of torch's
``treespec_dumps``; ckptconv uses the same representation everywhere a structure travels with the
tensors (H5 root spec, safetensors ``__metadata__``, trainer checkpoints of the simulator), so a
tree read from one format is written to another unchanged.

Rules (as ``cstorch.save`` applies them):

- nodes: dict, OrderedDict, list, tuple, set, deque, namedtuple (by class name); everything else is
  a leaf (tensors, numbers, str, None, bytes, arrays, arbitrary objects);
- a leaf's key joins the path with ``.``: dict keys by ``str(key)``, sequences by index;
- containers without leaves produce no key but keep their exact type in the spec;
- two paths that join to the same flat key are refused (KeyCollision).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.bounded import load_json
from ckptconv.core.errors import CorruptCheckpoint, KeyCollision, UnsupportedValue

DICT = "builtins.dict"
ODICT = "collections.OrderedDict"
LIST = "builtins.list"
TUPLE = "builtins.tuple"
SET = "builtins.set"
DEQUE = "collections.deque"
NAMEDTUPLE = "collections.namedtuple"
_KNOWN = {DICT, ODICT, LIST, TUPLE, SET, DEQUE, NAMEDTUPLE}


@dataclass
class TreeSpec:
    """One node: ``type`` None means a leaf; ``context`` as in torch protocol 1 (decoded)."""

    type: str | None = None
    context: Any = None
    children: list[TreeSpec] = field(default_factory=list)

    @property
    def is_leaf(self) -> bool:
        return self.type is None

    def num_leaves(self) -> int:
        return 1 if self.is_leaf else sum(c.num_leaves() for c in self.children)

    def keys(self) -> list[str]:
        """Flat keys of the leaves, in flatten order."""
        return [k for k, _ in _walk(self, ())]

    def child_labels(self) -> list[Any]:
        """The labels (dict keys or indices) of this node's children."""
        if self.type in (DICT, ODICT):
            return list(self.context)
        return list(range(len(self.children)))

    def to_json(self) -> str:
        """torch ``treespec_dumps`` text (protocol 1)."""
        return json.dumps([1, _node_to_json(self)])

    @classmethod
    def from_json(cls, text: str | bytes) -> TreeSpec:
        if not isinstance(text, str | bytes):
            raise CorruptCheckpoint(f"tree spec is not JSON text but {type(text).__name__}")
        data = load_json(text, what="tree spec")
        if not isinstance(data, list) or len(data) != 2 or data[0] != 1:
            raise CorruptCheckpoint("tree spec is not a protocol-1 torch treespec")
        return _node_from_json(data[1])


LEAF = TreeSpec()


def _node_to_json(node: TreeSpec) -> dict[str, Any]:
    if node.is_leaf:
        return {"type": None, "context": None, "children_spec": []}
    if node.type in (DICT, ODICT):
        ctx: Any = json.dumps(list(node.context))
    elif node.type == NAMEDTUPLE:
        ctx = node.context
    else:
        ctx = json.dumps(node.context)
    return {"type": node.type, "context": ctx, "children_spec": [_node_to_json(c) for c in node.children]}


def _node_from_json(obj: Any) -> TreeSpec:
    if not isinstance(obj, dict) or "type" not in obj or "children_spec" not in obj:
        raise CorruptCheckpoint("tree spec node is malformed")
    t = obj["type"]
    kids = obj["children_spec"]
    if not isinstance(kids, list):
        raise CorruptCheckpoint("tree spec children are not a list")
    if t is None:
        if obj.get("context") is not None or kids:
            raise CorruptCheckpoint("tree spec leaf carries a context or children")
        return TreeSpec()
    if t not in _KNOWN:
        raise CorruptCheckpoint(f"tree spec names an unknown node type {t!r}")
    raw = obj.get("context")
    parse = t != NAMEDTUPLE and isinstance(raw, str)
    ctx = load_json(raw, what="tree spec context") if parse else raw
    children = [_node_from_json(c) for c in kids]
    if t in (DICT, ODICT) and (not isinstance(ctx, list) or len(ctx) != len(children)):
        raise CorruptCheckpoint("tree spec dict keys do not match its children")
    return TreeSpec(t, ctx, children)


def _walk(node: TreeSpec, path: tuple[str, ...]) -> Iterator[tuple[str, TreeSpec]]:
    if node.is_leaf:
        yield ".".join(path), node
        return
    for label, child in zip(node.child_labels(), node.children, strict=True):
        yield from _walk(child, (*path, str(label)))


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], TreeSpec]:
    """Flatten ``tree`` into ``[(key, leaf), ...]`` and its spec. Refuses colliding keys."""
    leaves: list[tuple[str, Any]] = []

    def visit(obj: Any, path: tuple[str, ...]) -> TreeSpec:
        if isinstance(obj, collections.defaultdict):
            raise UnsupportedValue("defaultdict cannot be stored in a checkpoint; convert it to a dict")
        if isinstance(obj, dict):
            t = ODICT if isinstance(obj, collections.OrderedDict) else DICT
            keys = list(obj.keys())
            return TreeSpec(t, keys, [visit(obj[k], (*path, str(k))) for k in keys])
        if _is_namedtuple(obj):
            return TreeSpec(NAMEDTUPLE, type(obj).__name__, [visit(v, (*path, str(i))) for i, v in enumerate(obj)])
        if isinstance(obj, list | tuple):
            t = LIST if isinstance(obj, list) else TUPLE
            return TreeSpec(t, None, [visit(v, (*path, str(i))) for i, v in enumerate(obj)])
        if isinstance(obj, set | frozenset):
            return TreeSpec(SET, None, [visit(v, (*path, str(i))) for i, v in enumerate(obj)])
        if isinstance(obj, collections.deque):
            return TreeSpec(DEQUE, obj.maxlen, [visit(v, (*path, str(i))) for i, v in enumerate(obj)])
        if type(obj).__name__ == "Size" and type(obj).__module__ == "torch":
            raise UnsupportedValue("torch.Size cannot be stored in a Cerebras checkpoint; store it as a list")
        if not path:
            raise UnsupportedValue("a checkpoint must be a container (dict) of values, not a bare value")
        leaves.append((".".join(path), obj))
        return TreeSpec()

    spec = visit(tree, ())
    seen: set[str] = set()
    for key, _ in leaves:
        if key in seen:
            raise KeyCollision(f"two entries flatten to the same key {key!r}")
        seen.add(key)
    return leaves, spec


def unflatten(values: list[Any], spec: TreeSpec) -> Any:
    """Rebuild the tree from leaf values in flatten order."""
    if len(values) != spec.num_leaves():
        raise CorruptCheckpoint(f"tree spec has {spec.num_leaves()} leaves but {len(values)} values were given")
    it = iter(values)

    def build(node: TreeSpec) -> Any:
        if node.is_leaf:
            return next(it)
        kids = [build(c) for c in node.children]
        if node.type == DICT:
            return dict(zip(node.context, kids, strict=True))
        if node.type == ODICT:
            return collections.OrderedDict(zip(node.context, kids, strict=True))
        if node.type == LIST:
            return kids
        if node.type in (TUPLE, NAMEDTUPLE):
            return tuple(kids)
        if node.type == SET:
            return set(kids)
        if node.type == DEQUE:
            return collections.deque(kids, maxlen=node.context)
        raise CorruptCheckpoint(f"unknown tree node type {node.type!r}")

    return build(spec)


def flat_dict_spec(keys: list[str]) -> TreeSpec:
    """A one-level dict whose keys are ``keys`` (how HF state dicts nest: not at all)."""
    return TreeSpec(DICT, list(keys), [TreeSpec() for _ in keys])


def wrap_spec(label: str, inner: TreeSpec) -> TreeSpec:
    """``{label: <inner>}``: e.g. the ``{"model": state_dict}`` of a Cerebras model checkpoint."""
    return TreeSpec(DICT, [label], [inner])


def skeleton(spec: TreeSpec) -> Any:
    """The JSON skeleton Cerebras writes beside the spec: the tree with leaves replaced by ``"*"``.

    None when the tree holds something JSON cannot say (a set), as cstorch does.
    """

    def build(node: TreeSpec) -> Any:
        if node.is_leaf:
            return "*"
        if node.type == SET:
            raise _NotJson
        kids = [build(c) for c in node.children]
        if node.type in (DICT, ODICT):
            return {str(k): v for k, v in zip(node.context, kids, strict=True)}
        return kids

    try:
        return build(spec)
    except _NotJson:
        return None


class _NotJson(Exception):
    pass
