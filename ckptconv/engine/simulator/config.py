"""The ``model:`` section of a Cerebras YAML config, with the Model Zoo model-class defaults.

A Cerebras config names its model section either at the top level (``model:``, the legacy layout
the converters write) or under ``trainer.init.model`` (2.3+ trainer layout); both are read by
:mod:`ckptconv.engine.cs_yaml`, as model conversion reads them. Keys a config does not
set take the defaults of the Model Zoo class that implements the model, which is why a converted
GPT-2 YAML with 16 keys still describes learned positions, layer norms and biases, and why a llama
YAML has to spell out ``position_embedding_type: rotary`` and friends.

``parse_model_config`` returns the resolved parameters; the simulator's model classes read only
from it. Keys that change the computation in ways the simulator does not implement are refused
(``SimulationError``) rather than silently ignored; other unknown keys (wrapper-level options such
as ``loss_scaling``) are reported in ``CsModelConfig.ignored``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.errors import InvalidRequest, SimulationError, UnknownModel
from ckptconv.engine.cs_yaml import model_section

GPT2 = "GPT2LMHeadModel"
GPTJ = "GPTJModel"
BERT = "BertPretrainModel"
BERT_SEQ = "BertForSequenceClassification"
BERT_TOKEN = "BertForTokenClassification"
BERT_QA = "BertForQuestionAnswering"
T5 = "T5ForConditionalGeneration"

# Model Zoo model names (``--model``) -> the class the appliance builds for them.
MODEL_CLASSES: dict[str, str] = {
    **dict.fromkeys(
        [
            "gpt2",
            "llama",
            "llamaV2",
            "code-llama",
            "wizardlm",
            "mistral",
            "mixtral",
            "bloom",
            "starcoder",
            "octocoder",
            "wizardcoder",
            "sqlcoder",
            "santacoder",
            "btlm",
            "jais",
            "gemma2",
        ],
        GPT2,
    ),
    **dict.fromkeys(["gptj", "gpt-neox", "codegen", "falcon"], GPTJ),
    **dict.fromkeys(["bert", "roberta"], BERT),
    "bert-sequence-classifier": BERT_SEQ,
    "bert-token-classifier": BERT_TOKEN,
    "bert-qa": BERT_QA,
    **dict.fromkeys(["t5", "transformer", "ul2", "flan-ul2"], T5),
}
# Headless variants train and checkpoint the same CS language model (the converters synthesize or
# drop lm_head); the simulator builds the same class.
for _name in [
    "gpt2",
    "llama",
    "mistral",
    "mixtral",
    "bloom",
    "starcoder",
    "santacoder",
    "btlm",
    "gptj",
    "gpt-neox",
    "codegen",
    "falcon",
]:
    MODEL_CLASSES[f"{_name}-headless"] = MODEL_CLASSES[_name]

_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 0,
    "num_shared_experts": None,
    "top_k": 1,
    "load_balancing_loss_coef": 0.0,
    "null_expert_bias": 0.0,
    "router_fp32": True,
    "routing_algorithm": "learned",
    "router_selection_nonlinearity": "softmax",
    "expert_weighting_nonlinearity": "softmax",
    "expert_weighting_normalization": True,
    "moe_implementation": "optimized",
}

_COMMON_MUP: dict[str, Any] = {
    "mup_base_hidden_size": None,
    "mup_base_filter_size": None,
    "embeddings_scale": 1.0,
    "scale_qk_dot_by_d": None,
    "attention_logits_alpha": 1.0,
    "scale_output_logits_by_d": True,
    "output_logits_alpha": None,
}

DEFAULTS: dict[str, dict[str, Any]] = {
    GPT2: {
        "vocab_size": 50257,
        "max_position_embeddings": 1024,
        "embedding_dropout_rate": None,  # None: dropout_rate
        "position_embedding_type": "learned",
        "position_embedding_offset": 0,
        "hidden_size": 768,
        "share_embedding_weights": True,
        "embedding_layer_norm": False,
        "num_relative_attention_buckets": 32,
        "rotary_dim": None,  # rotary + None: int(hidden // heads * 0.25)
        "rope_theta": 10000.0,
        "num_hidden_layers": 12,
        "dropout_rate": 0.1,
        "norm_type": "layernorm",
        "layer_norm_epsilon": 1e-5,
        "num_heads": 12,
        "attention_type": "scaled_dot_product",
        "attention_module": "aiayn_attention",
        "attention_sliding_window_length": None,
        "sliding_window_every_other_decoder_layer": False,
        "attention_qk_norm_layer": None,
        "attention_qk_norm_eps": 1e-5,
        "extra_attention_params": {},
        "attention_inner_dim": None,
        "use_projection_bias_in_attention": True,
        "use_ffn_bias_in_attention": True,
        "attention_dropout_rate": 0.1,
        "attention_softmax_fp32": True,
        "attention_logit_softcapping": None,
        "filter_size": 3072,
        "nonlinearity": "gelu",
        "use_ffn_bias": True,
        "use_bias_in_output": False,
        "initializer_range": 0.02,
        **_COMMON_MUP,
        "output_logits_scale": None,
        "alibi_trainable_slopes": False,
        "pos_scaling_factor": 1.0,
        "pos_scaling_type": "linear",
        "pos_scaling_extra_args": None,
        "scale_qk_dot_by_layer_idx": False,
        "norm_first": True,
        "norm_first_sandwich": False,
        "use_ff_layer1_dropout": False,
        "final_logit_softcapping": None,
        "moe": _MOE_DEFAULTS,
    },
    GPTJ: {
        "hidden_size": 768,
        "vocab_size": 50257,
        "max_position_embeddings": 1024,
        "embedding_dropout_rate": 0.1,
        "share_embedding_weights": True,
        "position_embedding_type": "rotary",
        "rotary_dim": None,
        "rope_theta": 10000.0,
        "num_relative_attention_buckets": None,
        "num_hidden_layers": 12,
        "filter_size": 3072,
        "dropout_rate": 0.1,
        "nonlinearity": "gelu",
        "norm_type": "layernorm",
        "layer_norm_epsilon": 1e-5,
        "use_ffn_bias": False,
        "use_untied_layer_norm": False,
        "num_heads": 12,
        "attention_module": "aiayn_attention",
        "attention_sliding_window_length": None,
        "extra_attention_params": {},
        "attention_type": "scaled_dot_product",
        "attention_dropout_rate": 0.1,
        "attention_softmax_fp32": True,
        "use_projection_bias_in_attention": True,
        "use_ffn_bias_in_attention": True,
        "initializer_range": 0.02,
        "use_bias_in_output": False,
        "norm_first": True,
        "use_ff_layer1_dropout": False,
        "embedding_layer_norm": False,
        **_COMMON_MUP,
        "alibi_trainable_slopes": False,
        "pos_scaling_factor": 1.0,
        "pos_scaling_type": "linear",
        "pos_scaling_extra_args": None,
        "moe": _MOE_DEFAULTS,
    },
    BERT: {
        "vocab_size": None,  # required
        "max_position_embeddings": None,  # required with learned positions
        "position_embedding_type": "learned",
        "pad_token_id": 0,
        "mask_padding_in_positional_embed": False,
        "num_relative_attention_buckets": 32,
        "rotary_dim": None,
        "rope_theta": 10000.0,
        "alibi_trainable_slopes": False,
        "pos_scaling_factor": 1.0,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "dropout_rate": 0.1,
        "layer_norm_epsilon": 1e-5,
        "norm_first": False,
        "embedding_layer_norm": True,
        "num_heads": 12,
        "attention_module": "aiayn_attention",
        "extra_attention_params": {},
        "attention_type": "scaled_dot_product",
        "attention_dropout_rate": None,  # None: dropout_rate
        "use_projection_bias_in_attention": True,
        "use_ffn_bias_in_attention": True,
        "attention_softmax_fp32": True,
        "filter_size": 3072,
        "encoder_nonlinearity": "gelu",
        "mlm_nonlinearity": None,  # None: encoder_nonlinearity
        "pooler_nonlinearity": None,  # None: encoder_nonlinearity
        "use_ffn_bias": True,
        "use_ffn_bias_in_mlm": True,
        "use_output_bias_in_mlm": True,
        "share_embedding_weights": True,
        "disable_nsp": False,
        "num_classes": 2,
        "num_segments": None,  # None: 2, or none at all with disable_nsp
        "use_final_layer_norm": False,
        "initializer_range": 0.02,
        **_COMMON_MUP,
        "output_logits_alpha": None,
    },
    T5: {
        "src_vocab_size": 32128,
        "tgt_vocab_size": None,  # None: src_vocab_size
        "d_model": 512,
        "d_kv": 64,
        "d_ff": 2048,
        "encoder_num_hidden_layers": 6,
        "decoder_num_hidden_layers": None,  # None: encoder_num_hidden_layers
        "num_heads": 8,
        "relative_attention_num_buckets": 32,
        "norm_type": "rmsnorm",
        "dropout_rate": 0.1,
        "relu_dropout_rate": None,
        "layer_norm_epsilon": 1e-6,
        "encoder_nonlinearity": "relu",
        "decoder_nonlinearity": "relu",
        "use_projection_bias_in_attention": False,
        "attention_softmax_fp32": True,
        "position_embedding_type": "relative",
        "src_max_position_embeddings": 512,
        "tgt_max_position_embeddings": 512,
        "use_dropout_outside_residual_path": True,
        "share_encoder_decoder_embedding": True,
        "share_embedding_weights": True,
        "use_pre_encoder_decoder_dropout": False,
        "use_pre_encoder_decoder_layer_norm": True,
        "use_ffn_bias": False,
        "use_transformer_initialization": False,
        "attention_module": "aiayn_attention",
        "extra_attention_params": {},
        "pad_token_id": 0,
        "initializer_factor": 1.0,
    },
}
_BERT_FINETUNE_EXTRA: dict[str, dict[str, Any]] = {
    BERT_SEQ: {"num_labels": 2, "problem_type": None, "task_dropout": None},
    BERT_TOKEN: {"num_classes": 2, "encoder_output_dropout_rate": None, "loss_weight": 1.0},
    BERT_QA: {},
}
for _cls, _extra in _BERT_FINETUNE_EXTRA.items():
    DEFAULTS[_cls] = {**{k: v for k, v in DEFAULTS[BERT].items() if k not in ("disable_nsp", "num_classes")}, **_extra}

# Alternative spellings the Model Zoo config classes accept (alias -> canonical).
ALIASES: dict[str, dict[str, str]] = {
    GPT2: {"embd_pdrop": "embedding_dropout_rate", "moe_params": "moe"},
    GPTJ: {"embd_pdrop": "embedding_dropout_rate", "residual_dropout_rate": "dropout_rate", "moe_params": "moe"},
    BERT: {"nonlinearity": "encoder_nonlinearity", "embedding_pad_token_id": "pad_token_id"},
    T5: {"vocab_size": "src_vocab_size"},
}
for _cls in _BERT_FINETUNE_EXTRA:
    ALIASES[_cls] = dict(ALIASES[BERT])
ALIASES[BERT_SEQ]["classifier_dropout"] = "task_dropout"
ALIASES[BERT_TOKEN]["num_labels"] = "num_classes"
ALIASES[BERT_TOKEN]["classifier_dropout"] = "encoder_output_dropout_rate"

# Keys that would change the computation in ways the simulator does not implement: accepted only
# at these values (their Model Zoo defaults).
UNSIMULATED: dict[str, Any] = {
    "fixed_sparse_attention": None,
    "attention_chunk_size": None,
    "attention_sink_tokens": None,
    "attention_vertical_column_spacing": None,
    "attention_vertical_column_width": None,
    "cross_attention_layers": [],
    "rel_distance_mode": "default",
    "num_extra_input_vocab_tokens": 0,
    "constant_pos_embedding": None,
    "pad_rope": False,
    "lora_params": None,
    "tie_encoder_decoder": False,
}
# Keys known to be harmless for a CPU forward/backward (kernels, initializers, precision knobs,
# wrapper options); they are accepted silently.
HARMLESS = {
    "name",
    "attention_kernel",
    "fold_rope_consts",
    "dtype",
    "fp16_type",
    "mixed_precision",
    "loss_scaling",
    "loss_weight",
    "label_smoothing",
    "mlm_loss_weight",
    "lm_loss_weight",
    "z_loss_coefficient",
    "compute_eval_metrics",
    "embedding_initializer",
    "embeddings_initializer",
    "position_embeddings_initializer",
    "segment_embeddings_initializer",
    "initializer",
    "output_layer_initializer",
    "ffn_initializer",
    "ffn_output_layer_initializer",
    "default_initializer",
    "lr_adjustment_groups",
    "memory_tokens",
    "use_experimental_flex_api",
    "freeze_ffn_bias_in_glu",
    "include_padding_in_loss",
    "use_cache",
    "decoder_start_token_id",
    "boundary_casting",
    "precision_opt_level",
    "use_bfloat16",
}


@dataclass(frozen=True)
class CsModelConfig:
    """A resolved Cerebras model config."""

    model: str  # Model Zoo model name, e.g. "llama"
    class_name: str  # Model Zoo class, e.g. "GPT2LMHeadModel"
    params: dict[str, Any]  # every parameter the class reads, defaults filled in
    given: dict[str, Any] = field(default_factory=dict)  # the model section as written
    ignored: tuple[str, ...] = ()  # keys the simulator does not read

    def __getitem__(self, key: str) -> Any:
        return self.params[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)


def resolve_model_name(model: str | None, section: dict[str, Any]) -> str:
    name = model or section.get("name")
    if not name:
        raise InvalidRequest(
            "cannot tell which model this config describes",
            hint="pass --model (e.g. llama, gpt2, bert) or set `name:` in the model section",
        )
    if name not in MODEL_CLASSES:
        raise UnknownModel(
            f"the simulator does not know the model {name!r}",
            hint=f"known models: {', '.join(sorted(MODEL_CLASSES))}",
        )
    return name


def parse_model_config(config: dict[str, Any], model: str | None = None) -> CsModelConfig:
    """Resolve the model section of ``config`` (a parsed YAML) for ``model`` (a Model Zoo name)."""
    section = model_section(config)
    name = resolve_model_name(model, section)
    class_name = MODEL_CLASSES[name]
    params = copy.deepcopy(DEFAULTS[class_name])
    aliases = ALIASES.get(class_name, {})
    ignored: list[str] = []
    for key, value in section.items():
        canon = aliases.get(key, key)
        if canon in params:
            if canon == "moe":
                if not isinstance(value, dict):
                    raise SimulationError("`moe:` must be a mapping")
                params["moe"] = {**params["moe"], **value}
            else:
                params[canon] = copy.deepcopy(value)
        elif canon in UNSIMULATED:
            if value != UNSIMULATED[canon] and value is not None and value != [] and value is not False:
                raise SimulationError(
                    f"model.{key} = {value!r} is not simulated",
                    hint=f"the simulator supports only {key}: {UNSIMULATED[canon]!r}",
                )
        elif canon == "memory_tokens" and isinstance(value, dict) and value.get("memory_tokens_enabled"):
            raise SimulationError("model.memory_tokens is not simulated", hint="disable memory tokens")
        elif canon not in HARMLESS:
            ignored.append(key)
    _finish(class_name, params)
    return CsModelConfig(name, class_name, params, dict(section), tuple(ignored))


def _require(params: dict[str, Any], key: str, class_name: str) -> None:
    if params.get(key) is None:
        raise SimulationError(f"{class_name} needs `{key}` in the model section")


def _finish(class_name: str, p: dict[str, Any]) -> None:
    """Derived defaults, as the Model Zoo config classes compute them after validation."""
    if class_name in (GPT2, GPTJ):
        if p["embedding_dropout_rate"] is None:
            p["embedding_dropout_rate"] = p["dropout_rate"]
        if p["attention_dropout_rate"] is None:
            p["attention_dropout_rate"] = p["dropout_rate"]
        if p["position_embedding_type"] == "rotary" and p["rotary_dim"] is None:
            p["rotary_dim"] = int(p["hidden_size"] // p["num_heads"] * 0.25)
        if p["scale_qk_dot_by_d"] is None:
            p["scale_qk_dot_by_d"] = bool(p["mup_base_hidden_size"])
        moe = p["moe"]
        if moe.get("num_shared_experts"):
            raise SimulationError("moe.num_shared_experts is not simulated")
        if moe["num_experts"] > 1 and moe.get("routing_algorithm", "learned") != "learned":
            raise SimulationError(f"moe.routing_algorithm {moe['routing_algorithm']!r} is not simulated")
        if p.get("sliding_window_every_other_decoder_layer") and p["attention_sliding_window_length"] is None:
            raise SimulationError(
                "sliding_window_every_other_decoder_layer needs attention_sliding_window_length",
            )
        if p["pos_scaling_type"] and str(p["pos_scaling_type"]).lower() not in ("linear", "yarn", "llama3"):
            raise SimulationError(f"pos_scaling_type {p['pos_scaling_type']!r} is not simulated")
        if p["attention_module"] not in ("aiayn_attention", "multiquery_attention"):
            raise SimulationError(f"attention_module {p['attention_module']!r} is not supported")
    elif class_name in (BERT, BERT_SEQ, BERT_TOKEN, BERT_QA):
        _require(p, "vocab_size", class_name)
        if p["position_embedding_type"] == "learned":
            _require(p, "max_position_embeddings", class_name)
        if p["attention_dropout_rate"] is None:
            p["attention_dropout_rate"] = p["dropout_rate"]
        if p["mlm_nonlinearity"] is None:
            p["mlm_nonlinearity"] = p["encoder_nonlinearity"]
        if p["pooler_nonlinearity"] is None:
            p["pooler_nonlinearity"] = p["encoder_nonlinearity"]
        if p["num_segments"] is None and not p.get("disable_nsp", False):
            p["num_segments"] = 2
        if p["scale_qk_dot_by_d"] is None:
            p["scale_qk_dot_by_d"] = bool(p["mup_base_hidden_size"])
        if p["position_embedding_type"] == "rotary" and p["rotary_dim"] is None:
            p["rotary_dim"] = int(p["hidden_size"] // p["num_heads"] * 0.25)
    elif class_name == T5:
        if p["tgt_vocab_size"] is None:
            p["tgt_vocab_size"] = p["src_vocab_size"]
        if p["decoder_num_hidden_layers"] is None:
            p["decoder_num_hidden_layers"] = p["encoder_num_hidden_layers"]
        if p["relu_dropout_rate"] is None:
            p["relu_dropout_rate"] = p["dropout_rate"]
        if p["position_embedding_type"] != "relative":
            raise SimulationError(f"T5 position_embedding_type {p['position_embedding_type']!r} is not simulated")
        for k in ("encoder_nonlinearity", "decoder_nonlinearity"):
            if p[k] not in ("relu", "gelu", "reglu", "geglu", "swiglu"):
                raise SimulationError(f"T5 {k} {p[k]!r} is not supported by the Model Zoo T5")
        if p["share_encoder_decoder_embedding"] and p["src_vocab_size"] != p["tgt_vocab_size"]:
            raise SimulationError("share_encoder_decoder_embedding needs src_vocab_size == tgt_vocab_size")
        if p["use_transformer_initialization"]:
            raise SimulationError("use_transformer_initialization (the `transformer` variant) is not simulated")
