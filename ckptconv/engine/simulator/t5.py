"""T5 as the Model Zoo builds it (``T5ForConditionalGeneration``).

Keys::

    {encoder,decoder}_embeddings.word_embeddings.weight            (one shared module by default)
    {encoder,decoder}_embeddings.position_embed_helper.relative_attention_bias.weight
    encoder.layers.{i}.self_attn.proj_{q,k,v,output}_dense_layer.weight, norm1, norm2, ffn.ffn.{0,1}...
    decoder.layers.{i}.self_attn..., multihead_attn..., norm1, norm2, norm3, ffn...
    {encoder,decoder}.norm.weight
    lm_head.weight                                                  (tied to the embeddings when shared)

Attention is unscaled (``dot_product``), projections have no bias, norms are RMS norms, and with
tied embeddings the decoder output is scaled by ``d_model ** -0.5`` before ``lm_head``.
The decoder's feed-forward uses the *encoder* nonlinearity, as the Model Zoo class does.
"""

from __future__ import annotations

import torch
from torch import nn

from ckptconv.engine.simulator import config as cfg
from ckptconv.engine.simulator.decoder import DecoderLayer, EmbeddingLayer, TransformerStack
from ckptconv.engine.simulator.encoder import EncoderLayer
from ckptconv.engine.simulator.feedforward import FeedForwardNetwork
from ckptconv.engine.simulator.layers import Attention, causal_mask, make_norm, padding_mask


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, config: cfg.CsModelConfig) -> None:
        super().__init__()
        p = config.params
        self.config = config
        d_model, heads = p["d_model"], p["num_heads"]
        inner = p["d_kv"] * heads
        buckets = int(p["relative_attention_num_buckets"])
        self.encoder_embeddings = EmbeddingLayer(
            p["src_vocab_size"],
            d_model,
            position_embedding_type="relative",
            max_positions=p["src_max_position_embeddings"],
            num_heads=heads,
            num_relative_buckets=buckets,
            relative_bidirectional=True,
        )
        self.decoder_embeddings = EmbeddingLayer(
            p["tgt_vocab_size"],
            d_model,
            position_embedding_type="relative",
            max_positions=p["tgt_max_position_embeddings"],
            num_heads=heads,
            num_relative_buckets=buckets,
            relative_bidirectional=False,
        )
        self.share_encoder_decoder_embedding = bool(p["share_encoder_decoder_embedding"])
        if self.share_encoder_decoder_embedding:
            self.decoder_embeddings.word_embeddings = self.encoder_embeddings.word_embeddings
        norm = (p["norm_type"], float(p["layer_norm_epsilon"]))
        dropout = float(p["dropout_rate"])
        act = p["encoder_nonlinearity"]

        def attention(kv_dim: int | None = None) -> Attention:
            return Attention(
                d_model,
                heads,
                inner_dim=inner,
                kv_dim=kv_dim,
                use_projection_bias=bool(p["use_projection_bias_in_attention"]),
                use_output_bias=False,
                attention_type="dot_product",
                softmax_fp32=bool(p["attention_softmax_fp32"]),
                dropout=dropout,
            )

        def ffn() -> FeedForwardNetwork:
            return FeedForwardNetwork(
                d_model,
                [p["d_ff"], d_model],
                activations=[act, None],
                dropouts=[float(p["relu_dropout_rate"]), dropout],
                bias=bool(p["use_ffn_bias"]),
            )

        pre_ln = bool(p["use_pre_encoder_decoder_layer_norm"])
        self.encoder = TransformerStack(
            [
                EncoderLayer(d_model, attention(), ffn(), norm=norm, norm_first=pre_ln, dropout=dropout)
                for _ in range(p["encoder_num_hidden_layers"])
            ],
            make_norm(norm[0], d_model, norm[1]),
        )
        self.decoder = TransformerStack(
            [
                DecoderLayer(
                    d_model,
                    attention(),
                    ffn(),
                    norm=norm,
                    norm_first=pre_ln,
                    cross_attention=attention(d_model),
                    dropout=dropout,
                )
                for _ in range(p["decoder_num_hidden_layers"])
            ],
            make_norm(norm[0], d_model, norm[1]),
        )
        self.dropout = nn.Dropout(dropout)
        self.use_dropout_outside_residual_path = bool(p["use_dropout_outside_residual_path"])
        self.lm_head = nn.Linear(d_model, p["tgt_vocab_size"], bias=False)
        self.share_embedding_weights = bool(p["share_embedding_weights"])
        self.d_model = d_model
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.share_encoder_decoder_embedding:
            self.decoder_embeddings.word_embeddings = self.encoder_embeddings.word_embeddings
        if self.share_embedding_weights:
            self.lm_head.weight = self.encoder_embeddings.word_embeddings.weight

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.dropout(self.encoder_embeddings(input_ids))
        mask = padding_mask(attention_mask, x.dtype) if attention_mask is not None else None
        seq = input_ids.shape[1]
        bias = self.encoder_embeddings.position_bias(seq, seq)
        for i, layer in enumerate(self.encoder.layers):
            x = layer(x, mask=mask, position_bias=bias, layer_idx=i)
        x = self.encoder.norm(x)
        return self.dropout(x) if self.use_dropout_outside_residual_path else x

    def forward(
        self,
        input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        memory = self.encode(input_ids, attention_mask)
        memory_mask = padding_mask(attention_mask, memory.dtype) if attention_mask is not None else None
        y = self.dropout(self.decoder_embeddings(decoder_input_ids))
        seq = decoder_input_ids.shape[1]
        mask = causal_mask(seq, dtype=y.dtype)
        bias = self.decoder_embeddings.position_bias(seq, seq)
        for i, layer in enumerate(self.decoder.layers):
            y = layer(y, mask=mask, position_bias=bias, layer_idx=i, memory=memory, memory_mask=memory_mask)
        y = self.decoder.norm(y)
        if self.use_dropout_outside_residual_path:
            y = self.dropout(y)
        if self.share_embedding_weights:
            y = y * (self.d_model**-0.5)
        return self.lm_head(y)
