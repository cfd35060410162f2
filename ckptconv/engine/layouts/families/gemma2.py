"""The config hook of the Gemma 2 table (``gemma2.yaml`` beside this module): the part of its
config conversion the table cannot say as data."""

from __future__ import annotations

import math
from typing import Any

from ckptconv.engine.layouts.hooks import Ctx, fail, hook


@hook("gemma2")
class _Gemma2:
    """Gemma 2: attention inner dim, embeddings scale, query pre-attention scalar."""

    reads = ("head_dim", "query_pre_attn_scalar", "attention_bias")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        cs["attention_inner_dim"] = head_dim * heads
        cs["rotary_dim"] = head_dim
        cs["embeddings_scale"] = math.sqrt(hf["hidden_size"])
        q = hf.get("query_pre_attn_scalar", head_dim)
        if q != head_dim:
            cs["attention_logits_alpha"] = math.sqrt(head_dim / q)
        bias = bool(hf.get("attention_bias", False))
        cs["use_projection_bias_in_attention"] = bias
        cs["use_ffn_bias_in_attention"] = bias

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        heads = cs["num_heads"]
        head_dim = int((cs.get("attention_inner_dim") or cs["hidden_size"]) // heads)
        hf["head_dim"] = head_dim
        want = math.sqrt(cs["hidden_size"])
        if not math.isclose(float(cs.get("embeddings_scale", want)), want, rel_tol=1e-6):
            raise fail(f"Can't convert config with embeddings_scale={cs.get('embeddings_scale')}. Only sqrt(hidden).")
        alpha = cs.get("attention_logits_alpha") or 1.0
        hf["query_pre_attn_scalar"] = head_dim / alpha**2
        if float(hf["query_pre_attn_scalar"]).is_integer():
            hf["query_pre_attn_scalar"] = int(hf["query_pre_attn_scalar"])
        if cs.get("rotary_dim", head_dim) != head_dim:
            raise fail(f"Can't convert config with rotary_dim={cs.get('rotary_dim')}. Only {head_dim}.")
        hf["attention_bias"] = bool(cs.get("use_projection_bias_in_attention", False))
