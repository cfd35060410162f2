"""The config hook of the MPT table (``mpt.yaml`` beside this module): the part of its
config conversion the table cannot say as data."""

from __future__ import annotations

from typing import Any

from ckptconv.engine.layouts.hooks import Ctx, fail, hook


@hook("mpt")
class _Mpt:
    """MPT: ALiBi only, no biases, expansion_ratio x d_model feed-forward, unscaled logits."""

    reads = (
        "attn_config",
        "no_bias",
        "expansion_ratio",
        "norm_type",
        "logit_scale",
        "learned_pos_emb",
        "embedding_fraction",
    )

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        attn = hf.get("attn_config") or {}
        checks = {
            "attn_config.alibi": (attn.get("alibi", False), True),
            "attn_config.clip_qkv": (attn.get("clip_qkv"), None),
            "attn_config.qk_ln": (attn.get("qk_ln", False), False),
            "attn_config.softmax_scale": (attn.get("softmax_scale"), None),
            "attn_config.prefix_lm": (attn.get("prefix_lm", False), False),
            "no_bias": (hf.get("no_bias", True), True),
            "logit_scale": (hf.get("logit_scale"), None),
            "embedding_fraction": (hf.get("embedding_fraction", 1.0), 1.0),
        }
        for key, (have, want) in checks.items():
            if have != want:
                raise fail(f"Can't convert config with {key}={have!r}. Only {want!r} is supported.", key=key)
        cs["filter_size"] = int(hf.get("expansion_ratio", 4) * hf["d_model"])
        bias_max = attn.get("alibi_bias_max", 8)
        if bias_max != 8:
            raise fail(f"Can't convert config with attn_config.alibi_bias_max={bias_max}. Only 8 is supported.")

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        hidden = int(cs["hidden_size"])
        filt = int(cs.get("filter_size", 4 * hidden))
        if filt % hidden:
            raise fail(f"filter_size={filt} is not a multiple of hidden_size={hidden}; MPT needs an integer ratio")
        hf["expansion_ratio"] = filt // hidden
        attn = hf.setdefault("attn_config", {})
        attn.update({"alibi": True, "alibi_bias_max": 8})
        hf["no_bias"] = True
