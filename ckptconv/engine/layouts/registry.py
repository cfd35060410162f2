"""Model names -> family tables, formats and releases.

Every family is one YAML table under ``families/`` (validated when loaded); Model Zoo names,
their aliases and ``-headless`` variants all resolve here. This module is torch-free: the API
process lists models from it.

Table fields (see ``families/llama.yaml`` for a complete example):

- ``family``, ``description``, ``cs_name`` (the registry name written as ``name:`` in CS configs),
  ``cs_class`` (the Model Zoo class that builds the model);
- ``names``: Model Zoo names sharing the table; ``headless: {prefix: ...}`` adds ``<name>-headless``
  for each (HF base model without the prefix; the CS LM head is synthesized on import);
- ``releases``: ``hf: [lo, hi]`` releases the HF converter reaches directly, ``cs: [lo, hi]``
  releases the family exists in (older ones are reached through upgrade steps);
- ``hf``: ``model_type``, ``architectures`` (and ``headless_architectures``);
- ``dims``: named expressions over the CS model config used by transforms and conditions;
- ``checkpoint``: key rules (``ckptconv.engine.layouts.rules``); ``config``: field mapping
  (``ckptconv.engine.layouts.config``);
- ``extends: <family>`` reuses another table, with ``checkpoint_add`` (rules tried first) and
  ``config_add`` (fields appended, sets and consts merged) for the differences;
- ``variants``: further names with a ``head`` (fine-tuning heads), a CS prefix rewrite, rules to
  omit and extra rules, their own ``cs_class``, and ``notes`` replacing the family's.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.errors import NoConversionPath, UnknownModel
from ckptconv.core.releases import release_range
from ckptconv.engine.layouts.config import ConfigTable, parse_config_table
from ckptconv.engine.layouts.expr import ExprError, compile_expr
from ckptconv.engine.layouts.rules import Pattern, RuleSet, TableError, parse_rules, rule_mapping, strip_hf_prefix
from ckptconv.engine.layouts.transforms import TRANSFORMS

FAMILIES_DIR = os.path.join(os.path.dirname(__file__), "families")


@dataclass(frozen=True)
class Variant:
    """One model name: its family plus what distinguishes it (headless, a fine-tuning head)."""

    name: str
    family: str
    headless: bool = False
    head: str | None = None
    alias_of: str | None = None
    note: str | None = None
    unsupported: str | None = None  # reason, for names kept only to say why they cannot convert
    wrapper: bool = False  # no table of its own: see WRAPPERS


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

    def rules_for(self, variant: Variant) -> RuleSet:
        return _variant_rules(self.name, variant.name)

    def config_for(self, variant: Variant) -> ConfigTable:
        return _variant_config(self.name, variant.name)

    def variant_table(self, name: str) -> dict[str, Any] | None:
        for v in self.variants:
            if name in v.get("names", []):
                return v
        return None


# --- loading -------------------------------------------------------------------------------


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, encoding="utf-8") as f:
        data = yaml.load(f, Loader=loader)
    if not isinstance(data, dict):
        raise TableError(f"{path}: a family table is a mapping")
    return data


_TOP_FIELDS = {
    "family",
    "description",
    "cs_name",
    "cs_class",
    "names",
    "headless",
    "releases",
    "hf",
    "dims",
    "checkpoint",
    "config",
    "extends",
    "checkpoint_add",
    "config_add",
    "variants",
    "notes",
    "aliases",
    "hf_style_releases",
}


def _merge_config(base: dict[str, Any], add: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in add.items():
        if k in ("fields", "hooks", "import_consts"):
            out[k] = list(out.get(k) or []) + list(v)
        elif k in ("remove_fields",):
            drop = set(v)
            out["fields"] = [f for f in out.get("fields") or [] if (f if isinstance(f, str) else f["hf"]) not in drop]
        elif k == "remove_hooks":
            out["hooks"] = [h for h in out.get("hooks") or [] if h not in set(v)]
        elif isinstance(v, Mapping):
            merged = dict(out.get(k) or {})
            merged.update(v)
            out[k] = merged
        else:
            out[k] = v
    return out


def _merge_checkpoint(base: dict[str, Any], add: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in add.items():
        if k == "keys":
            out["keys"] = list(v) + list(out.get("keys") or [])  # added rules are tried first
        elif k in ("drop", "fill", "derive"):
            sect = dict(out.get(k) or {})
            for side, items in v.items():
                sect[side] = list(items) + list(sect.get(side) or [])
            out[k] = sect
        else:
            raise TableError(f"checkpoint_add: unknown section {k!r}")
    return out


def _resolve_extends(raw: dict[str, Any], raws: Mapping[str, dict[str, Any]], seen: tuple[str, ...] = ()) -> dict:
    parent_name = raw.get("extends")
    if not parent_name:
        return raw
    if parent_name in seen or parent_name not in raws:
        raise TableError(f"{raw.get('family')}: extends unknown or cyclic family {parent_name!r}")
    parent = _resolve_extends(raws[parent_name], raws, (*seen, parent_name))
    out = copy.deepcopy(parent)
    for k, v in raw.items():
        if k in ("checkpoint_add", "config_add", "extends", "variants"):
            continue
        out[k] = copy.deepcopy(v)
    out.pop("variants", None)
    if "variants" in raw:
        out["variants"] = raw["variants"]
    if "checkpoint_add" in raw:
        out["checkpoint"] = _merge_checkpoint(out.get("checkpoint") or {}, raw["checkpoint_add"])
    if "config_add" in raw:
        out["config"] = _merge_config(out.get("config") or {}, raw["config_add"])
    out["extends"] = parent_name
    return out


def _validate_exprs(fam: Family) -> None:
    def check(expr: Any, where: str) -> None:
        if isinstance(expr, str):
            try:
                compile_expr(expr)
            except ExprError as e:
                raise TableError(f"{fam.name}: {where}: {e}") from None
        elif isinstance(expr, list):
            for x in expr:
                check(x, where)
        elif isinstance(expr, Mapping):
            for x in expr.values():
                check(x, where)

    for k, v in fam.dims.items():
        check(v, f"dims.{k}")
    for r in fam.rules.keys:
        lit = TRANSFORMS[r.transform].literal if r.transform in TRANSFORMS else ()
        check({k: v for k, v in r.params.items() if k not in lit}, f"params of {r.describe()}")
        check(dict(r.stack), f"stack of {r.describe()}")
        if r.when:
            check(r.when, f"when of {r.describe()}")
        if r.transform not in TRANSFORMS:
            raise TableError(f"{fam.name}: rule {r.describe()} names unknown transform {r.transform!r}")
    for side in ("hf", "cs"):
        for g in fam.rules.derive.get(side, ()):
            if g.transform not in TRANSFORMS:
                raise TableError(f"{fam.name}: derive rule {g.key} names unknown transform {g.transform!r}")
            check(dict(g.params), f"params of derived {g.key}")


def _build_family(raw: dict[str, Any], path: str) -> Family:
    unknown = set(raw) - _TOP_FIELDS
    if unknown:
        raise TableError(f"{path}: unknown top-level fields {sorted(unknown)}")
    for req in ("family", "cs_class", "names", "releases", "checkpoint", "config"):
        if req not in raw:
            raise TableError(f"{path}: missing `{req}`")
    rel = raw["releases"]
    hf_rel = release_range(*[str(x) for x in rel["hf"]]) if rel.get("hf") else []
    cs_rel = release_range(*[str(x) for x in rel["cs"]])
    if not set(hf_rel) <= set(cs_rel):
        raise TableError(f"{path}: releases.hf must lie within releases.cs")
    fam = Family(
        name=raw["family"],
        description=raw.get("description", ""),
        cs_name=raw.get("cs_name", raw["family"]),
        cs_class=raw["cs_class"],
        names=list(raw["names"]),
        headless_prefix=(raw.get("headless") or {}).get("prefix") if raw.get("headless") else None,
        hf_releases=hf_rel,
        cs_releases=cs_rel,
        hf=dict(raw.get("hf") or {}),
        dims=dict(raw.get("dims") or {}),
        rules=parse_rules(raw["checkpoint"], f"{path}: checkpoint"),
        config=parse_config_table(raw["config"], f"{path}: config"),
        raw=raw,
        variants=list(raw.get("variants") or []),
        notes=list(raw.get("notes") or []),
        hf_style_releases=[str(r) for r in raw.get("hf_style_releases") or []],
    )
    _validate_exprs(fam)
    for v in fam.variants:
        extra = set(v) - {
            "names",
            "head",
            "cs_rename",
            "omit_hf",
            "checkpoint",
            "config_add",
            "hf",
            "note",
            "notes",
            "cs_class",
            "releases",
            "headless",
        }
        if extra:
            raise TableError(f"{path}: variant {v.get('names')}: unknown fields {sorted(extra)}")
        if "checkpoint" in v:
            parse_rules(_merge_checkpoint({}, v["checkpoint"]), f"{path}: variant {v['names']}")
        if "config_add" in v:
            parse_config_table(_merge_config(raw["config"], v["config_add"]), f"{path}: variant {v['names']}")
    return fam


@functools.lru_cache(maxsize=1)
def families() -> dict[str, Family]:
    raws: dict[str, tuple[dict[str, Any], str]] = {}
    for fn in sorted(os.listdir(FAMILIES_DIR)):
        if not fn.endswith(".yaml"):
            continue
        path = os.path.join(FAMILIES_DIR, fn)
        raw = _load_yaml(path)
        name = raw.get("family")
        if not name or name in raws:
            raise TableError(f"{path}: missing or duplicate family name {name!r}")
        raws[name] = (raw, path)
    plain = {k: v[0] for k, v in raws.items()}
    return {name: _build_family(_resolve_extends(raw, plain), path) for name, (raw, path) in raws.items()}


@functools.lru_cache(maxsize=1)
def model_index() -> dict[str, Variant]:
    index: dict[str, Variant] = {}

    def add(v: Variant) -> None:
        if v.name in index:
            raise TableError(f"model name {v.name!r} is claimed by {index[v.name].family} and {v.family}")
        index[v.name] = v

    for fam in families().values():
        for i, name in enumerate(fam.names):
            add(Variant(name, fam.name, alias_of=fam.names[0] if i else None))
            if fam.headless_prefix is not None:
                add(Variant(f"{name}-headless", fam.name, headless=True, alias_of=fam.names[0] if i else None))
        for v in fam.variants:
            for j, name in enumerate(v["names"]):
                add(
                    Variant(
                        name,
                        fam.name,
                        headless=bool(v.get("headless")),
                        head=v.get("head"),
                        alias_of=v["names"][0] if j else None,
                        note=v.get("note"),
                    )
                )
    for name, reason in UNSUPPORTED.items():
        if name not in index:
            index[name] = Variant(name, "", unsupported=reason)
    for name, w in WRAPPERS.items():
        index[name] = Variant(name, "", wrapper=True, note=w.note)
    return index


# Names in the Model Zoo that cannot be converted here, with the reason shown to users.
UNSUPPORTED: dict[str, str] = {}


@dataclass(frozen=True)
class Wrapper:
    """A model name with no table of its own: it wraps other tables (ckptconv.engine.layouts.dpo, .dpr, .llava)."""

    summary: str  # its formats, in a line
    formats: tuple[str, ...]
    note: str
    key_rules: tuple[str, ...]
    cs_class: str  # the Model Zoo class of the whole (the wrapped models keep theirs)
    hf_classes: tuple[str, ...] = ()


WRAPPERS: dict[str, Wrapper] = {
    "dpo": Wrapper(
        "hf <-> cs-2.1-dpo ... cs-2.9-dpo; cs-2.1-no-dpo <-> cs-2.1-dpo",
        ("hf", *(f"cs-2.{r}-dpo" for r in range(1, 10)), "cs-2.1-no-dpo"),
        "a language model trained with DPO: its keys under policy_model.model. and ref_model.model.; "
        "the model is the HF config's model_type or the CS config's model.model_name "
        "(bloom, falcon, gpt2, gptj, gpt-neox, llama, mistral, mpt, santacoder, starcoder)",
        (
            "model.<key> (the wrapped model's Cerebras key) <-> model.policy_model.model.<key>",
            "model.ref_model.model.<key>: written as a link to the policy tensor; dropped towards hf / no-dpo",
        ),
        "DPOModel",
    ),
    "dpr": Wrapper(
        "hf (q_encoder/ + ctx_encoder/) <-> cs-2.2 ... cs-2.9",
        ("hf", *(f"cs-2.{r}" for r in range(2, 10))),
        "dense passage retrieval: two BERT encoders; the HF side is a directory holding q_encoder/ "
        "(DPRQuestionEncoder) and ctx_encoder/ (DPRContextEncoder), the CS side one checkpoint "
        "(model.question_encoder.*, model.ctx_encoder.*)",
        (
            "q_encoder/ question_encoder.bert_model.<BERT key> <-> model.question_encoder.<encoder key> (bert table)",
            "ctx_encoder/ ctx_encoder.bert_model.<BERT key> <-> model.ctx_encoder.<encoder key> (bert table)",
        ),
        "DPRModel",
        ("DPRQuestionEncoder", "DPRContextEncoder"),
    ),
    "llava": Wrapper(
        "hf (image_model/ + text_model/) <-> cs-2.2 ... cs-2.9",
        ("hf", *(f"cs-2.{r}" for r in range(2, 10))),
        "LLaVA: a CLIP vision tower, an MLP projector and a Llama language model; the HF side is a directory "
        "holding image_model/ (CLIPVisionModel or CLIPModel, config.json, preprocessor_config.json) and "
        "text_model/ (LlavaLlamaForCausalLM: Llama keys + model.mm_projector.*, config.json with the mm_* "
        "fields), the CS side one checkpoint (model.image_model.*, model.text_model.*, "
        "model.projector_image_model.*); a missing projector is initialized",
        (
            "image_model/ vision_model.<CLIP key> <-> model.image_model.<ViT key> (clip-vit table)",
            "text_model/ <Llama key> <-> model.text_model.<Llama key> (llama table)",
            "text_model/ model.mm_projector.<2n>.<wb> <-> model.projector_image_model.ffn.<n>.linear_layer.<wb>",
            "text_model/ model.vision_tower.*: dropped (the tower comes from image_model/)",
        ),
        "LlavaModel",
        ("CLIPVisionModel", "LlavaLlamaForCausalLM"),
    ),
}


def resolve(name: str) -> tuple[Family, Variant]:
    """The family and variant of a model name (case-sensitive as in the Model Zoo, e.g. llamaV2)."""
    index = model_index()
    v = index.get(name)
    if v is None:
        lowered = {k.lower(): k for k in index}
        if name.lower() in lowered:
            v = index[lowered[name.lower()]]
    if v is None:
        raise UnknownModel(f"unknown model {name!r}", model=name)
    if v.unsupported:
        raise NoConversionPath(f"model {name!r} cannot be converted: {v.unsupported}", model=name)
    if v.wrapper:
        raise NoConversionPath(
            f"model {name!r} wraps another model and has no layout table of its own",
            model=name,
            hint=f"its conversions go through ckptconv.engine.layouts.{name}",
        )
    return families()[v.family], v


def is_known_model(name: str) -> bool:
    """Whether ``name`` converts here (a family's name or alias, or a wrapper such as dpo)."""
    v = model_index().get(name)
    if v is not None and v.wrapper:
        return True
    resolve(name)
    return True


# --- variant tables ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _variant_rules(family: str, name: str) -> RuleSet:
    fam = families()[family]
    v = model_index()[name]
    vt = fam.variant_table(name)
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
            checkpoint = _merge_checkpoint(checkpoint, vt["checkpoint"])
    rules = parse_rules(checkpoint, f"{family}/{name}")
    if v.headless and fam.headless_prefix is not None:
        rules = _headless(rules, fam.headless_prefix)
    return rules


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
    from ckptconv.engine.layouts.rules import DeriveRule, DropRule

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


@functools.lru_cache(maxsize=256)
def _variant_config(family: str, name: str) -> ConfigTable:
    fam = families()[family]
    vt = fam.variant_table(name)
    if vt is None or "config_add" not in vt:
        return fam.config
    return parse_config_table(_merge_config(fam.raw["config"], vt["config_add"]), f"{family}/{name}")


# --- the `ckptconv models` view ----------------------------------------------------------------


def formats_of(fam: Family, variant: Variant) -> list[str]:
    vt = fam.variant_table(variant.name)
    if vt and vt.get("releases"):
        rel = vt["releases"]
        hf = release_range(*map(str, rel["hf"])) if rel.get("hf") else []
        cs = release_range(*map(str, rel["cs"]))
    else:
        hf, cs = fam.hf_releases, fam.cs_releases
    return (["hf"] if hf else []) + [f"cs-{r}" for r in cs]


def list_models() -> list[dict[str, Any]]:
    """Every model name with its family and formats (torch-free; served by GET /v1/models)."""
    out = []
    fams = families()
    for name, v in sorted(model_index().items(), key=lambda kv: kv[0].lower()):
        if v.unsupported:
            out.append({"name": name, "family": None, "supported": False, "reason": v.unsupported, "formats": []})
            continue
        if v.wrapper:
            out.append(
                {
                    "name": name,
                    "family": None,
                    "supported": True,
                    "description": WRAPPERS[name].summary,
                    "formats": list(WRAPPERS[name].formats),
                    "hf_architectures": list(WRAPPERS[name].hf_classes),
                    "cs_class": WRAPPERS[name].cs_class,
                    "notes": [v.note],
                }
            )
            continue
        fam = fams[v.family]
        vt = fam.variant_table(v.name)
        entry: dict[str, Any] = {
            "name": name,
            "family": fam.name,
            "description": fam.description,
            "supported": True,
            "headless": v.headless,
            "formats": formats_of(fam, v),
            "hf_architectures": _architectures(fam, v),
            "cs_class": (vt or {}).get("cs_class", fam.cs_class),
        }
        if v.alias_of:
            entry["alias_of"] = v.alias_of
        if v.head:
            entry["head"] = v.head
        notes = list((vt or {}).get("notes", fam.notes))
        if v.note:
            notes.append(v.note)
        if notes:
            entry["notes"] = notes
        out.append(entry)
    return out


def _architectures(fam: Family, v: Variant) -> list[str]:
    if "hf" not in formats_of(fam, v):
        return []  # a Cerebras-only model
    vt = fam.variant_table(v.name)
    if vt and (vt.get("hf") or {}).get("architectures"):
        return list(vt["hf"]["architectures"])
    if v.headless:
        return list(fam.hf.get("headless_architectures") or [])
    return list(fam.hf.get("architectures") or [])


def describe_model(name: str) -> dict[str, Any]:
    wrapped = model_index().get(name)
    if wrapped is not None and wrapped.wrapper:
        entry = next(m for m in list_models() if m["name"] == name)
        entry["key_rules"] = list(WRAPPERS[name].key_rules)
        entry["dims"] = {}
        return entry
    fam, v = resolve(name)
    entry = next(m for m in list_models() if m["name"] == v.name)
    rules = fam.rules_for(v)
    entry["key_rules"] = [r.describe() for r in rules.keys]
    entry["dims"] = dict(fam.dims)
    return entry
