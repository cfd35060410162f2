"""Build the Cerebras-side model a resolved config describes."""

from __future__ import annotations

import torch
from torch import nn

from ckptconv.engine.simulator import config as cfg
from ckptconv.engine.simulator.decoder import CsDecoderLM
from ckptconv.engine.simulator.encoder import (
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertPretrainModel,
)
from ckptconv.engine.simulator.t5 import T5ForConditionalGeneration


def model_class(class_name: str) -> type[nn.Module]:
    return {
        cfg.GPT2: CsDecoderLM,
        cfg.GPTJ: CsDecoderLM,
        cfg.BERT: BertPretrainModel,
        cfg.BERT_SEQ: BertForSequenceClassification,
        cfg.BERT_TOKEN: BertForTokenClassification,
        cfg.BERT_QA: BertForQuestionAnswering,
        cfg.T5: T5ForConditionalGeneration,
    }[class_name]


def build_model(config: cfg.CsModelConfig, *, materialize: str = "init", seed: int = 0) -> nn.Module:
    """The model for ``config`` in float32 on CPU.

    ``materialize="init"``: parameters initialised deterministically from ``seed`` (training from
    scratch, or non-strict loading where missing tensors keep their initial values).
    ``materialize="empty"``: parameters allocated but not initialised; every one must then be
    loaded (strict loading), which saves the cost of random initialisation on large models.
    """
    klass = model_class(config.class_name)
    if materialize == "empty":
        with torch.device("meta"):
            model = klass(config)
        model = model.to_empty(device="cpu")
        _retie(model)
        return model
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = klass(config)
        init_weights(model, config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model


def _retie(model: nn.Module) -> None:
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()


@torch.no_grad()
def init_weights(model: nn.Module, config: cfg.CsModelConfig) -> None:
    """Model Zoo-style initialisation: normal(0, initializer_range) weights, zero biases, unit norms."""
    std = float(config.params.get("initializer_range", 0.02) or 0.02)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            if module.weight is not None:
                module.weight.fill_(1.0)
            if module.bias is not None:
                module.bias.zero_()
        elif name.endswith("linear_layer") or name.endswith("linear_layer_for_glu"):
            weights = getattr(module, "expert_weights", None)
            if weights is not None:
                weights.normal_(0.0, std)
                if getattr(module, "expert_biases", None) is not None:
                    module.expert_biases.zero_()
    _retie(model)
