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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ckptconv.core.dtypes import is_float_dtype
from ckptconv.core.errors import (
    ConfigConversionError,
    ConversionError,
    DataloaderStateError,
    InvalidRequest,
    NoConversionPath,
    UnmatchedKeys,
)
from ckptconv.core.releases import CURRENT_RELEASE, known_release, newer_than_known, release_key
from ckptconv.engine.layouts import folding, sparsity, upgrades
from ckptconv.engine.layouts.config import export_config, import_config
from ckptconv.engine.layouts.config_files import cs_model_section, replace_model_section
from ckptconv.engine.layouts.dictpath import fill_defaults, flat_env, get_path
from ckptconv.engine.layouts.expr import evaluate
from ckptconv.engine.layouts.registry import Family, Variant, resolve
from ckptconv.engine.layouts.rules import MappedOutput, map_keys
from ckptconv.engine.layouts.transforms import TRANSFORMS, lora_fold
from ckptconv.engine.layouts.views import KeyView, plan_on_source
from ckptconv.engine.plan import IDENTITY, Plan, Step, Transform
from ckptconv.formats.base import Entry, TensorSource
from ckptconv.formats.tree import DICT, LIST, ODICT, TreeSpec, flat_dict_spec, flatten, unflatten, wrap_spec

MODEL = "model"
INNER_PREFIX = "model."


# --- environment for table expressions ---------------------------------------------------------


class Env(Mapping[str, Any]):
    """CS config keys (nested joined with ``__``), HF config keys as ``hf_<key>``, and the family's
    dims, evaluated lazily so a dim nobody uses never needs its config keys."""

    def __init__(self, cs_model: Mapping[str, Any], hf: Mapping[str, Any], dims: Mapping[str, Any]) -> None:
        self.base: dict[str, Any] = flat_env(cs_model)
        self.base.update({f"hf_{k}": v for k, v in flat_env(hf).items()})
        self.dims = dict(dims)
        self.cache: dict[str, Any] = {}
        self.busy: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        if name in self.dims:
            if name not in self.cache:
                if name in self.busy:
                    raise ConfigConversionError(f"dim {name!r} is defined in terms of itself")
                self.busy.add(name)
                try:
                    # A dim may shadow a config key of the same name (e.g. rotary_dim): evaluate in base.
                    self.cache[name] = evaluate(self.dims[name], _Shadow(self, name))
                finally:
                    self.busy.discard(name)
            return self.cache[name]
        return self.base[name]

    def __contains__(self, name: object) -> bool:
        return name in self.dims or name in self.base

    def __iter__(self) -> Iterator[str]:
        yield from self.dims
        yield from self.base

    def __len__(self) -> int:
        return len(self.dims) + len(self.base)


class _Shadow(Mapping[str, Any]):
    def __init__(self, env: Env, hide: str) -> None:
        self.env, self.hide = env, hide

    def __getitem__(self, name: str) -> Any:
        if name == self.hide:
            return self.env.base[name]
        return self.env[name]

    def __contains__(self, name: object) -> bool:
        return name in self.env.base if name == self.hide else name in self.env

    def __iter__(self) -> Iterator[str]:
        return iter(self.env)

    def __len__(self) -> int:
        return len(self.env)


# --- the config side ----------------------------------------------------------------------------


@dataclass
class ConfigResult:
    target: dict[str, Any]  # the converted document (HF config dict, or CS run YAML)
    canonical: dict[str, Any]  # the CS model section in the >= 2.1 vocabulary (drives the rules)
    hf: dict[str, Any]  # the HF config (source or target side)
    warnings: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    mup: folding.MupFold | None = None


