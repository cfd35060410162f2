"""Config files of model conversions: reading a Hugging Face ``config.json`` or a Cerebras run YAML
from any storage, and finding the ``config.json`` beside a Hugging Face checkpoint."""

from __future__ import annotations

import copy
import json
import posixpath
from collections.abc import Mapping
from typing import Any

from ckptconv.core.bounded import load_json, load_yaml
from ckptconv.core.errors import ConfigConversionError, ObjectNotFound
from ckptconv.engine.layouts.dictpath import get_path
from ckptconv.storage import open_storage


def _read(uri: str) -> bytes:
    storage = open_storage(uri)
    return storage.read_all(uri)


def parse_config_bytes(data: bytes, name: str) -> dict[str, Any]:
    """A config file's content: JSON (``config.json``) or YAML (Cerebras run files)."""
    load = load_json if name.endswith(".json") else load_yaml
    doc = load(data, what=name, error=ConfigConversionError)
    if not isinstance(doc, dict):
        raise ConfigConversionError(f"{name} does not hold a mapping of config keys")
    return doc


def load_config(config: str | Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    """(document, uri) from a URI/path or a dict."""
    if config is None:
        return None, None
    if isinstance(config, Mapping):
        return dict(config), None
    try:
        return parse_config_bytes(_read(config), config), config
    except ObjectNotFound:
        raise ConfigConversionError(f"config file {config} does not exist", hint="check the --config path") from None


def find_hf_config(src_uri: str) -> str | None:
    storage = open_storage(src_uri)
    candidates = []
    if not storage.exists(src_uri):
        candidates.append(storage.join(src_uri.rstrip("/"), "config.json"))
    else:
        parent = posixpath.dirname(src_uri.rstrip("/"))
        if parent:
            candidates.append(storage.join(parent, "config.json"))
    for c in candidates:
        if storage.exists(c):
            return c
    return None


# --- CS YAML documents ---------------------------------------------------------------------


def cs_model_section(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The model config of a CS YAML: ``trainer.init.model`` (2.3+ layout) or ``model`` (legacy)."""
    if "trainer" in doc:
        trainer = doc["trainer"]
        if isinstance(trainer, list):
            raise ConfigConversionError(
                "the config has a list of trainers; convert one trainer's config at a time",
                hint="split the YAML so it has a single `trainer:` mapping",
            )
        model = get_path(trainer, "init.model")
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
    out = copy.deepcopy(dict(doc))
    if "trainer" in out and isinstance(out["trainer"], Mapping):
        out["trainer"].setdefault("init", {})["model"] = dict(model)
    else:
        out["model"] = dict(model)
    return out


def sort_nested(d: Any) -> Any:
    if isinstance(d, Mapping):
        return {k: sort_nested(d[k]) for k in sorted(d, key=str)}
    if isinstance(d, list):
        return [sort_nested(v) for v in d]
    return d


def dump_cs_yaml(doc: Mapping[str, Any]) -> bytes:
    """YAML as the Model Zoo writes it: keys sorted at every level, indent 4."""
    import yaml

    return yaml.safe_dump(sort_nested(dict(doc)), indent=4, sort_keys=True, default_flow_style=False).encode()


def dump_hf_json(cfg: Mapping[str, Any]) -> bytes:

    return (json.dumps(dict(cfg), indent=4) + "\n").encode()
