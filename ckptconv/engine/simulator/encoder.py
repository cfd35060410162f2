"""BERT-style encoders as the Model Zoo builds them: pretraining (BERT, RoBERTa) and fine-tune heads.

Pretraining keys (``BertPretrainModel``)::

    bert_encoder.embedding_layer.{word,segment}_embeddings.weight
    bert_encoder.embedding_layer.position_embeddings.embed.weight
    bert_encoder.embed_ln_f.*
    bert_encoder.transformer_encoder.layers.{i}.self_attn.proj_{q,k,v,output}_dense_layer.*
    bert_encoder.transformer_encoder.layers.{i}.norm1.* / ffn.ffn.{0,1}.linear_layer.* / norm2.*
    bert_encoder.pooler.pooler.ffn.0.linear_layer.*                  (unless disable_nsp)
    bert_mlm_head.mlm_transform.ffn.ffn.0.linear_layer.* / mlm_transform.ln.*
    bert_mlm_head.classifier.ffn.0.linear_layer.*                     (weight tied to word embeddings)
    bert_cls_head.classifier.ffn.0.linear_layer.*                     (unless disable_nsp)

Fine-tune models keep ``bert.`` for the encoder and add ``classifier.{weight,bias}``.
"""

from __future__ import annotations

import torch
from torch import nn

from ckptconv.core.errors import SimulationError
from ckptconv.engine.simulator import config as cfg
from ckptconv.engine.simulator.decoder import EmbeddingLayer, TransformerStack
from ckptconv.engine.simulator.feedforward import FeedForwardNetwork
from ckptconv.engine.simulator.layers import Attention, check_activation, make_norm, padding_mask


