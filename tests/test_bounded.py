"""Bounded JSON and YAML parsing of untrusted files (ckptconv.core.bounded)."""

from __future__ import annotations

import pytest

from ckptconv.core.bounded import MAX_DEPTH, json_depth, load_json, load_yaml
from ckptconv.core.errors import ConfigConversionError, CorruptCheckpoint

DEEP = 50_000  # far past Python's recursion limit


def test_json_depth_ignores_brackets_inside_strings() -> None:
    assert json_depth('{"a": "[[[{{", "b": [[1], {"c": "\\"]"}]}') == 3
    assert json_depth("1") == 0


@pytest.mark.parametrize(
    "doc",
    ["[" * DEEP + "]" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP, "[" * DEEP, '{"k": ' + "[" * (MAX_DEPTH + 1)],
)
def test_deep_json_is_a_typed_error(doc: str) -> None:
    with pytest.raises(CorruptCheckpoint, match="nests"):
        load_json(doc, what="header")
    with pytest.raises(ConfigConversionError):
        load_json(doc.encode(), what="config.json", error=ConfigConversionError)


def test_json_size_encoding_and_syntax_are_typed_errors() -> None:
    with pytest.raises(CorruptCheckpoint, match="over the 10-byte limit"):
        load_json("[" + "1," * 10 + "1]", what="x", max_bytes=10)
    with pytest.raises(CorruptCheckpoint, match="UTF-8"):
        load_json(b'{"\xff": 1}', what="x")
    with pytest.raises(CorruptCheckpoint, match="not valid JSON"):
        load_json("{nope", what="x")
    assert load_json('{"a": [1, {"b": null}]}', what="x") == {"a": [1, {"b": None}]}


BOMB = """a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]
"""


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ("[" * DEEP, "levels deep"),
        ("a: " + "[" * DEEP + "]" * DEEP, "levels deep"),
        ("- " * 5000 + "x", "levels deep"),  # block nesting on one line
        ("&a [*a]", "refers to itself"),
        (BOMB, "expands to more than"),
        ("a: [unclosed", "not valid YAML"),
        ("!!python/object/apply:os.system ['echo pwned']", "not valid YAML"),
    ],
)
def test_hostile_yaml_is_a_typed_error(doc: str, match: str) -> None:
    with pytest.raises(CorruptCheckpoint, match=match):
        load_yaml(doc, what="params.yaml")


def test_yaml_with_shared_anchors_still_loads() -> None:
    doc = load_yaml("base: &b {lr: 0.1}\ntrain: *b\neval: *b\n", what="params.yaml")
    assert doc["train"] == doc["eval"] == {"lr": 0.1}
