"""LLaVA: a CLIP vision tower, a projector and a Llama language model.

The Hugging Face side is the layout of the original LLaVA releases, as the Model Zoo reads it: a
directory holding

- ``image_model/``: a CLIP vision tower (``CLIPVisionModel``, or a full ``CLIPModel`` whose text
  tower is dropped), its ``config.json`` and ``preprocessor_config.json``;
- ``text_model/``: the LLaVA language model (``LlavaLlamaForCausalLM``): Llama keys, the projector
  ``model.mm_projector.<n>.{weight,bias}`` (an ``nn.Sequential`` of Linear, GELU, Linear, ...: the
  linear layers sit at even positions), and a ``config.json`` with the LLaVA fields (``mm_*``).

The Cerebras side (releases 2.2 ... 2.9) is one checkpoint: ``model.image_model.<ViT key>``,
``model.text_model.<Llama key>`` and ``model.projector_image_model.ffn.<n // 2>.linear_layer.*``,
with one config whose model section holds ``image_model:``, ``text_model:``, ``projector:`` and
the multimodal settings.

Each part goes through its family's own table (clip-vit, llama) on a view of its keys; only the
projector and the config glue are here. A Hugging Face checkpoint without a projector (a first
training phase starts from a plain Llama) gets one initialized as the Model Zoo does: every
linear layer U(-1/sqrt(in), 1/sqrt(in)), float32.

Differences from the Model Zoo, on purpose: an absent ``mm_hidden_size`` defaults to the vision
tower's hidden size (the Model Zoo's default, 64, fails its own check for any real tower), and the
projector's initialization is seeded so a conversion is reproducible.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckptconv.core.errors import ConfigConversionError, ConversionError, NoConversionPath
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
from ckptconv.engine.layouts.transforms import TRANSFORMS
from ckptconv.engine.plan import IDENTITY, Plan, Step, Transform
from ckptconv.formats.base import Entry, TensorSource
from ckptconv.formats.tree import flat_dict_spec, wrap_spec

MODEL_NAME = "llava"
# What this module reads from its table (llava.yaml beside it): the parts, their families and routes.
TABLE = model_tables()[MODEL_NAME]
IMAGE, TEXT = TABLE.components  # the vision tower, the language model
COMPONENTS = TABLE.components
ROUTES = TABLE.routes()
IMAGE_FAMILY, TEXT_FAMILY = (p.family for p in TABLE.parts)
# The prefix each part's family table keys the part's Cerebras keys with.
_FAMILY_CS_PREFIX = {IMAGE: "model.vit_model.", TEXT: "model."}
# (part, its family table, the prefix that table keys the part's Cerebras keys with)
PARTS = tuple((p.name, p.family, _FAMILY_CS_PREFIX[p.name]) for p in TABLE.parts)
PROJECTOR_HF = re.compile(r"model\.mm_projector\.(\d+)\.(weight|bias)")
PROJECTOR_CS = re.compile(r"model\.projector_image_model\.ffn\.(\d+)\.linear_layer\.(weight|bias)")
PROJECTOR_TYPE = re.compile(r"mlp(\d+)x_gelu")

# LLaVA fields of the text model's config.json (the Model Zoo's defaults for absent ones).
LLAVA_HF_DEFAULTS: dict[str, Any] = {
    "mm_vision_select_feature": "patch",
    "mm_use_im_patch_token": False,
    "mm_use_im_start_end": False,
    "mm_vision_select_layer": -2,
    "mm_projector_type": "mlp2x_gelu",
    "tune_mm_mlp_adapter": False,
}
# LLaVA training flags the Cerebras model has no use for: read, not converted, not reported.
LLAVA_HF_UNUSED = (
    "mm_vision_tower",
    "mm_patch_merge_type",
    "image_aspect_ratio",
    "freeze_mm_mlp_adapter",
    "freeze_mm_vision_resampler",
    "tune_mm_vision_resampler",
    "unfreeze_mm_vision_tower",
    "mm_projector_lr",
    "mm_vision_tower_lr",
    "tokenizer_model_max_length",
    "tokenizer_padding_side",
    "use_mm_proj",
)
# Written into the exported text model's config.json (what LLaVA's own configs carry).
LLAVA_HF_EXPORT: dict[str, Any] = {
    "mm_use_im_patch_token": False,
    "mm_use_im_start_end": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "image_aspect_ratio": "pad",
    "freeze_mm_mlp_adapter": False,
    "freeze_mm_vision_resampler": False,
    "architectures": ["LlavaLlamaForCausalLM"],
    "pad_token_id": 0,
    "tune_mm_vision_resampler": False,
    "unfreeze_mm_vision_tower": False,
    "use_cache": True,
}
# Model section fields of a Cerebras LLaVA run besides the parts.
CS_MODEL_DEFAULTS: dict[str, Any] = {
    "loss_weight": 1.0,
    "loss_scaling": "num_tokens",
    "label_smoothing": 0.0,
    "z_loss_eps": 0.0,
    "image_start_idx": 1,
}
# What the Model Zoo's LLaVA image processor config holds (size and crop follow the tower).
PREPROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_center_crop": True,
    "do_normalize": True,
    "do_resize": True,
    "feature_extractor_type": "CLIPFeatureExtractor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
}


# --- configs ---------------------------------------------------------------------------------


def _vision_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """A CLIP vision config from ``image_model/config.json`` (a full CLIPConfig holds it under
    ``vision_config``)."""
    doc = dict(hf.get("vision_config") or hf)
    if doc.get("model_type", "clip_vision_model") not in ("clip_vision_model", "clip"):
        raise ConfigConversionError(
            f"image_model/config.json has model_type {doc.get('model_type')!r}; LLaVA's vision tower is CLIP",
            hint="put a CLIP vision tower (CLIPVisionModel or CLIPModel) in image_model/",
        )
    doc["model_type"] = "clip_vision_model"
    return doc


def _split_text_config(hf: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Llama part of the text model's config.json, its LLaVA fields with defaults)."""
    llava = {k: hf.get(k, v) for k, v in LLAVA_HF_DEFAULTS.items()}
    if "mm_hidden_size" in hf:
        llava["mm_hidden_size"] = hf["mm_hidden_size"]
    llama = {k: v for k, v in hf.items() if k not in LLAVA_HF_DEFAULTS and k not in LLAVA_HF_UNUSED}
    llama.pop("mm_hidden_size", None)
    llama["model_type"] = "llama"
    return llama, llava


