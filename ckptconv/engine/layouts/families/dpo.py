"""DPO checkpoints: a language model wrapped as the policy and a frozen reference copy.

A Model Zoo DPO run (``model.model_name`` names the language model, ``model.dpo`` holds
``beta`` and ``reference_free``) keeps the language model's Cerebras keys twice:
``model.policy_model.model.<key>`` and ``model.ref_model.model.<key>``, the reference starting as
the same tensors as the policy. The formats are ``cs-X.Y-dpo`` (2.1 ... 2.9) and, for a plain
Cerebras checkpoint of the same model, ``cs-2.1-no-dpo``. Conversions:

- ``hf`` -> ``cs-X.Y-dpo``: the language model's own conversion (its family from the Hugging Face
  config's ``model_type``), its keys moved under ``policy_model.model.``, and the reference keys
  written as links to the policy's tensors (each stored once, as ``cstorch.save`` stores one
  tensor held under two keys);
- ``cs-X.Y-dpo`` -> ``hf``: the policy converted with the family named by ``model.model_name``;
  the reference model is dropped;
- ``cs-2.1-no-dpo`` <-> ``cs-2.1-dpo``: keys moved in or out of the wrapper, nothing converted.

Configs gain ``model_name`` and ``dpo: {beta: 0.1, reference_free: false}`` on the way in and
lose them on the way out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckptconv.core.errors import ConfigConversionError, NoConversionPath
from ckptconv.core.releases import release_key
from ckptconv.engine.cs_yaml import model_section, replace_model_section
from ckptconv.engine.layouts import upgrades
from ckptconv.engine.layouts.config_plan import ConfigResult, convert_family_config
from ckptconv.engine.layouts.planner import Request, build_family_plan
from ckptconv.engine.layouts.registry import model_tables, resolve
from ckptconv.engine.layouts.source_info import metadata_params
from ckptconv.engine.layouts.upgrades import split_format
from ckptconv.engine.layouts.views import KeyView, plan_on_source, rename_outputs, replace_model_spec
from ckptconv.engine.plan import Plan, Step, identity_plan
from ckptconv.formats.base import Entry, TensorSource
from ckptconv.formats.tree import flat_dict_spec

MODEL_NAME = "dpo"
# What this module reads from its table (dpo.yaml beside it).
TABLE = model_tables()[MODEL_NAME]
POLICY = str(TABLE.raw["prefixes"]["policy"])
REFERENCE = str(TABLE.raw["prefixes"]["reference"])
DPO_DEFAULTS = dict(TABLE.raw["config_add"]["dpo"])
# Language models the Model Zoo trains with DPO that have a family here.
BASE_MODELS = tuple(TABLE.raw["wraps"])
HF_MODEL_TYPES = dict(TABLE.raw["hf_model_types"])
NO_DPO_RELEASE = str(TABLE.raw["plain_release"])
FIRST_RELEASE = TABLE.first_release

# --- configs ----------------------------------------------------------------------------------


def base_model_of_hf(config: Mapping[str, Any] | None) -> str:
    model_type = (config or {}).get("model_type")
    if not model_type:
        raise ConfigConversionError(
            "a Hugging Face config without model_type cannot become a DPO checkpoint",
            hint="pass the model's config.json with --config",
        )
    name = HF_MODEL_TYPES.get(str(model_type), str(model_type))
    if name not in BASE_MODELS:
        raise ConfigConversionError(
            f"DPO does not train model_type {model_type!r}", hint=f"supported: {', '.join(BASE_MODELS)}"
        )
    return name


def base_model_of_cs(config: Mapping[str, Any] | None, *, need_dpo: bool) -> str:
    if config is None:
        raise ConfigConversionError("a DPO checkpoint needs its run config", hint="pass the YAML with --config")
    model = model_section(config)
    name = model.get("model_name")
    if not name:
        raise ConfigConversionError(
            "the config has no model.model_name: the language model trained with DPO is unknown",
            hint=f"add model_name (one of {', '.join(BASE_MODELS)}) under the model parameters",
        )
    if name not in BASE_MODELS:
        raise ConfigConversionError(f"DPO does not train {name!r}", hint=f"supported: {', '.join(BASE_MODELS)}")
    if need_dpo and "dpo" not in model:
        raise ConfigConversionError(
            "the config is not a DPO config: it has no model.dpo section", hint="check --src-fmt and --config"
        )
    return str(name)


def add_dpo_config(doc: Mapping[str, Any], base: str) -> dict[str, Any]:
    """``doc`` (a CS run config) with ``model_name`` and the ``dpo`` defaults added."""
    model = model_section(doc)
    if model.get("model_name", base) != base:
        raise ConfigConversionError(f"model.model_name is {model['model_name']!r}, but the model is {base!r}")
    return replace_model_section(doc, {"model_name": base, **model, "dpo": model.get("dpo", dict(DPO_DEFAULTS))})


def strip_dpo_config(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` without the DPO fields, as the language model's own conversion expects it."""
    model = {k: v for k, v in model_section(doc).items() if k not in ("model_name", "dpo")}
    return replace_model_section(doc, model)