def convert_config_doc(
    fam: Family,
    var: Variant,
    doc: Mapping[str, Any],
    path: list[str],
    *,
    fold_mup: bool = True,
    lora_sites: list[folding.LoraSite] | None = None,
) -> ConfigResult:
    table = fam.config_for(var)
    variant = {"head": var.head, "headless": var.headless}
    warnings: list[str] = []
    if path[0] == "hf":
        first = path[1]
        cs_model, w, ignored, top = import_config(
            table, doc, release=upgrades.release_of(first), registry_name=fam.cs_name, variant=variant
        )
        warnings += w
        out = upgrades.config_along({MODEL: cs_model, **top}, path[1:], fam, warnings)
        return ConfigResult(out, fill_defaults(cs_model, table.cs_defaults), dict(doc), warnings, ignored)
    if path[-1] == "hf":
        cs_nodes = path[:-1]
        at = upgrades.config_along(dict(doc), cs_nodes, fam, warnings)
        model = cs_model_section(at)
        release = upgrades.release_of(cs_nodes[-1])
        mup = None
        if table.params.get("mup") != "native" and folding.is_mup(model, release):
            if not fold_mup:
                raise ConfigConversionError(
                    "this is a muP model; Hugging Face has no muP, so its weights must be folded",
                    hint="leave muP folding on",
                )
            if not table.params.get("mup", False):
                raise ConfigConversionError(
                    f"muP folding is not supported for {fam.name}",
                    hint="the Model Zoo supports muP export for llama, mistral, gpt2, gptj, bloom, starcoder, "
                    "santacoder, bert and t5",
                )
            mup = folding.mup_fold(model, release, fam.name)
            model = mup.config
            warnings.append("muP parameters were folded into the weights (muP -> sP); embeddings are untied")
        if lora_sites:
            model = folding.lora_config(model, lora_sites)
        hf, w = export_config(
            table,
            model,
            release=release,
            registry_name=fam.cs_name,
            variant=variant,
            top={k: v for k, v in at.items() if k != MODEL},
        )
        warnings += w
        return ConfigResult(hf, fill_defaults(model, table.cs_defaults), hf, warnings, [], mup)
    out = upgrades.config_along(dict(doc), path, fam, warnings)
    model = cs_model_section(out)
    if lora_sites:
        model = folding.lora_config(model, lora_sites)
        out = replace_model_section(out, model)
    return ConfigResult(out, fill_defaults(model, table.cs_defaults), {}, warnings, [])


# --- reading CS metadata from a source ------------------------------------------------------------


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


@dataclass(frozen=True)
class Pre:
    """How one rule input is obtained from source keys (a plain read, a muP scale, a LoRA fold)."""

    keys: tuple[str, ...]
    fn: Callable[[list[Any]], Any] | None = None
    label: str = ""


def _meta(e: Entry) -> Any:
    import torch

    from ckptconv.formats.base import torch_dtype

    if e.kind not in ("tensor", "array") or e.shape is None or e.dtype is None:
        raise ConversionError(f"{e.key} is a {e.kind}, not a tensor; a layout rule cannot transform it")
    return torch.empty(tuple(e.shape), dtype=torch_dtype(e.dtype), device="meta")


def _make_step(
    out_key: str,
    pres: list[Pre],
    rule_fn: Callable[[list[Any], dict[str, Any], int], Any],
    params: dict[str, Any],
    index: int,
    name: str,
    peak: float,
    entries: Mapping[str, Entry],
) -> Step:
    flat: list[str] = []
    slots: list[list[int]] = []
    for p in pres:
        idx = []
        for k in p.keys:
            if k not in flat:
                flat.append(k)
            idx.append(flat.index(k))
        slots.append(idx)
    fns = [p.fn for p in pres]

    def fn(values: list[Any]) -> Any:
        args = []
        for slot, pre in zip(slots, fns, strict=True):
            vs = [values[i] for i in slot]
            args.append(pre(vs) if pre is not None else vs[0])
        return rule_fn(args, params, index)

    try:
        probe = fn([_meta(entries[k]) for k in flat])
    except ConversionError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        raise ConversionError(
            f"cannot build {out_key} from {', '.join(flat)} with {name}: {e}",
            hint="check that --model and the config match the checkpoint (head counts, sizes)",
        ) from e
    dtype = str(probe.dtype).removeprefix("torch.")
    shown = {k: v for k, v in params.items() if not isinstance(v, dict | list) or k in ("parts",)}
    if isinstance(params.get("outputs"), list):  # a fused tensor: say which part this output is
        shown["part"] = params["outputs"][index]
        if params.get("rope"):
            shown["rope"] = ",".join(params["rope"])
    elif index:
        shown["index"] = index
    labels = [p.label for p in pres if p.label]
    if labels:
        shown["pre"] = "; ".join(labels)
    t = Transform(name, fn, shown, peak_factor=peak)
    return Step(Entry(out_key, "tensor", dtype, tuple(probe.shape)), tuple(flat), t)


