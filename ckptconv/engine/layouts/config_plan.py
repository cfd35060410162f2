"""A family's config converted along a path of the release graph, and the environment its table's
expressions read (CS and HF config keys, the family's dims)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.errors import (
    ConfigConversionError,
    InvalidRequest,
)
from ckptconv.engine.cs_yaml import model_section, replace_model_section
from ckptconv.engine.layouts import folding, upgrades
from ckptconv.engine.layouts.config import export_config, import_config
from ckptconv.engine.layouts.dictpath import fill_defaults, flat_env
from ckptconv.engine.layouts.expr import evaluate
from ckptconv.engine.layouts.registry import Family, Variant, resolve

MODEL = "model"  # the top-level key of a Cerebras checkpoint's model state and config section


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
        model = model_section(at)
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
        hf, w, ignored = export_config(
            table,
            model,
            release=release,
            registry_name=fam.cs_name,
            variant=variant,
            top={k: v for k, v in at.items() if k != MODEL},
        )
        warnings += w
        return ConfigResult(hf, fill_defaults(model, table.cs_defaults), hf, warnings, ignored, mup)
    out = upgrades.config_along(dict(doc), path, fam, warnings)
    model = model_section(out)
    if lora_sites:
        model = folding.lora_config(model, lora_sites)
        out = replace_model_section(out, model)
    return ConfigResult(out, fill_defaults(model, table.cs_defaults), {}, warnings, [])


# --- reading CS metadata from a source ------------------------------------------------------------


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