def _projector_section(llava: Mapping[str, Any], vision_hidden: int, text_hidden: int) -> dict[str, Any]:
    kind = str(llava["mm_projector_type"])
    m = PROJECTOR_TYPE.fullmatch(kind)
    if m is None or int(m.group(1)) < 1:
        raise ConfigConversionError(
            f"Can't convert config with mm_projector_type={kind!r}. Only mlp<N>x_gelu is supported.",
            key="mm_projector_type",
        )
    n = int(m.group(1))
    return {
        "image_model": {
            "name": "FeedForwardNetwork",
            "input_unit": vision_hidden,
            "layers_units": [text_hidden] * n,
            "layers_activation": ["gelu"] * (n - 1) + [None],
            "use_bias": True,
        }
    }


def import_llava_config(image: dict[str, Any], text: dict[str, Any], llava: Mapping[str, Any]) -> dict[str, Any]:
    """The Cerebras model section from the two converted part sections and the LLaVA fields."""
    for flag in ("mm_use_im_start_end", "mm_use_im_patch_token"):
        if llava[flag]:
            raise ConfigConversionError(
                f"Can't convert config with {flag}=True. Only False is supported.",
                key=flag,
                hint="the Cerebras LLaVA model adds no image start/end or patch tokens",
            )
    vision_hidden = int(image["hidden_size"])
    mm_hidden = int(llava.get("mm_hidden_size", vision_hidden))
    if mm_hidden != vision_hidden:
        raise ConfigConversionError(
            f"mm_hidden_size={mm_hidden} differs from the vision tower's hidden_size={vision_hidden}",
            key="mm_hidden_size",
            hint="image_model/ must hold the tower the projector was trained on",
        )
    layer = int(llava["mm_vision_select_layer"])
    if layer == 0:
        raise ConfigConversionError(
            "Can't convert config with mm_vision_select_layer=0 (the embeddings, not an encoder layer)",
            key="mm_vision_select_layer",
        )
    image = {k: v for k, v in image.items() if k not in ("name", "fp16_type")}
    text = {k: v for k, v in text.items() if k != "name"}
    model: dict[str, Any] = {
        IMAGE: {**image, "name": "ViTModel"},
        TEXT: {**text, "name": "LlamaModel"},
        "projector": _projector_section(llava, vision_hidden, int(text["hidden_size"])),
        # Hugging Face counts the embeddings as hidden state 0; Cerebras counts encoder layers.
        "image_feature_select_layer_idx": layer if layer < 0 else layer - 1,
        "image_feature_select_mode": llava["mm_vision_select_feature"],
        "freeze": ["^image_model", *(["^text_model"] if llava["tune_mm_mlp_adapter"] else [])],
        **CS_MODEL_DEFAULTS,
    }
    return model


