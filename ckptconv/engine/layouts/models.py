"""Which planner a model name goes to: a family's table, a wrapper model, or a composite model.

- a **family** (``llama``, ``bert``, ...): :func:`~ckptconv.engine.layouts.planner.build_family_plan`
  with its table from ``families/*.yaml``;
- a **wrapper** (``dpo``): one family's model held under a prefix, planned by its module
  (:mod:`~ckptconv.engine.layouts.dpo`) around the family's plan;
- a **composite** (``dpr``, ``llava``): several families' models in one Cerebras checkpoint and
  several Hugging Face directories (``COMPONENTS``), each part planned by its family
  (:mod:`~ckptconv.engine.layouts.composite`); its module also writes each directory's config files
  (``hf_config_files``).

Adding a wrapper or a composite model: its module with ``MODEL_NAME`` and a ``build_*_plan``, and one
entry below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from ckptconv.core.errors import NoConversionPath
from ckptconv.engine.layouts import dpo, dpr, llava
from ckptconv.engine.layouts.config_plan import ConfigResult, convert_family_config
from ckptconv.engine.layouts.planner import Request, build_family_plan
from ckptconv.engine.plan import Plan
from ckptconv.formats.base import TensorSource

PlanBuilder = Callable[..., tuple[Plan, ConfigResult]]

WRAPPERS: dict[str, PlanBuilder] = {dpo.MODEL_NAME: dpo.build_dpo_plan}
COMPOSITES: dict[str, ModuleType] = {dpr.MODEL_NAME: dpr, llava.MODEL_NAME: llava}
_COMPOSITE_PLANS: dict[str, PlanBuilder] = {
    dpr.MODEL_NAME: dpr.build_dpr_plan,
    llava.MODEL_NAME: llava.build_llava_plan,
}


def build_plan(
    source: TensorSource,
    config: Mapping[str, Any] | None,
    req: Request,
    *,
    strict: bool = True,
) -> tuple[Plan, ConfigResult]:
    """Plan the conversion of ``source`` (metadata only) for any model name (see the module docstring)."""
    builder = WRAPPERS.get(req.model) or _COMPOSITE_PLANS.get(req.model) or build_family_plan
    return builder(source, config, req, strict=strict)


def convert_config_dict(doc: Mapping[str, Any], *, model: str, src_fmt: str, tgt_fmt: str) -> ConfigResult:
    """Convert a config document in memory (no checkpoint involved)."""
    if model == dpo.MODEL_NAME:
        return dpo.convert_dpo_config(doc, src_fmt=src_fmt, tgt_fmt=tgt_fmt)
    if model in COMPOSITES:
        parts = " and ".join(f"{c}/config.json" for c in COMPOSITES[model].COMPONENTS)
        raise NoConversionPath(
            f"a {model} config is {parts} on the Hugging Face side; convert-config takes one file",
            hint="run convert-model --dry-run on the checkpoint: it shows the converted config(s)",
        )
    return convert_family_config(doc, model=model, src_fmt=src_fmt, tgt_fmt=tgt_fmt)
