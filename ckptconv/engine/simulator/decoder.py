"""Decoder-only language models as the Model Zoo builds them: ``GPT2LMHeadModel`` and ``GPTJModel``.

``GPT2LMHeadModel`` is the Cerebras class behind gpt2, llama/mistral, mixtral, bloom, starcoder,
santacoder, btlm/jais and gemma2 (each a configuration of it); ``GPTJModel`` is behind gpt-j,
gpt-neox, codegen and falcon (parallel attention + MLP, tied or untied norms).

State-dict keys (CS >= 2.1)::

    embedding_layer.word_embeddings.weight
    embedding_layer.position_embeddings.embed.weight      (learned)  | .fpe (fixed)
    embedding_layer.position_embed_helper.slopes          (alibi)
    embedding_ln_f.*                                      (embedding_layer_norm)
    transformer_decoder.layers.{i}.self_attn.proj_{q,k,v,output}_dense_layer.*
    transformer_decoder.layers.{i}.norm1.* / norm3.*      (+ norm1_post / norm3_post, sandwich norms)
    transformer_decoder.layers.{i}.ffn.ffn.{0,1}.linear_layer(_for_glu).*
    transformer_decoder.layers.{i}.ffn.gate.weight, ffn.experts.fused_ffns.{0,1}.linear_layer(_for_glu).expert_weights
    transformer_decoder.norm.*  and  ln_f.*               (one module, two names)
    lm_head.weight (+ bias)                               (tied to the word embeddings when shared)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ckptconv.core.errors import SimulationError
from ckptconv.engine.simulator import config as cfg
from ckptconv.engine.simulator.feedforward import FeedForwardNetwork, SparseMoE
from ckptconv.engine.simulator.layers import Attention, causal_mask, check_activation, make_norm
from ckptconv.engine.simulator.positions import (
    AlibiBias,
    FixedPositionEmbedding,
    LearnedPositionEmbedding,
    RelativePositionBias,
    RotaryHelper,
)


class EmbeddingLayer(nn.Module):
    """Token, position and segment embeddings with the Model Zoo's attribute names."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        *,
        position_embedding_type: str | None,
        max_positions: int | None,
        num_heads: int | None = None,
        position_offset: int = 0,
        mask_padding: bool = False,
        pad_token_id: int | None = None,
        num_segments: int | None = None,
        rotary_dim: int | None = None,
        rope_theta: float = 10000.0,
        pos_scaling_factor: float = 1.0,
        pos_scaling_type: str = "linear",
        pos_scaling_extra_args: dict | None = None,
        alibi_trainable_slopes: bool = False,
        num_relative_buckets: int = 32,
        relative_bidirectional: bool = False,
    ) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, dim, padding_idx=pad_token_id)
        self.position_embeddings: nn.Module | None = None
        self.position_embed_helper: nn.Module | None = None
        self.rotary: RotaryHelper | None = None
        kind = position_embedding_type
        if kind is not None and max_positions is None:
            raise SimulationError("max_position_embeddings must be set when position embeddings are used")
        if pos_scaling_factor != 1.0 and kind not in ("rotary", "alibi"):
            raise SimulationError("pos_scaling_factor is only supported for ALiBi and RoPE")
        if kind == "learned":
            self.position_embeddings = LearnedPositionEmbedding(
                max_positions, dim, offset=position_offset, mask_padding=mask_padding, pad_token_id=pad_token_id or 0
            )
        elif kind == "fixed":
            self.position_embeddings = FixedPositionEmbedding(max_positions, dim)
        elif kind == "rotary":
            self.rotary = RotaryHelper(
                rotary_dim,
                max_positions,
                base=rope_theta,
                scaling_factor=pos_scaling_factor,
                scaling_type=pos_scaling_type,
                extra_args=pos_scaling_extra_args,
            )
        elif kind == "alibi":
            self.position_embed_helper = AlibiBias(
                num_heads, trainable=alibi_trainable_slopes, scaling_factor=pos_scaling_factor
            )
        elif kind == "relative":
            self.position_embed_helper = RelativePositionBias(
                num_heads, num_relative_buckets, bidirectional=relative_bidirectional
            )
        elif kind is not None:
            raise SimulationError(f"position_embedding_type {kind!r} is not supported")
        self.segment_embeddings = nn.Embedding(num_segments, dim) if num_segments else None

    def forward(self, input_ids: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(input_ids).to(x.dtype)
        if segment_ids is not None and self.segment_embeddings is not None:
            x = x + self.segment_embeddings(segment_ids)
        return x

    def position_bias(self, q_len: int, k_len: int) -> torch.Tensor | None:
        if self.position_embed_helper is None:
            return None
        return self.position_embed_helper(q_len, k_len)


class DecoderLayer(nn.Module):
    """Pre-LN (optionally sandwiched), post-LN, or GPT-J parallel block; optional cross-attention."""

    def __init__(
        self,
        d_model: int,
        attention: Attention,
        ffn: nn.Module,
        *,
        norm: tuple[str, float],
        norm_first: bool = True,
        sandwich: bool = False,
        parallel: bool = False,
        untied_norm: bool = True,
        cross_attention: Attention | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        norm_type, eps = norm
        self.self_attn = attention
        self.norm1 = make_norm(norm_type, d_model, eps)
        self.dropout1 = nn.Dropout(dropout)
        self.norm3 = make_norm(norm_type, d_model, eps) if (untied_norm or not parallel) else None
        if cross_attention is not None:
            self.multihead_attn = cross_attention
            self.norm2 = make_norm(norm_type, d_model, eps)
            self.dropout2 = nn.Dropout(dropout)
        else:
            self.multihead_attn = None
        if sandwich:
            self.norm1_post = make_norm(norm_type, d_model, eps)
            self.norm3_post = make_norm(norm_type, d_model, eps)
        self.ffn = ffn
        self.norm_first = norm_first
        self.sandwich = sandwich
        self.parallel = parallel

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        position_bias: torch.Tensor | None = None,
        rotary: RotaryHelper | None = None,
        layer_idx: int = 0,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        def sa(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(h, mask=mask, position_bias=position_bias, rotary=rotary, layer_idx=layer_idx)

        if self.parallel:
            h = self.norm1(x)
            attn = self.dropout1(sa(h))
            ffn_in = self.norm3(x) if self.norm3 is not None else h
            return x + self.ffn(ffn_in) + attn
        if self.norm_first:
            a = sa(self.norm1(x))
            if self.sandwich:
                a = self.norm1_post(a)
            x = x + self.dropout1(a)
            if self.multihead_attn is not None:
                c = self.multihead_attn(self.norm2(x), memory, mask=memory_mask, layer_idx=layer_idx)
                x = x + self.dropout2(c)
            f = self.ffn(self.norm3(x))
            if self.sandwich:
                f = self.norm3_post(f)
            return x + f
        x = self.norm1(x + self.dropout1(sa(x)))
        if self.multihead_attn is not None:
            c = self.multihead_attn(x, memory, mask=memory_mask, layer_idx=layer_idx)
            x = self.norm2(x + self.dropout2(c))
        return self.norm3(x + self.ffn(x))


class TransformerStack(nn.Module):
    """``layers`` plus the final ``norm`` (the module that the LM also exposes as ``ln_f``)."""

    def __init__(self, layers: list[nn.Module], norm: nn.Module | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm


def _attention_for(p: dict, *, layer_softcap: float | None = None) -> Attention:
    kv_groups = None
    if p["attention_module"] == "multiquery_attention":
        kv_groups = int((p.get("extra_attention_params") or {}).get("num_kv_groups", 1))
    return Attention(
        p["hidden_size"],
        p["num_heads"],
        inner_dim=p.get("attention_inner_dim"),
        kv_groups=kv_groups,
        use_projection_bias=p["use_projection_bias_in_attention"],
        use_output_bias=p["use_ffn_bias_in_attention"],
        attention_type=p["attention_type"],
        scale_qk_dot_by_d=bool(p["scale_qk_dot_by_d"]),
        logits_alpha=float(p["attention_logits_alpha"] or 1.0),
        scale_qk_dot_by_layer_idx=bool(p.get("scale_qk_dot_by_layer_idx")),
        logit_softcapping=layer_softcap,
        softmax_fp32=bool(p["attention_softmax_fp32"]),
        dropout=float(p["attention_dropout_rate"] or 0.0),
        qk_norm=p.get("attention_qk_norm_layer"),
        qk_norm_eps=float(p.get("attention_qk_norm_eps", 1e-5)),
    )


def _ffn_for(p: dict) -> nn.Module:
    check_activation(p["nonlinearity"])
    moe = p["moe"]
    if moe["num_experts"] > 1:
        return SparseMoE(
            p["hidden_size"],
            p["filter_size"],
            num_experts=int(moe["num_experts"]),
            top_k=int(moe["top_k"]),
            bias=p["use_ffn_bias"],
            activation=p["nonlinearity"],
            normalize=bool(moe.get("expert_weighting_normalization", True)),
            router_fp32=bool(moe.get("router_fp32", True)),
        )
    ff1_dropout = p["dropout_rate"] if p.get("use_ff_layer1_dropout") else None
    return FeedForwardNetwork(
        p["hidden_size"],
        [p["filter_size"], p["hidden_size"]],
        activations=[p["nonlinearity"], None],
        dropouts=[ff1_dropout, p["dropout_rate"]],
        bias=p["use_ffn_bias"],
    )


class CsDecoderLM(nn.Module):
    """``GPT2LMHeadModel`` / ``GPTJModel``: ``forward(input_ids) -> logits [B, S, vocab]``."""

    def __init__(self, config: cfg.CsModelConfig) -> None:
        super().__init__()
        p = config.params
        self.config = config
        gptj = config.class_name == cfg.GPTJ
        hidden = p["hidden_size"]
        if hidden % p["num_heads"]:
            raise SimulationError(f"hidden_size {hidden} is not divisible by num_heads {p['num_heads']}")
        inner = p.get("attention_inner_dim") or hidden
        if p["position_embedding_type"] == "rotary":
            rd = p["rotary_dim"]
            if rd > inner // p["num_heads"] or rd % 2:
                raise SimulationError(
                    f"rotary_dim {rd} must be even and at most the head dim {inner // p['num_heads']}"
                )
        self.embedding_layer = EmbeddingLayer(
            p["vocab_size"],
            hidden,
            position_embedding_type=p["position_embedding_type"],
            max_positions=p["max_position_embeddings"],
            num_heads=p["num_heads"],
            position_offset=int(p.get("position_embedding_offset", 0) or 0),
            rotary_dim=p.get("rotary_dim"),
            rope_theta=float(p["rope_theta"]),
            pos_scaling_factor=float(p["pos_scaling_factor"]),
            pos_scaling_type=p["pos_scaling_type"],
            pos_scaling_extra_args=p.get("pos_scaling_extra_args"),
            alibi_trainable_slopes=bool(p["alibi_trainable_slopes"]),
            num_relative_buckets=int(p.get("num_relative_attention_buckets") or 32),
        )
        norm = (p["norm_type"], float(p["layer_norm_epsilon"]))
        if p.get("embedding_layer_norm"):
            if gptj:
                raise SimulationError("GPTJModel has no embedding layer norm (embedding_layer_norm must be false)")
            self.embedding_ln_f = make_norm(norm[0], hidden, norm[1])
        else:
            self.embedding_ln_f = None
        self.drop_embd = nn.Dropout(float(p["embedding_dropout_rate"] or 0.0))
        layers = [
            DecoderLayer(
                hidden,
                _attention_for(p, layer_softcap=p.get("attention_logit_softcapping")),
                _ffn_for(p),
                norm=norm,
                norm_first=bool(p.get("norm_first", True)),
                sandwich=bool(p.get("norm_first_sandwich")),
                parallel=gptj,
                untied_norm=bool(p.get("use_untied_layer_norm", True)) if gptj else True,
                dropout=float(p["dropout_rate"] or 0.0),
            )
            for _ in range(p["num_hidden_layers"])
        ]
        self.ln_f = make_norm(norm[0], hidden, norm[1])
        self.transformer_decoder = TransformerStack(layers, self.ln_f)
        self.lm_head = nn.Linear(hidden, p["vocab_size"], bias=bool(p["use_bias_in_output"]))
        self.share_embedding_weights = bool(p["share_embedding_weights"])
        self.tie_weights()
        self.embeddings_scale = float(p.get("embeddings_scale") or 1.0)
        self.output_logits_scale = _output_logits_scale(p)
        self.final_logit_softcapping = p.get("final_logit_softcapping")
        self.window = p.get("attention_sliding_window_length")
        self.window_every_other = bool(p.get("sliding_window_every_other_decoder_layer"))

    def tie_weights(self) -> None:
        if self.share_embedding_weights:
            self.lm_head.weight = self.embedding_layer.word_embeddings.weight

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final-norm output, before ``lm_head`` (what a headless Hugging Face model returns)."""
        x = self.embedding_layer(input_ids)
        if self.embedding_ln_f is not None:
            x = self.embedding_ln_f(x)
        x = x * torch.tensor(self.embeddings_scale, dtype=x.dtype)
        x = self.drop_embd(x)
        seq = input_ids.shape[1]
        dense = causal_mask(seq, window=None if self.window_every_other else self.window, dtype=x.dtype)
        # Model Zoo default pattern "full_attention_first": even layers dense, odd layers windowed.
        sparse = causal_mask(seq, window=self.window, dtype=x.dtype) if self.window_every_other else dense
        bias = self.embedding_layer.position_bias(seq, seq)
        rotary = self.embedding_layer.rotary
        for i, layer in enumerate(self.transformer_decoder.layers):
            x = layer(x, mask=dense if i % 2 == 0 else sparse, position_bias=bias, rotary=rotary, layer_idx=i)
        return self.transformer_decoder.norm(x)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.hidden_states(input_ids))
        if self.output_logits_scale:
            logits = logits * torch.tensor(float(self.output_logits_scale), dtype=logits.dtype)
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits


def _output_logits_scale(p: dict) -> float | None:
    base = p.get("mup_base_hidden_size")
    if base:
        width = p["hidden_size"] / base
        alpha = p.get("output_logits_alpha") or 1.0
        return alpha / width if p.get("scale_output_logits_by_d", True) else alpha / math.sqrt(width)
    return p.get("output_logits_scale")


__all__ = ["CsDecoderLM", "DecoderLayer", "EmbeddingLayer", "RelativePositionBias", "TransformerStack"]
