"""Config files of model conversions: reading a Hugging Face ``config.json`` or a Cerebras run YAML
(:mod:`ckptconv.engine.cs_yaml`) from any storage, finding the ``config.json`` beside a Hugging Face
checkpoint, and writing a ``config.json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ckptconv.core.bounded import load_json
from ckptconv.core.errors import ConfigConversionError, ObjectNotFound
from ckptconv.core.uri import parent
from ckptconv.engine.cs_yaml import parse_cs_yaml
from ckptconv.storage import open_storage


def _read(uri: str) -> bytes:
    storage = open_storage(uri)
    return storage.read_all(uri)


def parse_config_bytes(data: bytes, name: str) -> dict[str, Any]:
    """A config file's content: JSON (``config.json``) or YAML (Cerebras run files)."""
    if not name.endswith(".json"):
        return parse_cs_yaml(data, name)
    doc = load_json(data, what=name, error=ConfigConversionError)
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
        candidates.append(storage.join(parent(src_uri), "config.json"))
    for c in candidates:
        if storage.exists(c):
            return c
    return None


def dump_hf_json(cfg: Mapping[str, Any]) -> bytes:
    """A Hugging Face ``config.json`` as ``save_pretrained`` writes it: indent 4, a final newline."""
    return (json.dumps(dict(cfg), indent=4) + "\n").encode()