class EncoderLayer(nn.Module):
    """Self-attention (``norm1``) and feed-forward (``norm2``), post-LN or pre-LN."""

    def __init__(
        self,
        d_model: int,
        attention: Attention,
        ffn: nn.Module,
        *,
        norm: tuple[str, float],
        norm_first: bool,
        dropout: float,
    ) -> None:
        super().__init__()
        self.self_attn = attention
        self.norm1 = make_norm(norm[0], d_model, norm[1])
        self.dropout1 = nn.Dropout(dropout)
        self.norm2 = make_norm(norm[0], d_model, norm[1])
        self.ffn = ffn
        self.norm_first = norm_first

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        position_bias: torch.Tensor | None = None,
        rotary=None,
        layer_idx: int = 0,
    ) -> torch.Tensor:
        def sa(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(h, mask=mask, position_bias=position_bias, rotary=rotary, layer_idx=layer_idx)

        if self.norm_first:
            x = x + self.dropout1(sa(self.norm1(x)))
            return x + self.ffn(self.norm2(x))
        x = self.norm1(x + self.dropout1(sa(x)))
        return self.norm2(x + self.ffn(x))


class BertPooler(nn.Module):
    def __init__(self, hidden: int, *, bias: bool, activation: str) -> None:
        super().__init__()
        self.pooler = FeedForwardNetwork(hidden, [hidden], activations=[activation], bias=bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.pooler(hidden_states[:, 0])


class BertModel(nn.Module):
    """``forward(input_ids, segment_ids, attention_mask) -> (sequence_output, pooled_output | None)``."""

    def __init__(self, p: dict, *, add_pooling_layer: bool) -> None:
        super().__init__()
        hidden = p["hidden_size"]
        check_activation(p["encoder_nonlinearity"], field="encoder_nonlinearity")
        if p["attention_module"] != "aiayn_attention" and p["attention_module"] != "multiquery_attention":
            raise SimulationError(f"attention_module {p['attention_module']!r} is not supported")
        pad = p.get("pad_token_id")
        self.embedding_layer = EmbeddingLayer(
            p["vocab_size"],
            hidden,
            position_embedding_type=p["position_embedding_type"],
            max_positions=p["max_position_embeddings"],
            num_heads=p["num_heads"],
            position_offset=(pad or 0) if p["mask_padding_in_positional_embed"] else 0,
            mask_padding=bool(p["mask_padding_in_positional_embed"]),
            pad_token_id=pad,
            num_segments=p.get("num_segments"),
            rotary_dim=p.get("rotary_dim"),
            rope_theta=float(p["rope_theta"]),
            pos_scaling_factor=float(p["pos_scaling_factor"]),
            alibi_trainable_slopes=bool(p["alibi_trainable_slopes"]),
            num_relative_buckets=int(p["num_relative_attention_buckets"]),
            relative_bidirectional=True,
        )
        self.embeddings_scale = float(p.get("embeddings_scale") or 1.0)
        norm = ("layernorm", float(p["layer_norm_epsilon"]))
        self.embed_ln_f = nn.LayerNorm(hidden, eps=norm[1]) if p.get("embedding_layer_norm", True) else None
        self.dropout_embd = nn.Dropout(float(p["dropout_rate"]))
        kv_groups = None
        if p["attention_module"] == "multiquery_attention":
            kv_groups = int((p.get("extra_attention_params") or {}).get("num_kv_groups", 1))
        layers = [
            EncoderLayer(
                hidden,
                Attention(
                    hidden,
                    p["num_heads"],
                    kv_groups=kv_groups,
                    use_projection_bias=p["use_projection_bias_in_attention"],
                    use_output_bias=p["use_ffn_bias_in_attention"],
                    attention_type=p["attention_type"],
                    scale_qk_dot_by_d=bool(p["scale_qk_dot_by_d"]),
                    logits_alpha=float(p.get("attention_logits_alpha") or 1.0),
                    softmax_fp32=bool(p["attention_softmax_fp32"]),
                    dropout=float(p["attention_dropout_rate"]),
                ),
                FeedForwardNetwork(
                    hidden,
                    [p["filter_size"], hidden],
                    activations=[p["encoder_nonlinearity"], None],
                    dropouts=[p["dropout_rate"], p["dropout_rate"]],
                    bias=p["use_ffn_bias"],
                ),
                norm=norm,
                norm_first=bool(p.get("norm_first", False)),
                dropout=float(p["dropout_rate"]),
            )
            for _ in range(p["num_hidden_layers"])
        ]
        final = nn.LayerNorm(hidden, eps=norm[1]) if p.get("use_final_layer_norm") else None
        self.transformer_encoder = TransformerStack(layers, final)
        self.pooler = (
            BertPooler(hidden, bias=p["use_ffn_bias"], activation=p["pooler_nonlinearity"])
            if add_pooling_layer
            else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embedding_layer(input_ids, segment_ids)
        x = x * torch.tensor(self.embeddings_scale, dtype=x.dtype)
        if self.embed_ln_f is not None:
            x = self.embed_ln_f(x)
        x = self.dropout_embd(x)
        mask = padding_mask(attention_mask, x.dtype) if attention_mask is not None else None
        seq = input_ids.shape[1]
        bias = self.embedding_layer.position_bias(seq, seq)
        rotary = self.embedding_layer.rotary
        for i, layer in enumerate(self.transformer_encoder.layers):
            x = layer(x, mask=mask, position_bias=bias, rotary=rotary, layer_idx=i)
        if self.transformer_encoder.norm is not None:
            x = self.transformer_encoder.norm(x)
        pooled = self.pooler(x) if self.pooler is not None else None
        return x, pooled


class ClassifierHead(nn.Module):
    """``classifier.ffn.0.linear_layer``: one linear layer, no activation."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, activation: str | None = None) -> None:
        super().__init__()
        self.classifier = FeedForwardNetwork(d_in, [d_out], activations=[activation], bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x)


class MLMHeadTransform(nn.Module):
    def __init__(self, hidden: int, *, bias: bool, activation: str, eps: float) -> None:
        super().__init__()
        self.ffn = FeedForwardNetwork(hidden, [hidden], activations=[activation], bias=bias)
        self.ln = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.ffn(x))


class BertMLMHead(nn.Module):
    def __init__(self, p: dict) -> None:
        super().__init__()
        check_activation(p["mlm_nonlinearity"], field="mlm_nonlinearity")
        hidden = p["hidden_size"]
        self.mlm_transform = MLMHeadTransform(
            hidden, bias=p["use_ffn_bias_in_mlm"], activation=p["mlm_nonlinearity"], eps=float(p["layer_norm_epsilon"])
        )
        self.classifier = FeedForwardNetwork(hidden, [p["vocab_size"]], bias=p["use_output_bias_in_mlm"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.mlm_transform(x))


class BertPretrainModel(nn.Module):
    """``forward(...) -> {"mlm_logits": [B, S, vocab], "nsp_logits": [B, num_classes]}``."""

    def __init__(self, config: cfg.CsModelConfig) -> None:
        super().__init__()
        p = config.params
        self.config = config
        self.disable_nsp = bool(p["disable_nsp"])
        self.bert_encoder = BertModel(p, add_pooling_layer=not self.disable_nsp)
        if not self.disable_nsp:
            self.bert_cls_head = ClassifierHead(p["hidden_size"], p["num_classes"], bias=p["use_ffn_bias"])
        else:
            self.bert_cls_head = None
        self.bert_mlm_head = BertMLMHead(p)
        self.share_embedding_weights = bool(p["share_embedding_weights"])
        self.output_logits_scale = _mup_output_scale(p)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.share_embedding_weights:
            self.bert_mlm_head.classifier.ffn[
                0
            ].linear_layer.weight = self.bert_encoder.embedding_layer.word_embeddings.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        seq_out, pooled = self.bert_encoder(input_ids, segment_ids, attention_mask)
        mlm = self.bert_mlm_head(seq_out)
        if self.output_logits_scale:
            mlm = mlm * torch.tensor(self.output_logits_scale, dtype=mlm.dtype)
        out = {"mlm_logits": mlm}
        if self.bert_cls_head is not None:
            nsp = self.bert_cls_head(pooled)
            if self.output_logits_scale:
                nsp = nsp * torch.tensor(self.output_logits_scale, dtype=nsp.dtype)
            out["nsp_logits"] = nsp
        return out


class BertForSequenceClassification(nn.Module):
    def __init__(self, config: cfg.CsModelConfig) -> None:
        super().__init__()
        p = config.params
        self.config = config
        self.bert = BertModel(p, add_pooling_layer=True)
        dropout = p.get("task_dropout")
        self.dropout = nn.Dropout(float(p["dropout_rate"] if dropout is None else dropout))
        self.classifier = nn.Linear(p["hidden_size"], int(p["num_labels"]))

    def forward(self, input_ids, segment_ids=None, attention_mask=None) -> dict[str, torch.Tensor]:
        _, pooled = self.bert(input_ids, segment_ids, attention_mask)
        return {"logits": self.classifier(self.dropout(pooled))}


class BertForTokenClassification(nn.Module):
    def __init__(self, config: cfg.CsModelConfig) -> None:
        super().__init__()
        p = config.params
        self.config = config
        self.bert = BertModel(p, add_pooling_layer=False)
        dropout = p.get("encoder_output_dropout_rate")
        self.dropout = nn.Dropout(float(p["dropout_rate"] if dropout is None else dropout))
        self.classifier = nn.Linear(p["hidden_size"], int(p["num_classes"]))

    def forward(self, input_ids, segment_ids=None, attention_mask=None) -> dict[str, torch.Tensor]:
        seq, _ = self.bert(input_ids, segment_ids, attention_mask)
        return {"logits": self.classifier(self.dropout(seq))}


class BertForQuestionAnswering(nn.Module):
    def __init__(self, config: cfg.CsModelConfig) -> None:
        super().__init__()
        p = config.params
        self.config = config
        self.bert = BertModel(p, add_pooling_layer=False)
        self.classifier = nn.Linear(p["hidden_size"], 2)

    def forward(self, input_ids, segment_ids=None, attention_mask=None) -> dict[str, torch.Tensor]:
        seq, _ = self.bert(input_ids, segment_ids, attention_mask)
        logits = self.classifier(seq)
        start, end = logits.split(1, dim=-1)
        return {"start_logits": start.squeeze(-1), "end_logits": end.squeeze(-1)}


def _mup_output_scale(p: dict) -> float | None:
    base = p.get("mup_base_hidden_size")
    if not base:
        return None
    width = p["hidden_size"] / base
    alpha = p.get("output_logits_alpha") or 1.0
    return alpha / width if p.get("scale_output_logits_by_d", True) else alpha / width**0.5