def convert_config(doc: Mapping[str, Any], *, src_fmt: str, tgt_fmt: str) -> ConfigResult:
    """A DPO run config from / to the wrapped model's config (no checkpoint involved)."""
    src, src_wrap = split_format(src_fmt)
    tgt, tgt_wrap = split_format(tgt_fmt)
    if src == "hf" and tgt_wrap == "dpo":
        base = base_model_of_hf(doc)
        conf = convert_family_config(doc, model=base, src_fmt=src, tgt_fmt=tgt)
        return replace(conf, target=add_dpo_config(conf.target, base))
    if src_wrap == "dpo" and tgt == "hf":
        base = base_model_of_cs(doc, need_dpo=True)
        return convert_family_config(strip_dpo_config(doc), model=base, src_fmt=src, tgt_fmt=tgt)
    if src_wrap == "no-dpo" and tgt_wrap == "dpo":
        return ConfigResult(add_dpo_config(doc, base_model_of_cs(doc, need_dpo=False)), {}, {}, [], [])
    if src_wrap == "dpo" and tgt_wrap == "no-dpo":
        base = base_model_of_cs(doc, need_dpo=True)
        return ConfigResult(_no_dpo_config(doc, base), {}, {}, [], [])
    raise _no_path(src_fmt, tgt_fmt)


def _no_dpo_config(doc: Mapping[str, Any], base: str) -> dict[str, Any]:
    """A cs-2.1-no-dpo config keeps model_name (the way back to DPO needs it) and drops dpo."""
    stripped = strip_dpo_config(doc)
    return replace_model_section(stripped, {"model_name": base, **model_section(stripped)})


def _no_path(src_fmt: str, tgt_fmt: str) -> NoConversionPath:
    return NoConversionPath(
        f"dpo converts hf <-> cs-X.Y-dpo (2.1 ... 2.9) and cs-2.1-no-dpo <-> cs-2.1-dpo, not {src_fmt} -> {tgt_fmt}",
        hint="for other releases convert the language model with its own name (model.model_name)",
    )


# --- checkpoints ------------------------------------------------------------------------------


class PolicyView(KeyView):
    """A DPO checkpoint seen as its policy model: ``model.policy_model.model.<k>`` reads as
    ``model.<k>`` and the reference model is hidden (``hidden`` lists its keys)."""

    def __init__(self, inner: TensorSource) -> None:
        super().__init__(inner, _unwrap)
        if not any(k.startswith("model." + POLICY) for k in self.original.values()):
            raise ConfigConversionError(
                f"{inner.uri} holds no model.{POLICY}* keys: it is not a DPO checkpoint",
                hint="check --src-fmt (cs-X.Y-dpo names DPO checkpoints)",
            )

    def hidden_link(self, e: Entry) -> Exception:
        return ConfigConversionError(f"{e.key} links into the reference model; the policy is incomplete")


def _unwrap(key: str) -> str | None:
    """``model.policy_model.model.<k>`` -> ``model.<k>``; reference keys -> None; others unchanged."""
    if key.startswith("model." + POLICY):
        return "model." + key[len("model." + POLICY) :]
    if key.startswith("model." + REFERENCE):
        return None
    return key


