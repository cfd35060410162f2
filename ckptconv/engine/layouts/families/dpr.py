"""DPR (dense passage retrieval): two BERT encoders, packed into one Cerebras checkpoint.

The Hugging Face side is a directory with two model directories, ``q_encoder/``
(``DPRQuestionEncoder``) and ``ctx_encoder/`` (``DPRContextEncoder``), each with its
``config.json`` (``model_type: dpr``) and weights keyed ``question_encoder.bert_model.<BERT key>``
or ``ctx_encoder.bert_model.<BERT key>``. The Cerebras side (releases 2.2 ... 2.9) is one
checkpoint keyed ``model.question_encoder.<encoder key>`` and ``model.ctx_encoder.<encoder key>``
with one config whose model section holds ``q_encoder:`` and ``ctx_encoder:`` (each a BERT model
section) and the retrieval settings.

Each encoder goes through the BERT family's own table: its keys are seen as a BERT model's
(``bert.<key>`` / ``model.bert_encoder.<key>``), the pre-training heads that table adds are left
out, and the outputs are keyed back under the encoder. DPR keeps no pooler (``projection_dim: 0``
is ``add_pooling_layer: false``); a projection (``projection_dim > 0``) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptconv.core.errors import ConfigConversionError
from ckptconv.core.releases import release_key
from ckptconv.engine.layouts.composite import (
    PartsPlan,
    component_configs,
    composite_formats,
    composite_model_section,
    part_plan,
)
from ckptconv.engine.layouts.config_files import dump_hf_json
from ckptconv.engine.layouts.config_plan import ConfigResult
from ckptconv.engine.layouts.planner import Request
from ckptconv.engine.layouts.registry import model_tables
from ckptconv.engine.layouts.source_info import metadata_params
from ckptconv.engine.plan import Plan
from ckptconv.formats.base import TensorSource
from ckptconv.formats.tree import flat_dict_spec, wrap_spec

MODEL_NAME = "dpr"
# What this module reads from its table (dpr.yaml beside it).
TABLE = model_tables()[MODEL_NAME]


@dataclass(frozen=True)
class Encoder:
    directory: str  # Hugging Face sub-directory, and the key of its section in the CS config
    hf_prefix: str  # Hugging Face key prefix, before the BERT model's own keys
    cs_prefix: str  # Cerebras key prefix inside ``model``
    architecture: str


ENCODERS = tuple(Encoder(p.name, p.hf_route, p.cs_prefix.removeprefix("model."), p.hf_class) for p in TABLE.parts)
COMPONENTS = TABLE.components
ENCODER_FAMILY = "bert"  # the table converting each encoder (every part of dpr.yaml names it)
# Model section fields of a DPR run besides the two encoders (Model Zoo defaults per release).
RETRIEVAL_DEFAULTS = {
    "2.2": {"scale_similarity": False},
    "2.3": {
        "pooler_type": "cls",
        "use_biencoder": True,
        "mutual_information": False,
        "softmax_temperature": 1,
        "compute_eval_metrics": False,
    },
}
BERT_HF = "bert."
BERT_CS = "model.bert_encoder."


def _retrieval_defaults(release: str) -> dict[str, Any]:
    return dict(RETRIEVAL_DEFAULTS["2.3" if release_key(release) >= release_key("2.3") else "2.2"])


def _bert_hf_config(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    if hf.get("model_type") not in ("dpr", None):
        raise ConfigConversionError(f"{where}/config.json has model_type {hf.get('model_type')!r}, not dpr")
    if hf.get("projection_dim"):
        raise ConfigConversionError(
            f"{where} has a projection (projection_dim {hf['projection_dim']}); Cerebras DPR encoders have none",
            hint="convert encoders without encode_proj (projection_dim: 0)",
        )
    return {**hf, "model_type": "bert", "architectures": ["BertForPreTraining"]}


def _dpr_hf_config(bert_hf: Mapping[str, Any], e: Encoder) -> dict[str, Any]:
    # The BERT export adds a pre-training head's fields; a DPR encoder has none of them.
    drop = {"tie_word_embeddings"}
    return {
        **{k: v for k, v in bert_hf.items() if k not in drop},
        "architectures": [e.architecture],
        "model_type": "dpr",
        "projection_dim": 0,
    }


def build_plan(
    source: TensorSource, config: Mapping[str, Any] | None, req: Request, *, strict: bool
) -> tuple[Plan, ConfigResult]:
    """Plan a DPR conversion (see the module docstring)."""
    src, tgt = composite_formats(req, source, TABLE)
    parts = PartsPlan()
    if src == "hf":
        configs = component_configs(source, COMPONENTS)
        sections: dict[str, Any] = {}
        for e in ENCODERS:
            plan, conf = part_plan(
                source,
                lambda k, e=e: _from_hf(k, e),
                lambda k, e=e: _to_cs(k, e),
                _bert_hf_config(configs[e.directory], e.directory),
                _bert(req),
                strict=strict,
            )
            parts.add(plan, e.directory, keep_warning=lambda w: not _about_heads(w))
            section = {k: v for k, v in conf.target["model"].items() if k != "name"}  # the run names the model
            section["add_pooling_layer"] = False
            sections[e.directory] = section
        doc = {"model": {**sections, **_retrieval_defaults(tgt[3:])}}
        spec = wrap_spec("model", flat_dict_spec([s.out.key[len("model.") :] for s in parts.steps]))
        result = parts.plan(source, spec, model=MODEL_NAME, strict=strict, drop=req.drop_unmatched_keys)
        conf_out = ConfigResult(doc, {}, {}, [], [])
    else:
        if config is None:
            config = metadata_params(source, source.entries())
        model = _cs_model(config)
        hf_configs: dict[str, Any] = {}
        for e in ENCODERS:
            section = model.get(e.directory)
            if not isinstance(section, Mapping):
                raise ConfigConversionError(f"the DPR config has no model.{e.directory} section")
            plan, conf = part_plan(
                source,
                lambda k, e=e: _from_cs(k, e),
                lambda k, e=e: _to_hf(k, e),
                {"model": dict(section)},
                _bert(req),
                strict=strict,
            )
            parts.add(plan, e.directory, keep_warning=lambda w: not _about_heads(w))
            hf_configs[e.directory] = _dpr_hf_config(conf.target, e)
        parts.drop_outside_model(source)
        result = parts.plan(source, None, model=MODEL_NAME, strict=strict, drop=req.drop_unmatched_keys)
        conf_out = ConfigResult(hf_configs, {}, {}, [], [])
        result.extras["components"] = TABLE.routes()
    result.config = conf_out.target
    result.extras.update(
        {"model": MODEL_NAME, "family": ENCODER_FAMILY, "source_format": src, "target_format": tgt, "path": [src, tgt]}
    )
    return result, conf_out


def _about_heads(warning: str) -> bool:
    """Whether a BERT warning is about the pre-training heads, which a DPR encoder does not have."""
    return any(h in warning for h in ("cls.", "bert_mlm_head", "bert_cls_head"))


def _bert(req: Request) -> Request:
    return replace(req, model=ENCODER_FAMILY)


def _from_hf(key: str, e: Encoder) -> str | None:
    return BERT_HF + key[len(e.hf_prefix) :] if key.startswith(e.hf_prefix) else None


def _to_hf(key: str, e: Encoder) -> str | None:
    """``bert.<k>`` -> ``<encoder>.bert_model.<k>``; the pre-training heads are dropped."""
    return e.hf_prefix + key[len(BERT_HF) :] if key.startswith(BERT_HF) else None


def _to_cs(key: str, e: Encoder) -> str | None:
    """``model.bert_encoder.<k>`` -> ``model.<encoder>.<k>``; the pre-training heads are dropped."""
    if not key.startswith(BERT_CS) or key.startswith(BERT_CS + "pooler."):
        return None
    return "model." + e.cs_prefix + key[len(BERT_CS) :]


def _from_cs(key: str, e: Encoder) -> str | None:
    if key.startswith("model." + e.cs_prefix):
        return BERT_CS + key[len("model." + e.cs_prefix) :]
    return None


def _cs_model(config: Mapping[str, Any] | None) -> dict[str, Any]:
    return composite_model_section(config, "DPR", COMPONENTS)


def hf_config_files(plan: Plan, target_dir: str, final_target: str) -> dict[str, bytes]:
    """``{<target dir>/<encoder>/config.json: bytes}`` of a DPR plan towards Hugging Face
    (``final_target``, where the output is published, is not needed)."""
    assert plan.config is not None
    return {f"{target_dir}/{name}/config.json": dump_hf_json(cfg) for name, cfg in plan.config.items()}
