"""Plan a model-layout conversion: source metadata + config + rules -> :class:`ckptconv.engine.plan.Plan`.

Nothing here reads tensor data. Output shapes and dtypes come from running each step's transform
on ``meta`` tensors built from the source entries, so the plan announces exactly what execution
will produce (the engine checks it).

The path through the release graph (``ckptconv.engine.layouts.upgrades``) decides what happens:

- ``hf -> cs-X``: HF keys through the family's import rules into the canonical (>= 2.1) CS
  vocabulary, then renamed down to X if X is older; output ``{"model": {...}}``;
- ``cs-X -> hf``: CS keys (an inner ``model.`` prefix accepted) renamed up to the canonical
  vocabulary, muP / LoRA folded, then the export rules; optimizer and other state are not
  converted (warning);
- ``cs-X -> cs-Y``: model keys renamed (tied pairs repaired going up to 2.0), every other
  top-level entry copied, a ``__metadata__`` record appended.

One concept at about 600 lines: the four plan builders of one family's conversion (import, export,
CS -> CS, across a Hugging Face style release) and what they share; the config, source metadata
and step pieces live in ``config_plan``, ``source_info`` and ``steps``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptconv.core.errors import (
    ConfigConversionError,
    ConversionError,
    DataloaderStateError,
    NoConversionPath,
    UnmatchedKeys,
)
from ckptconv.core.releases import release_key
from ckptconv.engine.cs_yaml import model_section
from ckptconv.engine.layouts import folding, sparsity, upgrades
from ckptconv.engine.layouts.config_plan import MODEL, ConfigResult, Env, convert_config_doc
from ckptconv.engine.layouts.expr import evaluate
from ckptconv.engine.layouts.registry import Family, Variant, resolve
from ckptconv.engine.layouts.rules import MappedOutput, map_keys
from ckptconv.engine.layouts.source_info import detect_release, metadata_params, subtree
from ckptconv.engine.layouts.steps import Pre, lora_pre, make_step, masked, scaled, sideband_sparsity, zero_nans
from ckptconv.engine.layouts.transforms import TRANSFORMS
from ckptconv.engine.layouts.views import KeyView, plan_on_source
from ckptconv.engine.legacy.dataloader_state import add_dataloader_state, has_dataloader_state, state_from_config
from ckptconv.engine.plan import Plan, Step
from ckptconv.formats.base import Entry, TensorSource
from ckptconv.formats.links import link_root
from ckptconv.formats.tree import DICT, LIST, ODICT, TreeSpec, flat_dict_spec, flatten, wrap_spec

INNER_PREFIX = "model."


@dataclass
class Request:
    model: str
    src_fmt: str
    tgt_fmt: str
    drop_unmatched_keys: bool = False
    fold_lora: bool = False
    fold_mup: bool = True


@dataclass
class PlanContext:
    """What every plan builder of one family's conversion reads (and the warnings it adds to)."""

    fam: Family
    var: Variant
    source: TensorSource
    entries: list[Entry]
    by_key: dict[str, Entry]
    config: dict[str, Any]
    path: list[str]
    req: Request
    warnings: list[str]

    def unpack(
        self,
    ) -> tuple[
        Family, Variant, TensorSource, list[Entry], dict[str, Entry], dict[str, Any], list[str], Request, list[str]
    ]:
        """Every field, in declaration order (the builders read them as locals)."""
        return (
            self.fam,
            self.var,
            self.source,
            self.entries,
            self.by_key,
            self.config,
            self.path,
            self.req,
            self.warnings,
        )


