"""A checkpoint seen under other key names, so a family's plan can run on part of a checkpoint.

Wrappers (a DPO policy, a DPR encoder, LLaVA's parts) hold a model's keys under a prefix. :class:`KeyView`
renames them to what the model's own table expects and hides the rest; a plan made over the view
is then turned back to the checkpoint's own keys with :func:`plan_on_source`, so execution reads
the real source and nothing is copied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ckptconv.core.errors import ConfigConversionError, ConversionError, UnmatchedKeys
from ckptconv.core.releases import CURRENT_RELEASE, release_key
from ckptconv.engine.plan import Plan, Step
from ckptconv.formats.base import Entry, TensorSource
from ckptconv.formats.tree import TreeSpec, flat_dict_spec


class KeyView(TensorSource):
    """``inner`` with each key renamed by ``rename`` (None hides the entry; ``hidden`` lists them)."""

    def __init__(self, inner: TensorSource, rename: Callable[[str], str | None]) -> None:
        super().__init__(inner.storage, inner.uri)
        self.inner = inner
        self.format = inner.format
        self.original: dict[str, str] = {}
        self.hidden: list[str] = []
        self._entries: list[Entry] = []
        for e in inner.entries():
            key = rename(e.key)
            if key is None:
                self.hidden.append(e.key)
                continue
            target = e.target
            if e.kind == "link" and e.target:
                target = rename(e.target)
                if target is None:
                    raise self.hidden_link(e)
            self.original[key] = e.key
            self._entries.append(replace(e, key=key, target=target))

    def hidden_link(self, e: Entry) -> Exception:
        """The error for a visible entry aliasing a hidden one (subclasses say it in their terms)."""
        return ConversionError(f"{e.key} links to {e.target}, which is outside the part being converted")

    def entries(self) -> list[Entry]:
        return list(self._entries)

    @property
    def spec(self) -> TreeSpec | None:
        spec = self.inner.spec
        if spec is None or spec.is_leaf:
            return spec
        return replace_model_spec(spec, [k[len("model.") :] for k in self.original if k.startswith("model.")])

    @property
    def info(self) -> dict[str, Any]:
        return self.inner.info

    def read(self, key: str) -> Any:
        return self.inner.read(self.original[key])

    def files(self) -> list[str]:
        return self.inner.files()


def replace_model_spec(spec: TreeSpec, inner_keys: list[str]) -> TreeSpec:
    """``spec`` with its ``model`` child replaced by a flat dict of ``inner_keys`` (how a
    ``state_dict()`` nests), of the type the child had."""
    labels = [str(label) for label in spec.child_labels()]
    children = list(spec.children)
    flat = flat_dict_spec(inner_keys)
    if "model" in labels:
        i = labels.index("model")
        children[i] = TreeSpec(children[i].type, flat.context, flat.children)
    return TreeSpec(spec.type, list(spec.context), children)


def plan_on_source(plan: Plan, view: KeyView, *, drop_hidden: bool = True) -> Plan:
    """A plan made over ``view`` reading the viewed checkpoint's own keys (and naming them in its
    dropped and unmatched lists). The keys the view hides are listed as dropped unless
    ``drop_hidden`` is false (a part of a composite model: they are the other parts' keys)."""
    steps = [replace(s, inputs=tuple(view.original.get(k, k) for k in s.inputs)) for s in plan.steps]
    dropped = [view.original.get(k, k) for k in plan.dropped] + (view.hidden if drop_hidden else [])
    unmatched = [view.original.get(k, k) for k in plan.unmatched]
    return replace(plan, steps=steps, dropped=dropped, unmatched=unmatched)


def rename_outputs(plan: Plan, rename: Callable[[str], str | None]) -> Plan:
    """``plan`` with its output keys (and link targets) renamed; None drops the step."""
    steps = []
    dropped = list(plan.dropped)
    for s in plan.steps:
        key = rename(s.out.key)
        if key is None:
            dropped.append(s.out.key)
            continue
        target = rename(s.out.target) if s.out.kind == "link" and s.out.target else s.out.target
        steps.append(replace(s, out=replace(s.out, key=key, target=target)))
    return replace(plan, steps=steps, dropped=dropped)


# --- models made of parts (DPR's two encoders, LLaVA's tower + language model) ------------------


def part_plan(
    source: TensorSource,
    rename_in: Callable[[str], str | None],
    rename_out: Callable[[str], str | None],
    config: Any,
    req: Any,
    *,
    strict: bool,
) -> tuple[Plan, Any]:
    """Plan one part of a composite model through its family's table.

    ``rename_in`` shows the part's keys as that table expects them (None: not this part's),
    ``rename_out`` names its outputs as the composite model does (None: not kept). The plan reads
    the real source keys; ``dropped`` and ``unmatched`` name source keys of this part only.
    """
    from ckptconv.engine.layouts.planner import build_plan

    view = KeyView(source, rename_in)
    plan, conf = build_plan(view, config, req, strict=strict)
    on_source = plan_on_source(plan, view, drop_hidden=False)
    plan = rename_outputs(on_source, rename_out)
    plan.dropped = on_source.dropped  # source keys only: not the outputs rename_outputs leaves out
    return plan, conf


@dataclass
class PartsPlan:
    """The plans of a composite model's parts, put together into one."""

    steps: list[Step] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def add(self, plan: Plan, label: str, keep_warning: Callable[[str], bool] = lambda w: True) -> None:
        self.steps += plan.steps
        self.warnings += [f"{label}: {w}" for w in plan.warnings if keep_warning(w)]
        self.unmatched += plan.unmatched
        self.dropped += plan.dropped

    def drop_outside_model(self, source: TensorSource) -> None:
        """Towards Hugging Face: every entry outside ``model`` (training state, metadata) is dropped."""
        rest = [e.key for e in source.entries() if not e.key.startswith("model.")]
        state = [k for k in rest if not k.startswith("__metadata__")]
        if state:
            self.warnings.append(f"training state is not converted to Hugging Face ({len(state)} entries dropped)")
        self.dropped += rest

    def plan(self, source: TensorSource, spec: TreeSpec | None, *, model: str, strict: bool, drop: bool) -> Plan:
        """The whole plan; a source key no part reads or drops is unmatched (nothing vanishes)."""
        seen = {k for s in self.steps for k in s.inputs} | set(self.dropped) | set(self.unmatched)
        unmatched = self.unmatched + [e.key for e in source.entries() if e.key not in seen]
        if unmatched and strict and not drop:
            raise UnmatchedKeys(
                f"{len(unmatched)} checkpoint keys belong to no part of {model}: "
                + ", ".join(unmatched[:20])
                + (" ..." if len(unmatched) > 20 else ""),
                keys=unmatched,
                hint="check --model and the checkpoint, or pass --drop-unmatched-keys to drop them",
            )
        warnings = list(self.warnings)
        if unmatched and drop:
            warnings.append(f"{len(unmatched)} unmatched keys were dropped: " + ", ".join(unmatched[:20]))
        plan = Plan(list(self.steps), spec)
        plan.warnings, plan.unmatched, plan.dropped = warnings, unmatched, list(self.dropped)
        return plan


def composite_model_section(config: Any, model: str, sections: list[str]) -> dict[str, Any]:
    """The model section of a composite model's Cerebras config, which must hold ``sections``."""
    from ckptconv.engine.layouts.config import cs_model_section

    if config is None:
        raise ConfigConversionError(f"a {model} checkpoint needs its run config", hint="pass the YAML with --config")
    section = cs_model_section(config)
    missing = [p for p in sections if not isinstance(section.get(p), Mapping)]
    if missing:
        raise ConfigConversionError(
            f"the config's model section has no {', '.join(missing)}: it is not a {model} config",
            hint=f"a {model} config holds " + ", ".join(f"model.{p}" for p in sections),
        )
    return section


def composite_formats(req: Any, source: TensorSource, model: str, first: str, components: list[str]) -> tuple[str, str]:
    """(source, target) nodes of a composite model's conversion, which is hf <-> cs-``first`` ...
    the newest release (``cs-auto`` read from the checkpoint)."""
    from ckptconv.core.errors import NoConversionPath
    from ckptconv.engine.layouts import upgrades
    from ckptconv.engine.layouts.planner import detect_release

    src = upgrades.parse_format(req.src_fmt, side="source")
    tgt = upgrades.parse_format(req.tgt_fmt, side="target")
    if src == "cs-auto":
        src, _ = detect_release(source, source.entries())
    cs = tgt if src == "hf" else src
    if {src, tgt} & {"hf"} != {"hf"} or cs == "hf" or release_key(cs[3:]) < release_key(first):
        raise NoConversionPath(
            f"{model} converts hf <-> cs-{first} ... cs-{CURRENT_RELEASE}, not {req.src_fmt} -> {req.tgt_fmt}",
            hint="name the release (cs-X.Y) on the Cerebras side; the Hugging Face side is a directory holding "
            + " and ".join(f"{c}/" for c in components),
        )
    return src, tgt


def component_configs(source: TensorSource, components: list[str]) -> dict[str, dict[str, Any]]:
    """The ``config.json`` of each component directory of a composite Hugging Face checkpoint."""
    from ckptconv.engine.layouts.api import load_config

    out = {}
    for name in components:
        doc, _ = load_config(source.storage.join(source.uri.rstrip("/"), name, "config.json"))
        assert doc is not None
        out[name] = doc
    return out
