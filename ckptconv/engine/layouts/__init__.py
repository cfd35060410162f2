"""Model layouts: converting checkpoints and configs between Hugging Face and Cerebras Model Zoo.

Each model family is a data table (``families/*.yaml``): key patterns with placeholders, tensor
transforms, config field mappings. A conversion is a path through the release graph
(``upgrades``), planned before any data moves (``planner``) and executed by the engine.

Entry points (imported lazily so ``import ckptconv.engine.layouts`` stays cheap and torch-free):

- :func:`plan_model` -- dry run: matched / unmatched keys, converted config, warnings;
- :func:`convert_model` -- convert a checkpoint (and its config) into Model Zoo named outputs;
- :func:`convert_config` -- convert a config file alone;
- :func:`list_models` -- every model name with its family and formats (torch-free).
"""

from __future__ import annotations

from typing import Any

__all__ = ["convert_config", "convert_config_dict", "convert_model", "list_models", "plan_model"]


def __getattr__(name: str) -> Any:
    if name in ("convert_model", "plan_model", "convert_config", "convert_config_dict"):
        from ckptconv.engine.layouts import api

        return getattr(api, name)
    if name == "list_models":
        from ckptconv.engine.layouts.registry import list_models

        return list_models
    raise AttributeError(name)