def build_family_plan(
    source: TensorSource,
    config: Mapping[str, Any] | None,
    req: Request,
    *,
    strict: bool = True,
) -> tuple[Plan, ConfigResult]:
    """Plan the conversion of ``source`` (metadata only) by the table of ``req.model``'s family.
    ``strict`` raises on unmatched keys unless ``drop_unmatched_keys``; a dry run passes
    ``strict=False`` to list them instead. Wrapper and composite models plan through
    :func:`ckptconv.engine.layouts.models.build_plan`, which calls this for each family inside."""
    fam, var = resolve(req.model)
    entries = source.entries()
    src_node = upgrades.parse_format(req.src_fmt, side="source")
    detected: str | None = None
    if src_node == "cs-auto":
        src_node, detected = detect_release(source, entries)
    tgt_node = upgrades.parse_format(req.tgt_fmt, side="target")
    if src_node == tgt_node == "hf":
        raise NoConversionPath("source and target are both hf; nothing to convert", hint="use `ckptconv convert`")
    path = upgrades.find_path(fam, src_node, tgt_node)
    if src_node == "hf":
        view = _with_optional_prefix(fam, var, source)
        if view is not None:
            plan, conf = build_family_plan(view, config, req, strict=strict)
            return plan_on_source(plan, view), conf

    if config is None and src_node != "hf":
        config = metadata_params(source, entries)
    if config is None:
        raise ConfigConversionError(
            "a model config is needed to convert this checkpoint",
            hint="pass --config (HF config.json or the Cerebras run YAML)",
        )

    by_key = {e.key: e for e in entries}
    warnings: list[str] = [detected] if detected else []
    hf_style = {f"cs-{r}" for r in fam.hf_style_releases}
    if "hf" in (src_node, tgt_node) and {src_node, tgt_node} & hf_style:
        # The HF-style release is reached from the CS vocabulary (cs-1.7), not from hf directly.
        old = next(iter({src_node, tgt_node} & hf_style))
        route = f"hf -> cs-1.7 -> {old}" if src_node == "hf" else f"{old} -> cs-1.7 -> hf"
        raise NoConversionPath(
            f"{fam.name} {old} keys the model with Hugging Face style names; {req.src_fmt} -> {req.tgt_fmt} "
            "is not planned in one pass",
            hint=f"convert in two steps through cs-1.7 ({route})",
        )
    ctx = PlanContext(fam, var, source, entries, by_key, dict(config), path, req, warnings)
    if src_node != "hf" and tgt_node != "hf" and (src_node in hf_style) != (tgt_node in hf_style):
        plan, conf = _plan_hf_style(ctx, hf_style)
    elif src_node == "hf":
        plan, conf = _plan_import(ctx)
    elif tgt_node == "hf":
        plan, conf = _plan_export(ctx)
    else:
        plan, conf = _plan_cs_to_cs(ctx)
    if src_node != "hf" and tgt_node != "hf":
        plan = _with_dataloader_state(plan, dict(config), src_node, tgt_node)
    plan.warnings = _unique(warnings + conf.warnings + plan.warnings + _initialized_warning(plan))
    plan.config = conf.target
    plan.extras.update(
        {
            "model": req.model,
            "family": fam.name,
            "source_format": src_node,
            "target_format": tgt_node,
            "path": path,
            **({"config_ignored_keys": conf.ignored} if conf.ignored else {}),
        }
    )
    if plan.unmatched and strict and not req.drop_unmatched_keys:
        raise UnmatchedKeys(
            f"{len(plan.unmatched)} checkpoint keys match no {fam.name} rule: "
            + ", ".join(plan.unmatched[:20])
            + (" ..." if len(plan.unmatched) > 20 else ""),
            keys=plan.unmatched,
            hint="check --model and --src-fmt, or pass --drop-unmatched-keys to drop them",
        )
    if plan.unmatched and req.drop_unmatched_keys:
        plan.warnings.append(f"{len(plan.unmatched)} unmatched keys were dropped: " + ", ".join(plan.unmatched[:20]))
    return plan, conf


def _initialized_warning(plan: Plan) -> list[str]:
    """Say which outputs are new layers initialized at random (the source side has no such layer)."""
    fresh = [s.out.key for s in plan.steps if s.transform is not None and s.transform.name == "random_init"]
    if not fresh:
        return []
    return [f"{len(fresh)} tensors have no counterpart in the source and were initialized: {', '.join(fresh)}"]