def _scale_fn(factor: float) -> Callable[[list[Any]], Any]:
    def fn(vs: list[Any]) -> Any:
        return TRANSFORMS["scale"].to_hf(vs, {"factor": factor}, 0)

    return fn


def _lora_fn(site: folding.LoraSite) -> Callable[[list[Any]], Any]:
    def fn(vs: list[Any]) -> Any:
        return lora_fold(vs[0], vs[1], vs[2], site.scale, fan_in_fan_out=site.fan_in_fan_out, embedding=site.embedding)

    return fn


# --- the plan --------------------------------------------------------------------------------


@dataclass
class Request:
    model: str
    src_fmt: str
    tgt_fmt: str
    drop_unmatched_keys: bool = False
    fold_lora: bool = False
    fold_mup: bool = True


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
    if src_node != "hf" and tgt_node != "hf" and (src_node in hf_style) != (tgt_node in hf_style):
        plan, conf = _plan_hf_style(fam, var, source, entries, by_key, dict(config), path, warnings, hf_style)
    elif src_node == "hf":
        plan, conf = _plan_import(fam, var, entries, by_key, dict(config), path, req, warnings)
    elif tgt_node == "hf":
        plan, conf = _plan_export(fam, var, entries, by_key, dict(config), path, req, warnings)
    else:
        plan, conf = _plan_cs_to_cs(fam, var, source, entries, by_key, dict(config), path, req, warnings)
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
        steps.append(_make_step(out_key(mo.key), pres, fn, params, mo.index, mo.transform, t.peak_factor, entries))
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


def _resolve_links(by_key: Mapping[str, Entry], key: str) -> str:
    seen = 0
    while key in by_key and by_key[key].kind == "link" and seen < 64:
        key = by_key[key].target or key
        seen += 1
    return key


def _plan_import(fam, var, entries, by_key, config, path, req, warnings) -> tuple[Plan, ConfigResult]:
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
        return Pre((_resolve_links(by_key, k),))

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


def _plan_export(fam, var, entries, by_key, config, path, req, warnings) -> tuple[Plan, ConfigResult]:
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
        cs_model = cs_model_section(config)
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
        src = _resolve_links(by_key, canon_to_src[canon])
        site = lora_by_base.get(canon)
        if site is not None:
            a = _resolve_links(by_key, canon_to_src[site.a])
            b = _resolve_links(by_key, canon_to_src[site.b])
            base = Pre((src, a, b), _lora_fn(site), f"LoRA fold x{site.scale:g}")
        else:
            base = Pre((src,))
        if canon in masks:
            base = _masked(base, _resolve_links(by_key, canon_to_src[masks[canon]]))
        f = conf.mup.factor(canon) if conf.mup is not None else None
        if f is None:
            return base
        scale = _scale_fn(f[0])
        if base.fn is None:
            return Pre(base.keys, scale, f"{f[1]} x{f[0]:.6g}")
        inner = base.fn
        return Pre(base.keys, lambda vs: scale([inner(vs)]), f"{base.label}; {f[1]} x{f[0]:.6g}")

    steps = locality_order(_rule_steps(mapping.outputs, "export", by_key, env, pre_of, lambda k: k))
    if sideband_sparsity(config):
        steps = [_zero_nans(s) for s in steps]
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


