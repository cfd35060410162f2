"""The ``config:`` section of a family table, parsed: field mappings, defaults, asserts, constants,
fixed sets and hook names (see :mod:`ckptconv.engine.layouts.config` for what each means)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.errors import ConfigConversionError


@dataclass(frozen=True)
class Field:
    hf: str
    cs: str
    map: Mapping[Any, Any] | None = None
    direction: str = "both"
    passthrough: bool = False  # values outside ``map`` are copied verbatim instead of refused
    also: Mapping[Any, Any] | None = None  # extra HF values accepted on import (not produced on export)

    def to_cs(self, value: Any) -> Any:
        if self.map is None or value is None:
            return value
        if value in self.map:
            return self.map[value]
        if self.also and value in self.also:
            return self.also[value]
        if self.passthrough:
            return value
        raise ConfigConversionError(
            f"Can't convert config with {self.hf}={value!r}. Only {', '.join(map(repr, self.map))} is supported.",
            key=self.hf,
        )

    def to_hf(self, value: Any) -> Any:
        if self.map is None or value is None:
            return value
        inverse = {v: k for k, v in self.map.items()}
        if value in inverse:
            return inverse[value]
        if self.passthrough:
            return value
        raise ConfigConversionError(
            f"Can't convert config with {self.cs}={value!r}. Only {', '.join(map(repr, inverse))} is supported.",
            key=self.cs,
        )


@dataclass(frozen=True)
class ConfigTable:
    fields: tuple[Field, ...]
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    cs_defaults: Mapping[str, Any] = field(default_factory=dict)
    hf_asserts: Mapping[str, Any] = field(default_factory=dict)
    cs_consts: Mapping[str, Any] = field(default_factory=dict)
    import_consts: tuple[str, ...] = ()
    import_sets: Mapping[str, Any] = field(default_factory=dict)
    export_sets: Mapping[str, Any] = field(default_factory=dict)
    hooks: tuple[str, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)  # hook parameters