def export_llava_fields(model: Mapping[str, Any]) -> dict[str, Any]:
    """The LLaVA fields of the exported text model's config.json."""
    proj = (model.get("projector") or {}).get("image_model") or {}
    if proj.get("name", "FeedForwardNetwork") != "FeedForwardNetwork":
        raise ConfigConversionError(
            f"projector.image_model.name is {proj.get('name')!r}; only a FeedForwardNetwork projector converts",
            key="projector.image_model.name",
        )
    acts = list(proj.get("layers_activation") or [])
    if not acts or acts != ["gelu"] * (len(acts) - 1) + [None]:
        raise ConfigConversionError(
            f"Can't convert a projector with layers_activation={acts!r}. Only gelu between layers, none last.",
            key="projector.image_model.layers_activation",
        )
    layer = int(model.get("image_feature_select_layer_idx", -2))
    freeze = [str(f) for f in model.get("freeze") or []]
    return {
        "mm_projector_type": f"mlp{len(acts)}x_gelu",
        "mm_hidden_size": model[IMAGE]["hidden_size"],
        "mm_vision_select_feature": model.get("image_feature_select_mode", "patch"),
        "mm_vision_select_layer": layer if layer < 0 else layer + 1,
        "tune_mm_mlp_adapter": any("text_model" in f for f in freeze),
        **LLAVA_HF_EXPORT,
    }


def preprocessor_config(image_section: Mapping[str, Any]) -> dict[str, Any]:
    """``image_model/preprocessor_config.json``: CLIP's image processing at the tower's size."""
    size = image_section.get("image_size", 224)
    height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    return {**PREPROCESSOR_DEFAULTS, "crop_size": {"height": height, "width": width}, "size": height}


# --- the plan --------------------------------------------------------------------------------


def _projector_steps_from_hf(source: TensorSource) -> list[Step]:
    steps = []
    for e in source.entries():
        m = PROJECTOR_HF.fullmatch(e.key)
        if m is None:
            continue
        n, wb = int(m.group(1)), m.group(2)
        if n % 2:
            raise ConversionError(
                f"{e.key}: a linear layer of mm_projector at an odd position",
                hint="LLaVA's projector alternates Linear and GELU (mlp<N>x_gelu); other projectors do not convert",
            )
        out = replace(e, key=f"model.projector_image_model.ffn.{n // 2}.linear_layer.{wb}")
        steps.append(Step(out, (e.key,), IDENTITY))
    return steps


def _projector_steps_to_hf(source: TensorSource) -> list[Step]:
    steps = []
    for e in source.entries():
        m = PROJECTOR_CS.fullmatch(e.key)
        if m is not None:
            out = replace(e, key=f"model.mm_projector.{2 * int(m.group(1))}.{m.group(2)}")
            steps.append(Step(out, (e.key,), IDENTITY))
    return steps


def _projector_init_steps(projector: Mapping[str, Any], anchor: Entry) -> list[Step]:
    """A new projector: U(-1/sqrt(in), 1/sqrt(in)) weights and biases, as the Model Zoo makes one."""
    cfg = projector["image_model"]
    ins = [int(cfg["input_unit"])] + [int(u) for u in cfg["layers_units"][:-1]]
    outs = [int(u) for u in cfg["layers_units"]]
    init = TRANSFORMS["random_init"].to_cs
    steps = []
    for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
        shapes = {"weight": [n_out, n_in], **({"bias": [n_out]} if cfg.get("use_bias", True) else {})}
        for j, (wb, shape) in enumerate(shapes.items()):
            params = {"shape": shape, "dist": "uniform", "scale": n_in**-0.5, "seed": 2 * i + j}
            t = Transform("random_init", lambda v, p=params: init(v, p, 0), params, peak_factor=1.0)
            out = Entry(f"model.projector_image_model.ffn.{i}.linear_layer.{wb}", "tensor", "float32", tuple(shape))
            steps.append(Step(out, (anchor.key,), t))
    return steps


