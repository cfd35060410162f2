"""JSON and YAML from untrusted files, parsed within bounds on size, nesting and alias expansion.

Checkpoint headers (safetensors, ``__metadata__``), shard maps (``*.index.json``), specs stored in
Cerebras checkpoints, configs and index files all come from users. Python's parsers recurse once
per nesting level: ``[[[[…]]]]`` a few thousand deep ends in RecursionError, and YAML aliases can
make a small document expand into billions of nodes for whoever walks it. Every such file goes
through :func:`load_json` / :func:`load_yaml`, which refuse it first with a typed error
(:class:`~ckptconv.core.errors.CorruptCheckpoint` unless the caller names another), never an
untyped one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from itertools import accumulate
from typing import Any

from ckptconv.core.errors import CkptconvError, CorruptCheckpoint

MAX_DEPTH = 128  # real configs and headers nest a handful of levels, tree specs a few dozen
MAX_BYTES = 64 << 20  # configs, indexes and metadata are small; tensor data never goes through here
MAX_NODES = 1_000_000  # YAML nodes after alias expansion

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """How deeply ``text`` nests arrays and objects (brackets inside strings do not count)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    return max(accumulate(1 if c in "[{" else -1 for c in brackets))


def load_json(
    data: bytes | str,
    *,
    what: str,
    error: type[CkptconvError] = CorruptCheckpoint,
    max_depth: int = MAX_DEPTH,
    max_bytes: int = MAX_BYTES,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """Parse JSON from an untrusted file; ``what`` names it in the error (e.g. the URI and its role)."""
    if len(data) > max_bytes:
        raise error(f"{what} is {len(data)} bytes, over the {max_bytes}-byte limit for JSON")
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray | memoryview) else data
    except UnicodeDecodeError as e:
        raise error(f"{what} is not valid UTF-8: {e}") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise error(f"{what} nests {depth} levels deep, over the limit of {max_depth}")
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:  # not reached within max_depth; a last line of defence
        raise error(f"{what} nests too deeply") from None
    except CkptconvError:  # raised by object_pairs_hook: already says what is wrong
        raise
    except ValueError as e:
        raise error(f"{what} is not valid JSON: {e}") from None


class _TooBig(Exception):
    pass


def _bounded_loader(max_depth: int, max_nodes: int) -> type:
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        """SafeLoader that counts nesting while composing and expanded nodes before constructing."""

        def __init__(self, stream: Any) -> None:
            super().__init__(stream)
            self._depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            self._depth += 1
            try:
                if self._depth > max_depth:
                    raise _TooBig(f"nests more than {max_depth} levels deep")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_document(self, node: Any) -> Any:
            if _expanded_size(node, max_nodes) > max_nodes:
                raise _TooBig(f"expands to more than {max_nodes} nodes through its aliases")
            return super().construct_document(node)

    return BoundedLoader


def _expanded_size(root: Any, limit: int) -> int:
    """Nodes a walk of ``root`` visits, counting shared (aliased) nodes once per reference."""
    import yaml

    memo: dict[int, int] = {}
    open_nodes: set[int] = set()  # on the current path: meeting one again means the document is recursive
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            memo[id(node)] = 1
            continue
        if done:
            open_nodes.discard(id(node))
            memo[id(node)] = min(limit + 1, 1 + sum(memo[id(c)] for c in children))
            continue
        if id(node) in memo:
            continue
        if id(node) in open_nodes:
            raise _TooBig("refers to itself through an alias")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in memo)
    return memo[id(root)]


def load_yaml(
    data: bytes | str,
    *,
    what: str,
    error: type[CkptconvError] = CorruptCheckpoint,
    max_depth: int = MAX_DEPTH,
    max_bytes: int = MAX_BYTES,
    max_nodes: int = MAX_NODES,
) -> Any:
    """Parse YAML (safe tags only) from an untrusted file within bounds; ``what`` names it in errors."""
    import yaml

    if len(data) > max_bytes:
        raise error(f"{what} is {len(data)} bytes, over the {max_bytes}-byte limit for YAML")
    loader = _bounded_loader(max_depth, max_nodes)
    try:
        return yaml.load(data, Loader=loader)
    except _TooBig as e:
        raise error(f"{what} {e}") from None
    except RecursionError:
        raise error(f"{what} nests too deeply") from None
    except yaml.YAMLError as e:
        raise error(f"{what} is not valid YAML: {e}") from None