def wrap_plan(plan: Plan) -> Plan:
    """``plan``'s model keys moved under ``policy_model.model.``, plus the reference keys as links."""
    moved = rename_outputs(plan, _wrap)
    by_key = {s.out.key: s for s in moved.steps}
    policy_prefix = "model." + POLICY
    model_keys = [s.out.key[len(policy_prefix) :] for s in moved.steps if s.out.key.startswith(policy_prefix)]
    for inner in model_keys:
        policy = by_key[policy_prefix + inner]
        # A reference key aliases what the policy key stores (a tied tensor's first holder).
        target = policy.out.target if policy.out.kind == "link" else policy.out.key
        ref = "model." + REFERENCE + inner
        by_key[ref] = Step(Entry(ref, "link", target=target))
    inner_keys = [POLICY + k for k in model_keys] + [REFERENCE + k for k in model_keys]
    spec = plan.spec if plan.spec is not None else flat_dict_spec([s.out.key for s in plan.steps])
    spec = replace_model_spec(spec, inner_keys)
    order = spec.keys()  # sinks take entries in the spec's order
    return replace(moved, steps=[by_key[k] for k in order], spec=spec)


def _wrap(key: str) -> str:
    """``model.<k>`` -> ``model.policy_model.model.<k>``; keys outside ``model`` stay."""
    return "model." + POLICY + key[len("model.") :] if key.startswith("model.") else key


# --- planning -------------------------------------------------------------------------------


def build_plan(
    source: TensorSource, config: Mapping[str, Any] | None, req: Request, *, strict: bool
) -> tuple[Plan, ConfigResult]:
    """Plan a conversion into, out of, or between DPO layouts (see the module docstring)."""
    src_fmt, src_wrap = split_format(req.src_fmt)
    tgt_fmt, tgt_wrap = split_format(req.tgt_fmt)
    src = upgrades.parse_format(src_fmt, side="source")
    tgt = upgrades.parse_format(tgt_fmt, side="target")
    no_dpo = f"cs-{NO_DPO_RELEASE}"
    if src != "hf" and config is None:
        config = metadata_params(source, source.entries())

    if src == "hf" and tgt != "hf" and tgt_wrap == "dpo" and release_key(tgt[3:]) >= release_key(FIRST_RELEASE):
        base = base_model_of_hf(config)
        plan, conf = build_family_plan(source, config, replace(req, model=base, tgt_fmt=tgt), strict=strict)
        conf = replace(conf, target=add_dpo_config(conf.target, base))
        plan = wrap_plan(plan)
    elif src_wrap == "dpo" and tgt == "hf" and not tgt_wrap:
        base = base_model_of_cs(config, need_dpo=True)
        view = PolicyView(source)
        base_req = replace(req, model=base, src_fmt=src)
        plan, conf = build_family_plan(view, strip_dpo_config(config or {}), base_req, strict=strict)
        plan = plan_on_source(plan, view)
        plan.warnings.append(f"the reference model ({len(view.hidden)} keys) is not part of a Hugging Face model")
    elif {(src, src_wrap), (tgt, tgt_wrap)} == {(no_dpo, "no-dpo"), (no_dpo, "dpo")}:
        base = base_model_of_cs(config, need_dpo=src_wrap == "dpo")
        if src_wrap == "dpo":
            view = PolicyView(source)
            plan = plan_on_source(identity_plan(view.entries(), view.spec), view)
            target_doc = _no_dpo_config(config or {}, base)
        else:
            plan = wrap_plan(identity_plan(source.entries(), source.spec))
            target_doc = add_dpo_config(config or {}, base)
        conf = ConfigResult(target_doc, {}, {}, [], [])
    else:
        raise _no_path(req.src_fmt, req.tgt_fmt)
    plan.config = conf.target
    plan.extras.update(
        {
            "model": MODEL_NAME,
            "base_model": base,
            "family": resolve(base)[0].name,
            "source_format": src,
            "target_format": tgt,
            "target_label": f"{tgt}-{tgt_wrap}" if tgt_wrap else tgt,
        }
    )
    plan.extras.setdefault("path", [src, tgt])
    return plan, conf