def build_plan(
    source: TensorSource, config: Mapping[str, Any] | None, req: Request, *, strict: bool
) -> tuple[Plan, ConfigResult]:
    """Plan a LLaVA conversion (see the module docstring)."""
    src, tgt = composite_formats(req, source, TABLE)
    parts = PartsPlan()
    if src == "hf":
        owner = getattr(source, "component_of", None)
        if owner is None:
            raise NoConversionPath(
                "a Hugging Face LLaVA checkpoint is a directory holding image_model/ and text_model/",
                hint="point the source at that directory",
            )
        configs = component_configs(source, COMPONENTS)
        llama_hf, llava = _split_text_config(configs[TEXT])
        hf_in = {IMAGE: _vision_config(configs[IMAGE]), TEXT: llama_hf}
        confs = {}
        for part, family, inner in PARTS:
            plan, conf = part_plan(
                source,
                lambda k, part=part: k if owner(k) == part and not _projector_or_tower(k) else None,
                _to_cs(part, inner),
                hf_in[part],
                replace(req, model=family, src_fmt="hf", tgt_fmt=tgt),
                strict=strict,
            )
            parts.add(plan, part, keep_warning=_not_about_classifier)
            confs[part] = conf
        model = import_llava_config(confs[IMAGE].target["model"], confs[TEXT].target["model"], llava)
        projector = _projector_steps_from_hf(source)
        if not projector:
            text_entries = [e for e in source.entries() if owner(e.key) == TEXT and e.is_data]
            anchor = min(text_entries, key=lambda e: e.nbytes)
            projector = _projector_init_steps(model["projector"], anchor)
            parts.warnings.append(
                "text_model/ has no mm_projector: a new projector was initialized "
                "(U(-1/sqrt(in), 1/sqrt(in)), as the Model Zoo does for a first training phase)"
            )
        parts.steps += projector
        parts.dropped += [e.key for e in source.entries() if e.key.startswith("model.vision_tower.")]
        doc = {"model": model}
        spec = wrap_spec("model", flat_dict_spec([s.out.key[len("model.") :] for s in parts.steps]))
        plan = parts.plan(source, spec, model=MODEL_NAME, strict=strict, drop=req.drop_unmatched_keys)
        conf_out = ConfigResult(doc, {}, {}, [], confs[IMAGE].ignored + confs[TEXT].ignored)
    else:
        if config is None:
            config = metadata_params(source, source.entries())
        model = _cs_model(config)
        hf_out = {}
        for part, family, inner in PARTS:
            plan, conf = part_plan(
                source,
                _from_cs(f"model.{part}.", inner),
                lambda k: k,
                {"model": _without_name(model[part])},
                replace(req, model=family, src_fmt=src, tgt_fmt="hf"),
                strict=strict,
            )
            parts.add(plan, part)
            hf_out[part] = conf.target
        parts.steps += _projector_steps_to_hf(source)
        parts.dropped += [e.key for e in source.entries() if e.key.startswith("model.projector_text_model.")]
        parts.drop_outside_model(source)
        hf_configs = {IMAGE: hf_out[IMAGE], TEXT: {**hf_out[TEXT], **export_llava_fields(model)}}
        plan = parts.plan(source, None, model=MODEL_NAME, strict=strict, drop=req.drop_unmatched_keys)
        plan.extras["components"] = ROUTES
        plan.extras["preprocessor"] = preprocessor_config(model[IMAGE])
        conf_out = ConfigResult(hf_configs, {}, {}, [], [])
    plan.config = conf_out.target
    plan.extras.update(
        {"model": MODEL_NAME, "family": TEXT_FAMILY, "source_format": src, "target_format": tgt, "path": [src, tgt]}
    )
    return plan, conf_out


def _projector_or_tower(key: str) -> bool:
    return PROJECTOR_HF.fullmatch(key) is not None or key.startswith("model.vision_tower.")


def _not_about_classifier(warning: str) -> bool:
    """The ViT table's classifier is dropped: LLaVA's image model has none."""
    return "classifier.classifier" not in warning


def _to_cs(part: str, inner_prefix: str) -> Any:
    """``<inner_prefix><k>`` (a part table's CS key) -> ``model.<part>.<k>``; other outputs dropped."""

    def rename(key: str) -> str | None:
        if not key.startswith(inner_prefix):
            return None
        return f"model.{part}.{key[len(inner_prefix) :]}"

    return rename


def _from_cs(outer_prefix: str, inner_prefix: str) -> Any:
    def rename(key: str) -> str | None:
        return inner_prefix + key[len(outer_prefix) :] if key.startswith(outer_prefix) else None

    return rename


def _without_name(section: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in section.items() if k != "name"}


def _cs_model(config: Mapping[str, Any] | None) -> dict[str, Any]:
    return composite_model_section(config, "LLaVA", [IMAGE, TEXT, "projector"])


def hf_config_files(plan: Plan, target_dir: str, final_target: str) -> dict[str, bytes]:
    """``{<target dir>/<part>/config.json: bytes}`` (and the image preprocessor config) of a LLaVA
    plan towards Hugging Face. The text model's ``mm_vision_tower`` names the published tower."""
    assert plan.config is not None
    text = {**plan.config[TEXT], "mm_vision_tower": f"{final_target.rstrip('/')}/{IMAGE}"}
    return {
        f"{target_dir}/{IMAGE}/config.json": dump_hf_json(plan.config[IMAGE]),
        f"{target_dir}/{IMAGE}/preprocessor_config.json": dump_hf_json(plan.extras["preprocessor"]),
        f"{target_dir}/{TEXT}/config.json": dump_hf_json(text),
    }
