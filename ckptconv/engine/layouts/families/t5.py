"""The config hook of the T5 table (``t5.yaml`` beside this module): the part of its
config conversion the table cannot say as data."""

from __future__ import annotations

from typing import Any

from ckptconv.engine.layouts.hooks import Ctx, fail, hook


@hook("t5")
class _T5:
    """T5: feed_forward_proj <-> encoder/decoder nonlinearity; export checks they agree."""

    reads = ("feed_forward_proj", "relative_attention_max_distance", "scale_decoder_outputs")

    _GATED = {"gated-silu": "swiglu", "gated-relu": "reglu", "gated-gelu": "geglu"}

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        proj = hf.get("feed_forward_proj", "relu")
        act = _T5._GATED.get(proj, proj)
        cs["encoder_nonlinearity"] = act
        cs["decoder_nonlinearity"] = act
        # transformers 5 always ties the T5 head and says with `scale_decoder_outputs` what 4.x said
        # with `tie_word_embeddings` (scale the decoder output by d_model^-0.5, as a shared head needs).
        if "scale_decoder_outputs" in hf:
            cs["share_embedding_weights"] = bool(hf["scale_decoder_outputs"])
        if hf.get("relative_attention_max_distance", 128) != 128:
            raise fail("Can't convert config with relative_attention_max_distance != 128.")

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        enc = cs.get("encoder_nonlinearity", "relu")
        dec = cs.get("decoder_nonlinearity", enc)
        if enc != dec:
            raise fail(f"encoder_nonlinearity={enc!r} and decoder_nonlinearity={dec!r} differ; HF T5 has one")
        inverse = {v: k for k, v in _T5._GATED.items()}
        hf["feed_forward_proj"] = inverse.get(enc, enc)
        tgt = cs.get("tgt_vocab_size")
        if tgt is not None and tgt != cs.get("src_vocab_size"):
            raise fail("tgt_vocab_size differs from src_vocab_size; HF T5 shares one vocabulary")
        relu_drop = cs.get("relu_dropout_rate")
        if relu_drop is not None and relu_drop != cs.get("dropout_rate"):
            raise fail("relu_dropout_rate differs from dropout_rate; HF T5 has one dropout rate")
