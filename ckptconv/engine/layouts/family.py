"""One family table, parsed (:class:`Family`), its model names (:class:`Variant`), and each
variant's key rules and config table: the family's, changed by what the variant's entry under
``variants:`` says (HF keys omitted, a CS prefix renamed, rules added, config fields added) and by
``-headless`` (the HF base model without the LM head)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv.engine.layouts.config import ConfigTable, parse_config_table
from ckptconv.engine.layouts.rules import (
    DeriveRule,
    DropRule,
    Pattern,
    RuleSet,
    parse_rules,
    rule_mapping,
    strip_hf_prefix,
)
from ckptconv.engine.layouts.table_merge import merge_checkpoint, merge_config

FAMILY, COMPOSITE, WRAPPER = "family", "composite", "wrapper"  # the kinds of tables


@dataclass(frozen=True)
class Variant:
    """One model name: its table plus what distinguishes it (headless, a fine-tuning head)."""

    name: str
    family: str
    headless: bool = False
    head: str | None = None
    alias_of: str | None = None
    note: str | None = None
    unsupported: str | None = None  # reason, for names kept only to say why they cannot convert
    kind: str = FAMILY  # composite / wrapper: planned by the table's own module, not by key rules


@dataclass
class Family:
    name: str
    description: str
    cs_name: str
    cs_class: str
    names: list[str]
    headless_prefix: str | None
    hf_releases: list[str]
    cs_releases: list[str]
    hf: dict[str, Any]
    dims: dict[str, Any]
    rules: RuleSet
    config: ConfigTable
    raw: dict[str, Any]
    variants: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hf_style_releases: list[str] = field(default_factory=list)  # CS releases keyed with HF names (BERT/T5 1.6)
    # Derived once per variant name: tables are loaded once per process and never change.
    _rules: dict[str, RuleSet] = field(default_factory=dict, repr=False, compare=False)
    _configs: dict[str, ConfigTable] = field(default_factory=dict, repr=False, compare=False)

    def rules_for(self, variant: Variant) -> RuleSet:
        if variant.name not in self._rules:
            self._rules[variant.name] = variant_rules(self, variant)
        return self._rules[variant.name]

    def config_for(self, variant: Variant) -> ConfigTable:
        if variant.name not in self._configs:
            self._configs[variant.name] = variant_config(self, variant.name)
        return self._configs[variant.name]

    def variant_table(self, name: str) -> dict[str, Any] | None:
        for v in self.variants:
            if name in v.get("names", []):
                return v
        return None


def variant_rules(fam: Family, v: Variant) -> RuleSet:
    """The key rules of model name ``v`` of family ``fam``."""
    vt = fam.variant_table(v.name)
    checkpoint = copy.deepcopy(fam.raw["checkpoint"])
    checkpoint["keys"] = [rule_mapping(r) for r in checkpoint.get("keys") or []]
    if vt is not None:
        omit = tuple(vt.get("omit_hf") or ())
        if omit:
            checkpoint["keys"] = [
                r for r in checkpoint.get("keys") or [] if not any(_first(r["hf"]).startswith(p) for p in omit)
            ]
            for sect in ("drop", "fill", "derive"):
                for side, items in (checkpoint.get(sect) or {}).items():
                    checkpoint[sect][side] = [
                        it for it in items if not any(_item_hf(it, sect, side).startswith(p) for p in omit)
                    ]
        rename = vt.get("cs_rename") or {}
        if rename:
            checkpoint = _rename_cs(checkpoint, rename)
        if "checkpoint" in vt:
            checkpoint = merge_checkpoint(checkpoint, vt["checkpoint"])
    rules = parse_rules(checkpoint, f"{fam.name}/{v.name}")
    if v.headless and fam.headless_prefix is not None:
        rules = _headless(rules, fam.headless_prefix)
    return rules


def variant_config(fam: Family, name: str) -> ConfigTable:
    """The config table of model name ``name`` of family ``fam``."""
    vt = fam.variant_table(name)
    if vt is None or "config_add" not in vt:
        return fam.config
    return parse_config_table(merge_config(fam.raw["config"], vt["config_add"]), f"{fam.name}/{name}")


def _first(p: Any) -> str:
    return p[0] if isinstance(p, list) else p


def _item_hf(item: Any, sect: str, side: str) -> str:
    if side != "hf":
        return "\0"
    if isinstance(item, str):
        return item
    return item.get("key", "\0")


def _rename_cs(checkpoint: dict[str, Any], rename: Mapping[str, str]) -> dict[str, Any]:
    def fix(p: Any) -> Any:
        if isinstance(p, list):
            return [fix(x) for x in p]
        for old, new in rename.items():
            if p.startswith(old):
                return new + p[len(old) :]
        return p

    out = copy.deepcopy(checkpoint)
    for r in out.get("keys") or []:
        r["cs"] = fix(r["cs"])
        if "also_cs" in r:
            r["also_cs"] = fix(r["also_cs"])
    for sect in ("drop", "fill", "derive"):
        for side, items in (out.get(sect) or {}).items():
            new_items = []
            for it in items:
                if isinstance(it, str):
                    new_items.append(fix(it) if side == "cs" else it)
                    continue
                it = dict(it)
                if side == "cs":
                    it["key"] = fix(it["key"])
                if sect == "fill" and side == "cs":
                    it["from"] = fix(it["from"])
                if sect == "derive" and side == "hf":
                    it["from"] = fix(it["from"])  # derived HF keys are anchored on CS keys
                new_items.append(it)
            out[sect][side] = new_items
    return out


def _headless(rules: RuleSet, prefix: str) -> RuleSet:
    """HF base model: strip the prefix; LM head synthesized on import, dropped on export."""
    stripped = strip_hf_prefix(rules, prefix)
    derive = dict(stripped.derive)
    emb_rules = [r for r in rules.keys if r.cs and r.cs[0].text == "embedding_layer.word_embeddings.weight"]
    extra = []
    if emb_rules:
        emb_hf = emb_rules[0].hf[0].strip_prefix(prefix)
        if emb_hf is not None:
            extra.append(DeriveRule(Pattern.compile("lm_head.weight"), emb_hf, "lm_head", {"tie": "tie"}))
            # A model whose CS head has a bias (GPT-J, CodeGen) gets a zero one.
            extra.append(
                DeriveRule(
                    Pattern.compile("lm_head.bias"),
                    emb_hf,
                    "zeros",
                    {"shape": ["vocab_size"]},
                    when="get('use_bias_in_output', False)",
                )
            )
    derive["cs"] = tuple(extra) + tuple(derive.get("cs", ()))
    drop = dict(stripped.drop)
    drop["cs"] = (DropRule(Pattern.compile("lm_head.{wb}")), *drop.get("cs", ()))
    fill = dict(stripped.fill)
    fill["cs"] = tuple(f for f in fill.get("cs", ()) if not f.key.text.startswith("lm_head"))
    return RuleSet(stripped.keys, drop, fill, derive)
