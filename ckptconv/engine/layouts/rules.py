"""The key-pattern engine: which target keys come from which source keys, and through what.

A pattern is a key with placeholders: ``model.layers.{layer}.self_attn.q_proj.{wb}``. Placeholders
match ``\\d+`` (``layer``, ``expert``, any name ending in a digit-like role) or ``weight|bias``
(``wb``), or a regex given inline as ``{name:regex}``; everything else is literal. Patterns
compile to full-match regexes with named groups.

A :class:`KeyRule` ties patterns of the Hugging Face side to patterns of the Cerebras side:

- one pattern on each side: a 1:1 map through a transform (copy, transpose, rope, ...);
- several patterns on one side: a split (import of a fused QKV) or a merge (its export);
- a placeholder present on one side only (``stack: {expert: num_experts}``): many keys fuse into one
  (import of per-expert weights) or one splits into many (export);
- ``also_cs``: extra copies written on import (the final norm stored twice); on export they are
  matched and dropped.

Matching is "first matching rule wins", per source key, in table order. Keys matched by a drop
pattern are recorded as dropped; keys no rule matches are unmatched. Fill rules make a missing
source key stand for a present one (tied weights that a file omits), derive rules generate extra
target keys from an anchor source key (buffers the other side regenerates).

This module is pure: it deals in key names and metadata and never touches tensor data. It is one
concept at about 500 lines: the rule types, their parsing from a table and the matcher that
applies them share the pattern vocabulary above and change together.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptconv.engine.layouts.expr import ExprError, evaluate

Direction = Literal["import", "export"]  # import: hf -> cs; export: cs -> hf
Side = Literal["hf", "cs"]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([^{}]+))?\}")
DEFAULT_PLACEHOLDERS = {
    "layer": r"\d+",
    "expert": r"\d+",
    "i": r"\d+",
    "j": r"\d+",
    "wb": r"weight|bias",
}


class TableError(ValueError):
    """A layout table is malformed (raised when tables load, never at conversion time)."""


@dataclass(frozen=True)
class Pattern:
    text: str
    names: tuple[str, ...]
    regex: re.Pattern[str]

    @classmethod
    def compile(cls, text: str) -> Pattern:
        if not isinstance(text, str) or not text:
            raise TableError(f"a key pattern must be a non-empty string, got {text!r}")
        parts: list[str] = []
        names: list[str] = []
        pos = 0
        for m in _PLACEHOLDER.finditer(text):
            parts.append(re.escape(text[pos : m.start()]))
            name, rx = m.group(1), m.group(2)
            if name in names:
                parts.append(f"(?P={name})")
            else:
                rx = rx or DEFAULT_PLACEHOLDERS.get(name)
                if rx is None:
                    raise TableError(f"placeholder {{{name}}} in {text!r} needs a regex: write {{{name}:REGEX}}")
                parts.append(f"(?P<{name}>{rx})")
                names.append(name)
            pos = m.end()
        parts.append(re.escape(text[pos:]))
        if "{" in re.sub(_PLACEHOLDER, "", text) or "}" in re.sub(_PLACEHOLDER, "", text):
            raise TableError(f"unbalanced braces in key pattern {text!r}")
        return cls(text, tuple(names), re.compile("".join(parts)))

    def match(self, key: str) -> dict[str, str] | None:
        m = self.regex.fullmatch(key)
        return m.groupdict() if m else None

    def format(self, bindings: Mapping[str, Any]) -> str:
        missing = [n for n in self.names if n not in bindings]
        if missing:
            raise TableError(f"pattern {self.text!r} needs {missing} but only {sorted(bindings)} are bound")
        return _PLACEHOLDER.sub(lambda m: str(bindings[m.group(1)]), self.text)

    def strip_prefix(self, prefix: str) -> Pattern | None:
        if not self.text.startswith(prefix):
            return None
        return Pattern.compile(self.text[len(prefix) :])

    def __str__(self) -> str:
        return self.text


def _patterns(value: Any, what: str) -> tuple[Pattern, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    try:
        return tuple(Pattern.compile(v) for v in items)
    except TableError as e:
        raise TableError(f"{what}: {e}") from None


@dataclass(frozen=True)
class KeyRule:
    hf: tuple[Pattern, ...]
    cs: tuple[Pattern, ...]
    transform: str = "copy"
    params: Mapping[str, Any] = field(default_factory=dict)
    when: str | None = None
    direction: Literal["both", "import", "export"] = "both"
    stack: Mapping[str, Any] = field(default_factory=dict)
    also_cs: tuple[Pattern, ...] = ()

    def side(self, s: Side) -> tuple[Pattern, ...]:
        return self.hf if s == "hf" else self.cs

    def describe(self) -> str:
        return f"{' + '.join(map(str, self.hf))} <-> {' + '.join(map(str, self.cs))} [{self.transform}]"


@dataclass(frozen=True)
class DropRule:
    pattern: Pattern
    when: str | None = None


@dataclass(frozen=True)
class FillRule:
    """On the source side: when ``key`` is absent (or None) and ``when`` holds, read ``source`` instead."""

    key: Pattern
    source: Pattern
    when: str | None = None
    note: str = "tied weight"


@dataclass(frozen=True)
class DeriveRule:
    """On the target side: ``key`` generated from the anchor source key ``source`` (bindings shared)."""

    key: Pattern
    source: Pattern
    transform: str
    params: Mapping[str, Any] = field(default_factory=dict)
    when: str | None = None


@dataclass(frozen=True)
class RuleSet:
    """All checkpoint rules of one family variant (e.g. ``llama`` or ``llama-headless``)."""

    keys: tuple[KeyRule, ...]
    drop: Mapping[Side, tuple[DropRule, ...]]
    fill: Mapping[Side, tuple[FillRule, ...]]
    derive: Mapping[Side, tuple[DeriveRule, ...]]  # by the side the derived key is written on

    def all_patterns(self) -> Iterable[Pattern]:
        for r in self.keys:
            yield from r.hf
            yield from r.cs
            yield from r.also_cs
        for side in ("hf", "cs"):
            for d in self.drop.get(side, ()):
                yield d.pattern
            for f in self.fill.get(side, ()):
                yield f.key
                yield f.source
            for g in self.derive.get(side, ()):
                yield g.key
                yield g.source


# --- parsing tables --------------------------------------------------------------------------


def parse_rules(table: Mapping[str, Any], where: str) -> RuleSet:
    """Build a RuleSet from the ``checkpoint:`` section of a family table."""
    known = {"keys", "drop", "fill", "derive"}
    unknown = set(table) - known
    if unknown:
        raise TableError(f"{where}: unknown checkpoint sections {sorted(unknown)}")
    rules = []
    for i, raw in enumerate(table.get("keys") or []):
        rules.append(_parse_key_rule(raw, f"{where}.keys[{i}]"))
    drop: dict[Side, tuple[DropRule, ...]] = {}
    fill: dict[Side, tuple[FillRule, ...]] = {}
    derive: dict[Side, tuple[DeriveRule, ...]] = {}
    for side in ("hf", "cs"):
        drop[side] = tuple(_parse_drop(d, f"{where}.drop.{side}") for d in (table.get("drop") or {}).get(side) or [])
        fill[side] = tuple(
            _parse_fill(f, f"{where}.fill.{side}[{i}]") for i, f in enumerate((table.get("fill") or {}).get(side) or [])
        )
        derive[side] = tuple(
            _parse_derive(g, f"{where}.derive.{side}[{i}]")
            for i, g in enumerate((table.get("derive") or {}).get(side) or [])
        )
    return RuleSet(tuple(rules), drop, fill, derive)


def _check_keys(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    if not isinstance(raw, Mapping):
        raise TableError(f"{where}: expected a mapping, got {raw!r}")
    extra = set(raw) - allowed
    if extra:
        raise TableError(f"{where}: unknown fields {sorted(extra)} (allowed: {sorted(allowed)})")


def rule_mapping(raw: Any, where: str = "rule") -> Any:
    """A key rule as a mapping: the text shorthand ``"HF_PATTERN -> CS_PATTERN"`` is a plain copy."""
    if not isinstance(raw, str):
        return raw
    hf_text, sep, cs_text = raw.partition(" -> ")
    if not sep:
        raise TableError(f"{where}: a rule written as text must read 'HF_PATTERN -> CS_PATTERN'")
    return {"hf": hf_text.strip(), "cs": cs_text.strip()}


def _parse_key_rule(raw: Any, where: str) -> KeyRule:
    raw = rule_mapping(raw, where)
    _check_keys(raw, {"hf", "cs", "transform", "params", "when", "direction", "stack", "also_cs"}, where)
    hf = _patterns(raw.get("hf"), where)
    cs = _patterns(raw.get("cs"), where)
    if not hf or not cs:
        raise TableError(f"{where}: a key rule needs both `hf` and `cs` patterns")
    direction = raw.get("direction", "both")
    if direction not in ("both", "import", "export"):
        raise TableError(f"{where}: direction must be both, import or export")
    stack = dict(raw.get("stack") or {})
    for side_pats in (hf, cs):
        names = [set(p.names) for p in side_pats]
        if len({frozenset(n) for n in names}) > 1:
            raise TableError(f"{where}: patterns on one side must share their placeholders")
    hf_names, cs_names = set(hf[0].names), set(cs[0].names)
    one_sided = hf_names ^ cs_names
    if one_sided - set(stack):
        raise TableError(
            f"{where}: placeholders {sorted(one_sided - set(stack))} appear on one side only; "
            "declare their range under `stack`"
        )
    also = _patterns(raw.get("also_cs"), where)
    for p in also:
        if set(p.names) != cs_names:
            raise TableError(f"{where}: also_cs pattern {p} must use the placeholders of `cs`")
    return KeyRule(
        hf=hf,
        cs=cs,
        transform=str(raw.get("transform", "copy")),
        params=dict(raw.get("params") or {}),
        when=raw.get("when"),
        direction=direction,
        stack=stack,
        also_cs=also,
    )


def _parse_drop(raw: Any, where: str) -> DropRule:
    if isinstance(raw, str):
        return DropRule(Pattern.compile(raw))
    _check_keys(raw, {"key", "when"}, where)
    return DropRule(Pattern.compile(raw["key"]), raw.get("when"))


def _parse_fill(raw: Mapping[str, Any], where: str) -> FillRule:
    _check_keys(raw, {"key", "from", "when", "note"}, where)
    key, src = Pattern.compile(raw["key"]), Pattern.compile(raw["from"])
    if set(key.names) != set(src.names):
        raise TableError(f"{where}: `key` and `from` must use the same placeholders")
    return FillRule(key, src, raw.get("when"), raw.get("note", "tied weight"))


def _parse_derive(raw: Mapping[str, Any], where: str) -> DeriveRule:
    _check_keys(raw, {"key", "from", "transform", "params", "when"}, where)
    key, src = Pattern.compile(raw["key"]), Pattern.compile(raw["from"])
    if not set(key.names) <= set(src.names):
        raise TableError(f"{where}: `key` may only use placeholders bound by `from`")
    return DeriveRule(key, src, str(raw["transform"]), dict(raw.get("params") or {}), raw.get("when"))


def strip_hf_prefix(rules: RuleSet, prefix: str) -> RuleSet:
    """The headless variant: HF keys lose ``prefix``; rules on HF keys outside it disappear."""

    def strip_all(pats: tuple[Pattern, ...]) -> tuple[Pattern, ...] | None:
        out = [p.strip_prefix(prefix) for p in pats]
        return None if any(p is None for p in out) else tuple(p for p in out if p is not None)

    keys = []
    for r in rules.keys:
        hf = strip_all(r.hf)
        if hf is not None:
            keys.append(KeyRule(hf, r.cs, r.transform, r.params, r.when, r.direction, r.stack, r.also_cs))
    drop = dict(rules.drop)
    drop["hf"] = tuple(DropRule(p, d.when) for d in rules.drop.get("hf", ()) if (p := d.pattern.strip_prefix(prefix)))
    fill = dict(rules.fill)
    fill["hf"] = tuple(
        FillRule(k, s, f.when, f.note)
        for f in rules.fill.get("hf", ())
        if (k := f.key.strip_prefix(prefix)) and (s := f.source.strip_prefix(prefix))
    )
    derive = dict(rules.derive)
    derive["hf"] = tuple(
        DeriveRule(k, g.source, g.transform, g.params, g.when)
        for g in rules.derive.get("hf", ())
        if (k := g.key.strip_prefix(prefix))
    )
    derive["cs"] = tuple(
        DeriveRule(g.key, s, g.transform, g.params, g.when)
        for g in rules.derive.get("cs", ())
        if (s := g.source.strip_prefix(prefix))
    )
    return RuleSet(tuple(keys), drop, fill, derive)


# --- matching ------------------------------------------------------------------------------


@dataclass
class MappedOutput:
    """One target key: produced from ``inputs`` (source keys) by ``transform`` at ``index``."""

    key: str
    inputs: list[str]
    transform: str
    params: dict[str, Any]
    index: int = 0
    rule: str = ""


@dataclass
class Mapping_:
    outputs: list[MappedOutput] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    fills: dict[str, str] = field(default_factory=dict)  # absent source key -> present key read instead
    warnings: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)  # messages for groups missing a member


def _holds(when: str | None, env: Mapping[str, Any]) -> bool:
    return True if when is None else bool(evaluate(when, env))


def map_keys(
    rules: RuleSet,
    direction: Direction,
    source_keys: Iterable[str],
    env: Mapping[str, Any],
    *,
    absent: Iterable[str] = (),
) -> Mapping_:
    """Match every source key and describe every target key (no data is read).

    ``source_keys`` are the keys present on the source side in checkpoint order; ``absent`` lists
    keys that exist but hold no tensor (a None member of a tied pair in old checkpoints): they can
    be filled like missing keys.
    """
    src_side: Side = "hf" if direction == "import" else "cs"
    tgt_side: Side = "cs" if direction == "import" else "hf"
    result = Mapping_()
    keys = [k for k in source_keys]
    none_keys = set(absent)
    present = [k for k in keys if k not in none_keys]
    present_set = set(present)

    # 1. fills: tied partners stand in for keys the file omits.
    notes: dict[str, str] = {}
    for f in rules.fill.get(src_side, ()):
        if not _holds(f.when, env):
            continue
        for k in present:
            b = f.source.match(k)
            if b is None:
                continue
            missing = f.key.format(b)
            if missing not in present_set and missing not in result.fills:
                result.fills[missing] = k
                notes[missing] = f"{missing} is not in the source; filled from {k} ({f.note})"
    available = present + [k for k in result.fills if k not in present_set]
    available_set = set(available)
    resolve = {k: result.fills.get(k, k) for k in available}

    active = [r for r in rules.keys if (r.direction == "both" or r.direction == direction) and _holds(r.when, env)]
    # 2. match: first rule wins; group keys that feed the same outputs.
    groups: dict[tuple[int, tuple[tuple[str, str], ...]], list[str]] = {}
    order: list[tuple[int, tuple[tuple[str, str], ...]]] = []
    also_drops = [p for r in active for p in r.also_cs] if direction == "export" else []
    drops = [d.pattern for d in rules.drop.get(src_side, ()) if _holds(d.when, env)]
    for key in available:
        hit = None
        for ri, r in enumerate(active):
            for pat in r.side(src_side):
                b = pat.match(key)
                if b is not None:
                    hit = (ri, b)
                    break
            if hit:
                break
        if hit is None:
            if any(p.match(key) is not None for p in (*also_drops, *drops)):
                if key in present_set:
                    result.dropped.append(key)
                continue
            if key in present_set:
                result.unmatched.append(key)
            continue
        ri, b = hit
        r = active[ri]
        gkey = (ri, tuple(sorted((n, v) for n, v in b.items() if n not in _stacked_on(r, src_side))))
        if gkey not in groups:
            groups[gkey] = []
            order.append(gkey)
        groups[gkey].append(key)
    for key in none_keys:
        if key not in available_set:
            result.dropped.append(key)

    # 3. outputs of each group.
    used_fills: set[str] = set()
    for gkey in order:
        ri, bound = gkey
        r = active[ri]
        bindings = dict(bound)
        ranges = _stack_ranges(r, env)
        inputs: list[str] = []
        missing: list[str] = []
        for pat in r.side(src_side):
            for combo in _combos(pat, bindings, ranges):
                k = pat.format({**bindings, **combo})
                (inputs if k in available_set else missing).append(k)
        if missing:
            members = [k for k in groups[gkey] if k in present_set]
            result.incomplete.append(
                f"{', '.join(members) or '(filled keys)'}: rule {r.describe()} also needs {', '.join(missing)}"
            )
            result.unmatched.extend(members)
            continue
        real_inputs = [resolve[k] for k in inputs]
        used_fills.update(k for k in inputs if k in result.fills)
        tgt_patterns = list(r.side(tgt_side))
        index = 0
        for pat in tgt_patterns:
            for combo in _combos(pat, bindings, ranges):
                result.outputs.append(
                    MappedOutput(
                        pat.format({**bindings, **combo}), real_inputs, r.transform, dict(r.params), index, r.describe()
                    )
                )
                index += 1
        if direction == "import":
            for pat in r.also_cs:
                result.outputs.append(
                    MappedOutput(pat.format(bindings), real_inputs, r.transform, dict(r.params), 0, r.describe())
                )

    # 4. derived keys on the target side.
    for g in rules.derive.get(tgt_side, ()):
        if not _holds(g.when, env):
            continue
        for k in available:
            b = g.source.match(k)
            if b is None:
                continue
            if k in result.fills:
                used_fills.add(k)
            result.outputs.append(
                MappedOutput(g.key.format(b), [resolve[k]], g.transform, dict(g.params), 0, f"derived from {g.source}")
            )
    # Only fills that feed an output are worth a warning.
    result.warnings[:0] = [notes[k] for k in result.fills if k in used_fills]
    result.fills = {k: v for k, v in result.fills.items() if k in used_fills}
    _dedupe(result)
    return result


def _stacked_on(rule: KeyRule, side: Side) -> set[str]:
    names = set(rule.side(side)[0].names)
    other = set(rule.side("cs" if side == "hf" else "hf")[0].names)
    return (names - other) & set(rule.stack)


def _stack_ranges(rule: KeyRule, env: Mapping[str, Any]) -> dict[str, int]:
    out = {}
    for name, expr in rule.stack.items():
        try:
            out[name] = int(evaluate(expr, env))
        except ExprError as e:
            raise TableError(str(e)) from None
    return out


def _combos(pat: Pattern, bindings: Mapping[str, Any], ranges: Mapping[str, int]) -> list[dict[str, int]]:
    free = [n for n in pat.names if n not in bindings]
    if not free:
        return [{}]
    return [dict(zip(free, vals, strict=True)) for vals in itertools.product(*(range(ranges[n]) for n in free))]


def _dedupe(result: Mapping_) -> None:
    seen: dict[str, MappedOutput] = {}
    out = []
    for o in result.outputs:
        if o.key in seen:
            prev = seen[o.key]
            if prev.inputs != o.inputs or prev.transform != o.transform or prev.index != o.index:
                result.warnings.append(f"{o.key} is produced by two rules; the first ({prev.rule}) wins")
            continue
        seen[o.key] = o
        out.append(o)
    result.outputs = out