def _masked(pre: Pre, mask_key: str) -> Pre:
    """``pre`` with a sparsity mask applied to its value (0 where the mask is false)."""
    keys = (*pre.keys, mask_key)
    inner = pre.fn

    def fn(vs: list[Any]) -> Any:
        w = inner(vs[:-1]) if inner is not None else vs[0]
        return w.masked_fill(~vs[-1].bool(), 0)

    return Pre(keys, fn, f"{pre.label}; sparsity mask" if pre.label else "sparsity mask")


def sideband_sparsity(config: Mapping[str, Any]) -> bool:
    """Whether a CS run config trained with sideband sparsity, which marks pruned weights as NaN."""
    sections = [config.get("sparsity"), get_path(config, "trainer.init.sparsity", None)]
    return any(isinstance(sp, Mapping) and "sideband" in (sp.get("type"), sp.get("algorithm")) for sp in sections)


def _zero_nans(step: Step) -> Step:
    """``step`` writing 0 where its floating-point output is NaN."""
    if step.out.kind not in ("tensor", "array") or not step.inputs or not is_float_dtype(step.out.dtype):
        return step
    t = step.transform or IDENTITY

    def fn(values: list[Any]) -> Any:
        out = t(values)
        if out.element_size() == 1:  # float8: torch has no masked_fill for it; float32 holds it exactly
            wide = out.float()
            return wide.masked_fill(wide.isnan(), 0).to(out.dtype)
        return out.masked_fill(out.isnan(), 0)  # a new tensor: the input may be read again

    return replace(step, transform=Transform(f"{t.name}; NaN->0", fn, dict(t.params), t.peak_factor + 1.0))


def _plan_cs_to_cs(fam, var, source, entries, by_key, config, path, req, warnings) -> tuple[Plan, ConfigResult]:
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
        sites = folding.lora_sites(inner_keys, shapes, cs_model_section(config))
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
            src_key = _resolve_links(by_key, inner_to_src[fills[inner]])
            steps.append(_make_step(new_key, [Pre((src_key,))], TRANSFORMS["copy"].to_cs, {}, 0, "copy", 0.0, by_key))
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
            pre = Pre((e.key, inner_to_src[site.a], inner_to_src[site.b]), _lora_fn(site), f"LoRA fold x{site.scale:g}")
            steps.append(_make_step(new_key, [pre], TRANSFORMS["copy"].to_cs, {}, 0, "lora_fold", 2.0, by_key))
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


def _plan_hf_style(fam, var, source, entries, by_key, config, path, warnings, hf_style) -> tuple[Plan, ConfigResult]:
    """CS -> CS across a release whose model keys were Hugging Face style (BERT and T5 in 1.6):
    keys go through the family's own import (or export) rules; the optimizer state, keyed to the
    old parameters, is not carried over (as the Model Zoo does)."""
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
        return Pre((_resolve_links(by_key, to_src[k]),))

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
    from ckptconv.engine.legacy.dataloader_state import add_dataloader_state, has_dataloader_state, state_from_config

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


def convert_family_config(doc: Mapping[str, Any], *, model: str, src_fmt: str, tgt_fmt: str) -> ConfigResult:
    """Convert the config document of a family's model in memory (no checkpoint involved)."""
    fam, var = resolve(model)
    src = upgrades.parse_format(src_fmt, side="source")
    if src == "cs-auto":
        raise InvalidRequest("cs-auto needs a checkpoint to read the release from; name the release (cs-X.Y)")
    tgt = upgrades.parse_format(tgt_fmt, side="target")
    path = upgrades.find_path(fam, src, tgt)
    if len(path) == 1:
        return ConfigResult(dict(doc), {}, {}, [], [])
    return convert_config_doc(fam, var, doc, path)