def _with_optional_prefix(fam: Family, var: Variant, source: TensorSource) -> KeyView | None:
    """A Hugging Face checkpoint saved without the prefix its table is keyed with (transformers 5
    saves a CLIPVisionModel without ``vision_model.``), seen with it; None when it has it."""
    prefix = fam.hf.get("optional_prefix")
    if not prefix or var.headless or any(e.key.startswith(prefix) for e in source.entries()):
        return None
    return KeyView(source, lambda k: prefix + k)


def _unique(items: list[str]) -> list[str]:
    seen: dict[str, None] = {}
    for i in items:
        seen.setdefault(i, None)
    return list(seen)


def _env(fam: Family, conf: ConfigResult) -> Env:
    return Env(conf.canonical, conf.hf, fam.dims)


def _rule_steps(
    outputs: list[MappedOutput],
    direction: str,
    entries: Mapping[str, Entry],
    env: Env,
    pre_of: Callable[[str], Pre],
    out_key: Callable[[str], str],
) -> list[Step]:
    steps = []
    for mo in outputs:
        t = TRANSFORMS[mo.transform]
        fn = t.to_cs if direction == "import" else t.to_hf
        params = {k: v if k in t.literal else evaluate(v, env) for k, v in mo.params.items()}
        pres = [pre_of(k) for k in mo.inputs]
        steps.append(make_step(out_key(mo.key), pres, fn, params, mo.index, mo.transform, t.peak_factor, entries))
    return steps


def locality_order(steps: list[Step]) -> list[Step]:
    """Steps reordered (stably) so that those sharing a source tensor run back to back.

    A step sorts by the first position at which any of its inputs is first read; a derived tensor
    (an LM head synthesized from the embeddings, a regenerated buffer) then follows the step that
    reads its anchor, and the executor frees the anchor right after instead of holding it to the end.
    """
    first: dict[str, int] = {}
    for i, s in enumerate(steps):
        for k in s.inputs:
            first.setdefault(k, i)
    rank = [min((first[k] for k in s.inputs), default=i) for i, s in enumerate(steps)]
    return [steps[i] for i in sorted(range(len(steps)), key=lambda i: (rank[i], i))]


def _plan_import(ctx: PlanContext) -> tuple[Plan, ConfigResult]:
    fam, var, _, entries, by_key, config, path, _, warnings = ctx.unpack()
    conf = convert_config_doc(fam, var, config, path)
    env = _env(fam, conf)
    rules = fam.rules_for(var)
    tensors = [e.key for e in entries if e.kind in ("tensor", "array", "link")]
    others = [e.key for e in entries if e.kind not in ("tensor", "array", "link")]
    mapping = map_keys(rules, "import", tensors, env)
    warnings += mapping.warnings + mapping.incomplete
    canon_node, tgt_node = path[1], path[-1]

    def out_key(cs_key: str) -> str:
        return INNER_PREFIX.rstrip(".") + "." + upgrades.rename_key(cs_key, canon_node, tgt_node)

    def pre_of(k: str) -> Pre:
        return Pre((link_root(k, by_key),))

    steps = locality_order(_rule_steps(mapping.outputs, "import", by_key, env, pre_of, out_key))
    inner = [s.out.key[len(MODEL) + 1 :] for s in steps]
    plan = Plan(steps, wrap_spec(MODEL, flat_dict_spec(inner)))
    plan.unmatched = mapping.unmatched + others
    plan.dropped = mapping.dropped
    return plan, conf


