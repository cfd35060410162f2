"""The config hook of the Falcon table (``falcon.yaml`` beside this module): the part of its
config conversion the table cannot say as data."""

from __future__ import annotations

from typing import Any

from ckptconv.engine.layouts.dictpath import get_path
from ckptconv.engine.layouts.hooks import Ctx, fail, hook


@hook("falcon")
class _Falcon:
    """Falcon's attention layout flags (reference §4.4), modern and legacy HF configs."""

    reads = (
        "alibi",
        "bias",
        "new_decoder_architecture",
        "parallel_attn",
        "multi_query",
        "num_kv_heads",
        "num_ln_in_parallel_attn",
        "n_head",
        "n_layer",
        "n_head_kv",
        "model_type",
    )

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        legacy = hf.get("model_type") in ("RefinedWebModel", "RefinedWeb") or "n_head" in hf
        heads = hf.get("num_attention_heads", hf.get("n_head"))
        if legacy:
            cs["num_heads"] = heads
            if "n_layer" in hf:
                cs["num_hidden_layers"] = hf["n_layer"]
        if hf.get("alibi"):
            raise fail("Can't convert config with alibi=True. Only rotary Falcon models are supported.")
        if legacy and hf.get("bias"):
            raise fail("Can't convert legacy Falcon config with bias=True.")
        bias = bool(hf.get("bias", False))
        new = bool(hf.get("new_decoder_architecture", False))
        parallel = bool(hf.get("parallel_attn", True))
        if legacy and "n_head_kv" in hf:  # RefinedWeb (40B)
            new, kv = True, hf["n_head_kv"]
            if not parallel:
                raise fail("Can't convert RefinedWeb config with parallel_attn=False.")
            untied = True
        elif legacy:  # RefinedWebModel (7B)
            if not hf.get("multi_query", True):
                raise fail("Can't convert RefinedWebModel config with multi_query=False.")
            kv, untied = 1, False
        else:
            if not new and hf.get("multi_query", True):
                kv = 1
            elif not new:
                kv = heads
            else:
                kv = hf.get("num_kv_heads", heads)
            untied = (new and hf.get("num_ln_in_parallel_attn", 2) == 2) or not parallel
        cs["use_projection_bias_in_attention"] = bias
        cs["use_ffn_bias_in_attention"] = bias
        cs["use_ffn_bias"] = bias
        cs["position_embedding_type"] = "rotary"
        cs["rotary_dim"] = int(hf["hidden_size"] // heads)
        cs["use_untied_layer_norm"] = bool(untied)
        cs["attention_module"] = "multiquery_attention"
        cs["extra_attention_params"] = {"num_kv_groups": kv}
        cs["filter_size"] = 4 * int(hf["hidden_size"])

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        heads, hidden = cs["num_heads"], cs["hidden_size"]
        if cs.get("embedding_dropout_rate", 0.0) not in (0, 0.0, None):
            raise fail("Can't convert config with embedding_dropout_rate != 0. Only 0.0 is supported.")
        if cs.get("rotary_dim", hidden // heads) != hidden // heads:
            raise fail(f"Can't convert config with rotary_dim={cs.get('rotary_dim')}. Only {hidden // heads}.")
        if cs.get("filter_size", 4 * hidden) != 4 * hidden:
            raise fail(f"Can't convert config with filter_size={cs.get('filter_size')}. Only {4 * hidden}.")
        flags = {
            cs.get(k, True) for k in ("use_projection_bias_in_attention", "use_ffn_bias_in_attention", "use_ffn_bias")
        }
        if len(flags) != 1:
            raise fail("Falcon needs the three bias flags (attention projections, attention output, FFN) to be equal")
        kv = get_path(cs, "extra_attention_params.num_kv_groups", 1)
        hf["num_kv_heads"] = kv
        hf["alibi"] = False
        # The Model Zoo writes the CS flag names, which transformers ignores (so a biased Falcon
        # would reload without its biases): `bias` is written as well so HF matches the weights.
        for k in ("use_projection_bias_in_attention", "use_ffn_bias_in_attention", "use_ffn_bias"):
            hf[k] = cs.get(k, True)
        hf["bias"] = bool(flags.pop())
        hf["parallel_attn"] = True
        if cs.get("use_untied_layer_norm", False):
            hf["new_decoder_architecture"] = True
            hf["multi_query"] = kv == 1
            hf["num_ln_in_parallel_attn"] = 2
        else:
            hf["new_decoder_architecture"] = False
            if kv == 1:
                hf["multi_query"] = True
            elif kv == heads:
                hf["multi_query"] = False
            else:
                raise fail(f"Falcon with tied layer norms needs num_kv_groups 1 or {heads}, got {kv}")
            hf["num_ln_in_parallel_attn"] = None
