"""Models made of parts (DPR's two encoders, LLaVA's tower + language model): each part planned by
its family's table over a :class:`~ckptconv.engine.layouts.views.KeyView`, and the checks and config
reading every composite model shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.errors import ConfigConversionError, NoConversionPath, UnmatchedKeys
from ckptconv.core.releases import CURRENT_RELEASE, release_key
from ckptconv.engine.cs_yaml import model_section
from ckptconv.engine.layouts import upgrades
from ckptconv.engine.layouts.config_files import load_config
from ckptconv.engine.layouts.planner import build_family_plan
from ckptconv.engine.layouts.source_info import detect_release
from ckptconv.engine.layouts.tables import ModelTable
from ckptconv.engine.layouts.views import KeyView, plan_on_source, rename_outputs
from ckptconv.engine.plan import Plan, Step
from ckptconv.formats.base import TensorSource
from ckptconv.formats.tree import TreeSpec


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
    view = KeyView(source, rename_in)
    plan, conf = build_family_plan(view, config, req, strict=strict)
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
    if config is None:
        raise ConfigConversionError(f"a {model} checkpoint needs its run config", hint="pass the YAML with --config")
    section = model_section(config)
    missing = [p for p in sections if not isinstance(section.get(p), Mapping)]
    if missing:
        raise ConfigConversionError(
            f"the config's model section has no {', '.join(missing)}: it is not a {model} config",
            hint=f"a {model} config holds " + ", ".join(f"model.{p}" for p in sections),
        )
    return section


def composite_formats(req: Any, source: TensorSource, table: ModelTable) -> tuple[str, str]:
    """(source, target) nodes of a composite model's conversion, which is hf <-> its table's first
    release ... the newest release (``cs-auto`` read from the checkpoint)."""
    model, first = table.name, table.first_release
    src = upgrades.parse_format(req.src_fmt, side="source")
    tgt = upgrades.parse_format(req.tgt_fmt, side="target")
    if src == "cs-auto":
        src, _ = detect_release(source, source.entries())
    cs = tgt if src == "hf" else src
    if {src, tgt} & {"hf"} != {"hf"} or cs == "hf" or release_key(cs[3:]) < release_key(first):
        raise NoConversionPath(
            f"{model} converts hf <-> cs-{first} ... cs-{CURRENT_RELEASE}, not {req.src_fmt} -> {req.tgt_fmt}",
            hint="name the release (cs-X.Y) on the Cerebras side; the Hugging Face side is a directory holding "
            + " and ".join(f"{c}/" for c in table.components),
        )
    return src, tgt


def component_configs(source: TensorSource, components: list[str]) -> dict[str, dict[str, Any]]:
    """The ``config.json`` of each component directory of a composite Hugging Face checkpoint."""
    out = {}
    for name in components:
        doc, _ = load_config(source.storage.join(source.uri.rstrip("/"), name, "config.json"))
        assert doc is not None
        out[name] = doc
    return out
