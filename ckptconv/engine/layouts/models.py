"""Which planner a model name goes to: its family's key rules, or the code beside a composite or
wrapper table.

- a **family** (``llama``, ``bert``, ...): :func:`~ckptconv.engine.layouts.planner.build_family_plan`
  with its table from ``families/*.yaml``;
- a **wrapper** (``families/dpo.yaml``): one family's model held under prefixes, planned by the
  module beside its table (``families/dpo.py``) around the family's plan;
- a **composite** (``families/dpr.yaml``, ``families/llava.yaml``): several families' models in one
  Cerebras checkpoint and several Hugging Face directories (the table's ``parts``), each part planned
  by its family (:mod:`~ckptconv.engine.layouts.composite`); the module beside the table also
  writes each directory's config files (``hf_config_files``).

Every composite and wrapper table has its module listed in ``PLANNER_MODULES``; the module provides
``MODEL_NAME``, ``build_plan`` and, for a wrapper, ``convert_config`` or, for a composite,
``hf_config_files``. Those modules read their tables when imported, so they are imported when a
composite or wrapper model is first planned (:func:`planners`), not with this module: reading the
tables (every YAML file under ``families/``, parsed and checked) is the costliest part of loading
the layouts, and a process that imports them should pay for it when it first needs a table.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ckptconv.core.errors import NoConversionPath
from ckptconv.engine.layouts.config_plan import ConfigResult, convert_family_config
from ckptconv.engine.layouts.family import COMPOSITE
from ckptconv.engine.layouts.planner import Request, build_family_plan
from ckptconv.engine.layouts.registry import model_table, model_tables
from ckptconv.engine.layouts.rules import TableError
from ckptconv.engine.layouts.tables import ModelTable
from ckptconv.engine.plan import Plan
from ckptconv.formats.base import TensorSource

# Model name -> the module beside its table that plans it.
PLANNER_MODULES = {name: f"ckptconv.engine.layouts.families.{name}" for name in ("dpo", "dpr", "llava")}


@functools.cache
def planners() -> dict[str, ModuleType]:
    """The planner module of every composite and wrapper table, imported on first use."""
    found = {name: importlib.import_module(module) for name, module in PLANNER_MODULES.items()}
    if set(found) != set(model_tables()) or any(name != m.MODEL_NAME for name, m in found.items()):
        raise TableError(f"composite and wrapper tables {sorted(model_tables())} and their planners {sorted(found)}")
    return found


def planner_of(model: str) -> tuple[ModelTable, ModuleType] | None:
    """The table and planner module of a composite or wrapper model; None for a family's model."""
    table = model_table(model)
    return None if table is None else (table, planners()[table.name])


def build_plan(
    source: TensorSource,
    config: Mapping[str, Any] | None,
    req: Request,
    *,
    strict: bool = True,
) -> tuple[Plan, ConfigResult]:
    """Plan the conversion of ``source`` (metadata only) for any model name (see the module docstring)."""
    found = planner_of(req.model)
    builder = found[1].build_plan if found is not None else build_family_plan
    return builder(source, config, req, strict=strict)


def convert_config_dict(doc: Mapping[str, Any], *, model: str, src_fmt: str, tgt_fmt: str) -> ConfigResult:
    """Convert a config document in memory (no checkpoint involved)."""
    found = planner_of(model)
    if found is None:
        return convert_family_config(doc, model=model, src_fmt=src_fmt, tgt_fmt=tgt_fmt)
    table, planner = found
    if table.kind == COMPOSITE:
        parts = " and ".join(f"{c}/config.json" for c in table.components)
        raise NoConversionPath(
            f"a {model} config is {parts} on the Hugging Face side; convert-config takes one file",
            hint="run convert-model --dry-run on the checkpoint: it shows the converted config(s)",
        )
    return planner.convert_config(doc, src_fmt=src_fmt, tgt_fmt=tgt_fmt)