def _split_cs(entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    model = [e for e in entries if e.key.startswith(MODEL + ".")]
    rest = [e for e in entries if not e.key.startswith(MODEL + ".")]
    return model, rest


def _strip_inner(key: str) -> tuple[str, str]:
    """``model.<inner>`` -> (inner without an optional ``model.`` prefix, that prefix)."""
    inner = key[len(MODEL) + 1 :]
    if inner.startswith(INNER_PREFIX):
        return inner[len(INNER_PREFIX) :], INNER_PREFIX
    return inner, ""


def _is_none(e: Entry) -> bool:
    return e.kind == "value" and e.value is None


def _plan_export(ctx: PlanContext) -> tuple[Plan, ConfigResult]:
    fam, var, _, entries, by_key, config, path, req, warnings = ctx.unpack()
    model_entries, rest = _split_cs(entries)
    canon_node = path[-2]
    canon_to_src: dict[str, str] = {}
    absent: list[str] = []
    order: list[str] = []
    for e in model_entries:
        inner, _ = _strip_inner(e.key)
        canon = upgrades.rename_key(inner, path[0], canon_node)
        canon_to_src[canon] = e.key
        order.append(canon)
        if _is_none(e):
            absent.append(canon)
    shapes = {c: tuple(by_key[s].shape or ()) for c, s in canon_to_src.items() if by_key[s].shape is not None}
    sites: list[folding.LoraSite] = []
    if req.fold_lora:
        cs_model = model_section(config)
        sites = folding.lora_sites(order, shapes, cs_model)
    elif any(k.endswith((".lora_A", ".lora_B")) for k in order):
        raise ConversionError(
            "the checkpoint holds LoRA adapters (lora_A / lora_B); Hugging Face weights need them folded",
            hint="pass --fold-lora",
        )
    conf = convert_config_doc(fam, var, config, path, fold_mup=req.fold_mup, lora_sites=sites)
    env = _env(fam, conf)
    lora_consumed = {s.a for s in sites} | {s.b for s in sites}
    lora_by_base = {s.base: s for s in sites}
    # Sparse training (2.2+) keeps each parameter's mask as a buffer ``<p>_mask``: Hugging Face has
    # no such buffer, so the mask is applied (pruned weights written as 0, what the model computed with).
    masks = {k[: -len(sparsity.MASK_SUFFIX)]: k for k in order if k.endswith(sparsity.MASK_SUFFIX)}
    masks = {p: m for p, m in masks.items() if p in canon_to_src}
    keys = [k for k in order if k not in lora_consumed and k not in masks.values()]
    mapping = map_keys(fam.rules_for(var), "export", keys, env, absent=absent)
    warnings += mapping.warnings + mapping.incomplete

    def pre_of(canon: str) -> Pre:
        src = link_root(canon_to_src[canon], by_key)
        site = lora_by_base.get(canon)
        if site is not None:
            a = link_root(canon_to_src[site.a], by_key)
            b = link_root(canon_to_src[site.b], by_key)
            base = lora_pre((src, a, b), site)
        else:
            base = Pre((src,))
        if canon in masks:
            base = masked(base, link_root(canon_to_src[masks[canon]], by_key))
        f = conf.mup.factor(canon) if conf.mup is not None else None
        if f is None:
            return base
        return scaled(base, f[0], f"{f[1]} x{f[0]:.6g}")

    steps = locality_order(_rule_steps(mapping.outputs, "export", by_key, env, pre_of, lambda k: k))
    if sideband_sparsity(config):
        steps = [zero_nans(s) for s in steps]
        warnings.append("sideband sparsity: pruned weights (NaN in the checkpoint) are written as 0")
    # A flat HF state dict needs no spec (and a spec would add a ckptconv record to safetensors).
    plan = Plan(steps, None)
    plan.unmatched = [canon_to_src[k] for k in mapping.unmatched]
    plan.dropped = [canon_to_src.get(k, k) for k in mapping.dropped] + [canon_to_src[k] for k in lora_consumed]
    plan.dropped += [canon_to_src[k] for k in masks.values()]
    if sites:
        warnings.append(f"{len(sites)} LoRA adapters were folded into their base weights")
    if masks:
        warnings.append(f"{len(masks)} sparsity masks were applied to their weights (pruned weights written as 0)")
    state = [e for e in rest if not e.key.startswith("__metadata__")]
    if state:
        tops = sorted({e.key.split(".", 1)[0] for e in state})
        warnings.append(
            f"training state is not converted to Hugging Face ({', '.join(tops)}: {len(state)} entries dropped)"
        )
        plan.dropped += [e.key for e in state]
    return plan, conf


def _plan_cs_to_cs(ctx: PlanContext) -> tuple[Plan, ConfigResult]:
    fam, var, source, entries, by_key, config, path, req, warnings = ctx.unpack()
    model_entries, rest = _split_cs(entries)
    src_node, tgt_node = path[0], path[-1]
    shapes = {}
    inner_keys = []
    for e in model_entries:
        inner, _ = _strip_inner(e.key)
        inner_keys.append(inner)
        if e.shape is not None:
            shapes[inner] = tuple(e.shape)
    sites: list[folding.LoraSite] = []
    if req.fold_lora:
        sites = folding.lora_sites(inner_keys, shapes, model_section(config))
    conf = convert_config_doc(fam, var, config, path, lora_sites=sites)
    lora_consumed = {s.a for s in sites} | {s.b for s in sites}
    lora_by_base = {s.base: s for s in sites}
    inner_to_src = {}
    for e in model_entries:
        inner_to_src[_strip_inner(e.key)[0]] = e.key

    present = {i for i in inner_keys if not _is_none(by_key[inner_to_src[i]])}
    fills: dict[str, str] = {}
    if upgrades.repairs_ties(path):
        tie = conf.canonical.get("share_embedding_weights", True)
        for a, b in upgrades.TIED_PAIRS:
            if a.startswith("lm_head") and not tie:
                continue
            for x, y in ((a, b), (b, a)):
                if x in inner_to_src and x not in present and y in present:
                    fills[x] = y
                    warnings.append(f"{x} is empty in the source; repaired from its tied partner {y}")

    steps: list[Step] = []
    dropped: list[str] = []
    for e in model_entries:
        inner, prefix = _strip_inner(e.key)
        if inner in lora_consumed:
            dropped.append(e.key)
            continue
        new_key = f"{MODEL}.{prefix}{upgrades.rename_key(inner, src_node, tgt_node)}"
        if inner in fills:
            src_key = link_root(inner_to_src[fills[inner]], by_key)
            steps.append(make_step(new_key, [Pre((src_key,))], TRANSFORMS["copy"].to_cs, {}, 0, "copy", 0.0, by_key))
            continue
        if _is_none(e) or e.kind in ("value", "object"):
            steps.append(Step(replace(e, key=new_key), () if e.kind == "value" else (e.key,)))
            continue
        if e.kind == "link":
            target = e.target or ""
            t_inner, t_prefix = _strip_inner(target) if target.startswith(MODEL + ".") else (target, "")
            new_target = f"{MODEL}.{t_prefix}{upgrades.rename_key(t_inner, src_node, tgt_node)}"
            steps.append(Step(replace(e, key=new_key, target=new_target)))
            continue
        site = lora_by_base.get(inner)
        if site is not None:
            pre = lora_pre((e.key, inner_to_src[site.a], inner_to_src[site.b]), site)
            steps.append(make_step(new_key, [pre], TRANSFORMS["copy"].to_cs, {}, 0, "lora_fold", 2.0, by_key))
            continue
        steps.append(Step(replace(e, key=new_key), (e.key,)))
    if sites:
        warnings.append(f"{len(sites)} LoRA adapters were folded into their base weights")
    src_release = upgrades.release_of(src_node)
    mask_move = _sparsity_move(source, by_key, model_entries, lora_consumed, src_node, tgt_node, warnings)
    if mask_move is not None:
        steps += mask_move.mask_steps
        dropped += mask_move.dropped
    consumed = mask_move.consumed if mask_move is not None else frozenset()

    # Everything outside `model` is copied unchanged, then the conversion is recorded.
    last_epoch_fix = upgrades_last_epoch(rest, by_key) if release_key(src_release) < (2, 0) else {}
    for e in rest:
        if e.key in consumed:
            continue
        if e.kind == "link" and e.target in consumed:  # its target moved or went: write the value itself
            steps.append(sparsity.copy_step(e.key, e.target or "", by_key))
        elif e.key in last_epoch_fix:
            steps.append(Step(replace(e, value=last_epoch_fix[e.key]), ()))
        elif e.kind == "value" or e.kind == "link":
            steps.append(Step(e))
        else:
            steps.append(Step(e, (e.key,)))
    if mask_move is not None:
        steps += mask_move.state_steps
    meta_steps, spec = _metadata_append(source, entries, steps, tgt_node, conf.target)
    steps += meta_steps
    if mask_move is not None:
        spec = sparsity.moved_spec(spec, mask_move)
        steps = _in_spec_order(steps, spec)
    plan = Plan(steps, spec)
    plan.dropped = dropped
    return plan, conf


def _sparsity_move(
    source: TensorSource,
    by_key: Mapping[str, Entry],
    model_entries: list[Entry],
    lora_consumed: set[str] | frozenset[str],
    src_node: str,
    tgt_node: str,
    warnings: list[str],
) -> sparsity.MaskMove | None:
    """Plan the move of 2.0/2.1 sparsity masks (``optimizer.sparsity``) into the model for a 2.2+
    target (``ckptconv.engine.layouts.sparsity``); warn when 2.2+ masks go to an older release."""
    src, tgt = upgrades.release_of(src_node), upgrades.release_of(tgt_node)
    if release_key(tgt) < sparsity.MASK_RELEASE:
        if release_key(src) >= sparsity.MASK_RELEASE:
            w = sparsity.downgrade_warning(source.spec, [e.key for e in model_entries], tgt)
            if w:
                warnings.append(w)
        return None
    params: dict[str, str | None] = {}
    for e in model_entries:
        inner, prefix = _strip_inner(e.key)
        out = None if inner in lora_consumed else prefix + upgrades.rename_key(inner, src_node, tgt_node)
        params[e.key[len(MODEL) + 1 :]] = out
    move = sparsity.plan_mask_move(source.spec, by_key, params)
    if move is not None:
        warnings += move.warnings
    return move


def _in_spec_order(steps: list[Step], spec: TreeSpec) -> list[Step]:
    """``steps`` in the order of the spec's leaves (sinks take entries in that order)."""
    position = {k: i for i, k in enumerate(spec.keys())}
    if len(position) != len(steps) or any(s.out.key not in position for s in steps):
        return steps  # a mismatch the sink reports
    return sorted(steps, key=lambda s: position[s.out.key])


def _plan_hf_style(ctx: PlanContext, hf_style: set[str]) -> tuple[Plan, ConfigResult]:
    """CS -> CS across a release whose model keys were Hugging Face style (BERT and T5 in 1.6):
    keys go through the family's own import (or export) rules; the optimizer state, keyed to the
    old parameters, is not carried over (as the Model Zoo does)."""
    fam, var, source, entries, by_key, config, path, _, warnings = ctx.unpack()
    model_entries, rest = _split_cs(entries)
    src_node, tgt_node = path[0], path[-1]
    conf = convert_config_doc(fam, var, config, path)
    env = _env(fam, conf)
    rules = fam.rules_for(var)
    canon_node = f"cs-{upgrades.CANONICAL_RELEASE}"
    to_src: dict[str, str] = {}
    absent: list[str] = []
    for e in model_entries:
        inner, _ = _strip_inner(e.key)
        key = inner if src_node in hf_style else upgrades.rename_key(inner, src_node, canon_node)
        to_src[key] = e.key
        if _is_none(e):
            absent.append(key)
    direction = "import" if src_node in hf_style else "export"
    mapping = map_keys(rules, direction, list(to_src), env, absent=absent)
    warnings += mapping.warnings + mapping.incomplete

    def out_key(k: str) -> str:
        return f"{MODEL}.{upgrades.rename_key(k, canon_node, tgt_node) if direction == 'import' else k}"

    def pre_of(k: str) -> Pre:
        return Pre((link_root(to_src[k], by_key),))

    steps = locality_order(_rule_steps(mapping.outputs, direction, by_key, env, pre_of, out_key))
    dropped_tops = {"optimizer", "lr_scheduler", "schedulers", "grad_scaler", "amp"}
    state = [e for e in rest if e.key.split(".", 1)[0] in dropped_tops]
    if state:
        warnings.append(
            f"optimizer and scheduler state is not carried across release {', '.join(sorted(hf_style))} "
            f"({len(state)} entries dropped)"
        )
    for e in rest:
        if e in state:
            continue
        steps.append(Step(e) if e.kind in ("value", "link") else Step(e, (e.key,)))
    meta_steps, spec = _metadata_append(source, entries, steps, tgt_node, conf.target, drop_tops=dropped_tops)
    plan = Plan(steps + meta_steps, spec)
    plan.unmatched = [to_src[k] for k in mapping.unmatched]
    plan.dropped = [to_src.get(k, k) for k in mapping.dropped] + [e.key for e in state]
    return plan, conf


def _with_dataloader_state(plan: Plan, config: dict[str, Any], src_node: str, tgt_node: str) -> Plan:
    """Fold a 1.9 run's dataloader files into the checkpoint when crossing into 2.0 (as the Model
    Zoo's converter does since 2.1): the old config's ``cerebras.save_iter_state_path`` names them."""
    if not (release_key(upgrades.release_of(src_node)) < (2, 0) <= release_key(upgrades.release_of(tgt_node))):
        return plan
    cerebras = config.get("cerebras")
    path = cerebras.get("save_iter_state_path") if isinstance(cerebras, dict) else None
    if not path:
        return plan
    if has_dataloader_state(plan):
        return replace(plan, warnings=[*plan.warnings, "the checkpoint already has a dataloader state; kept as is"])
    try:
        state = state_from_config(config)
    except DataloaderStateError as e:
        raise DataloaderStateError(
            e.message,
            hint=(e.hint + "; " if e.hint else "")
            + "or remove cerebras.save_iter_state_path from the config to convert without the dataloader state",
        ) from None
    assert state is not None
    plan = add_dataloader_state(plan, state)
    plan.warnings.append(f"the 1.9 dataloader state in {path} was added as the checkpoint's dataloader entry")
    return plan


def upgrades_last_epoch(rest: list[Entry], by_key: Mapping[str, Entry]) -> dict[str, Any]:
    """Releases before 2.0 did not keep the scheduler's last_epoch: it becomes the global step."""
    gs = by_key.get("global_step")
    if gs is None or gs.kind != "value" or not isinstance(gs.value, int):
        return {}
    return {
        e.key: gs.value for e in rest if e.kind == "value" and e.key.endswith("last_epoch") and "lr_scheduler" in e.key
    }


def _metadata_append(
    source: TensorSource,
    entries: list[Entry],
    steps: list[Step],
    tgt_node: str,
    params: Mapping[str, Any],
    *,
    drop_tops: set[str] | frozenset[str] = frozenset(),
) -> tuple[list[Step], TreeSpec]:
    """Steps for a new ``__metadata__`` record and the output spec (the source's, model keys renamed)."""
    record = {"version": f"{upgrades.release_of(tgt_node)}.0", "model_name": "", "params": dict(params)}
    existing = subtree(source, entries, "__metadata__")
    n = len(existing) if isinstance(existing, list) else 0
    leaves, rspec = flatten(record)
    new_steps = [Step(Entry(f"__metadata__.{n}.{k}", "value", value=v)) for k, v in leaves]
    model_inner = [s.out.key[len(MODEL) + 1 :] for s in steps if s.out.key.startswith(MODEL + ".")]
    src_spec = source.spec
    top_labels: list[str] = []
    top_children: list[TreeSpec] = []
    if src_spec is not None and not src_spec.is_leaf and src_spec.type in (DICT, ODICT):
        for label, child in zip(src_spec.child_labels(), src_spec.children, strict=True):
            if str(label) in drop_tops:
                continue
            top_labels.append(label)
            top_children.append(child)
    else:
        seen: list[str] = []
        for s in steps:
            top = s.out.key.split(".", 1)[0]
            if top not in seen:
                seen.append(top)
        top_labels = seen
        top_children = [TreeSpec() for _ in seen]
    if MODEL not in top_labels:
        top_labels.insert(0, MODEL)
        top_children.insert(0, TreeSpec())
    top_children[top_labels.index(MODEL)] = flat_dict_spec(model_inner)
    if "__metadata__" in top_labels:
        i = top_labels.index("__metadata__")
        node = top_children[i]
        top_children[i] = TreeSpec(LIST, None, [*node.children, rspec])
    else:
        top_labels.append("__metadata__")
        top_children.append(TreeSpec(LIST, None, [rspec]))
    return new_steps, TreeSpec(DICT, top_labels, top_children)
