"""Cerebras run YAML: reading it, finding its model section, writing it as the Model Zoo does.

A Cerebras config holds its model parameters either under ``trainer.init.model`` (the trainer
layout of releases 2.3 and later) or under a top-level ``model:`` (the legacy layout the
converters write). Model conversion (``ckptconv.engine.layouts``) and the simulator
(``ckptconv.engine.simulator``) both read it through this module, so a config that one accepts the
other accepts too, and a broken one is refused with the same
:class:`~ckptconv.core.errors.ConfigConversionError` and message by both.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml

from ckptconv.core.bounded import load_yaml
from ckptconv.core.errors import ConfigConversionError
from ckptconv.storage import open_storage


def parse_cs_yaml(data: bytes | str, what: str = "the Cerebras config") -> dict[str, Any]:
    """A Cerebras config's content, parsed within bounds; it must be a mapping."""
    doc = load_yaml(data, what=what, error=ConfigConversionError)
    if not isinstance(doc, dict):
        raise ConfigConversionError(
            f"{what} does not hold a mapping of config keys",
            hint="a Cerebras config is a YAML mapping with a `model:` or `trainer:` section",
        )
    return doc


def read_cs_yaml(uri: str) -> dict[str, Any]:
    """Read and parse the Cerebras config at ``uri`` (a local path or an object store URI)."""
    return parse_cs_yaml(open_storage(uri).read_all(uri), uri)


def trainer_init(doc: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``trainer.init`` of a 2.3+ config; None for the legacy layout (no ``trainer:``)."""
    if "trainer" not in doc:
        return None
    trainer = doc["trainer"]
    if isinstance(trainer, list):
        raise ConfigConversionError(
            "the config has a list of trainers; use one trainer's config at a time",
            hint="split the YAML so it has a single `trainer:` mapping",
        )
    if not isinstance(trainer, Mapping):
        raise ConfigConversionError("the config's `trainer:` is not a mapping")
    init = trainer.get("init")
    if init is None:
        return {}
    if not isinstance(init, Mapping):
        raise ConfigConversionError("the config's `trainer.init` is not a mapping")
    return init


def model_section(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the model section: ``trainer.init.model`` (2.3+ layout) or ``model`` (legacy)."""
    init = trainer_init(doc)
    if init is not None:
        model = init.get("model")
        if not isinstance(model, Mapping):
            raise ConfigConversionError("the config's trainer has no init.model section")
        return dict(model)
    model = doc.get("model")
    if not isinstance(model, Mapping):
        raise ConfigConversionError(
            "the Cerebras config has no `model:` (or `trainer.init.model:`) section",
            hint="pass the run YAML of the model (params.yaml / the trainer config)",
        )
    return dict(model)


def replace_model_section(doc: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``doc`` whose model section is ``model`` (in the layout ``doc`` uses)."""
    out = copy.deepcopy(dict(doc))
    if "trainer" in out and isinstance(out["trainer"], Mapping):
        out["trainer"].setdefault("init", {})["model"] = dict(model)
    else:
        out["model"] = dict(model)
    return out


def editable_model_section(doc: dict[str, Any]) -> dict[str, Any]:
    """The model section of ``doc`` itself (created when absent), for edits made in place."""
    if "trainer" in doc and isinstance(doc["trainer"], Mapping):
        return doc["trainer"].setdefault("init", {}).setdefault("model", {})
    return doc.setdefault("model", {})


def sort_nested(d: Any) -> Any:
    """``d`` with the keys of every mapping in it sorted."""
    if isinstance(d, Mapping):
        return {k: sort_nested(d[k]) for k in sorted(d, key=str)}
    if isinstance(d, list):
        return [sort_nested(v) for v in d]
    return d


def dump_cs_yaml(doc: Mapping[str, Any]) -> bytes:
    """YAML as the Model Zoo writes it: keys sorted at every level, indent 4."""
    return yaml.safe_dump(sort_nested(dict(doc)), indent=4, sort_keys=True, default_flow_style=False).encode()
