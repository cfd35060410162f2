"""The config hook of the BERT table (``bert.yaml`` beside this module; the RoBERTa table names it
too): the part of its config conversion the table cannot say as data."""

from __future__ import annotations

from typing import Any

from ckptconv.engine.layouts.hooks import Ctx, fail, hook


@hook("bert")
class _Bert:
    """BERT/RoBERTa heads: pooler and MLM nonlinearities; position embedding type."""

    reads = ("position_embedding_type",)

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        pe = hf.get("position_embedding_type", "absolute")
        if pe != "absolute":
            raise fail(f"Can't convert config with position_embedding_type={pe!r}. Only 'absolute' is supported.")
        cs["position_embedding_type"] = "learned"
        cs["pooler_nonlinearity"] = "tanh"
        cs.setdefault("mlm_nonlinearity", cs.get("encoder_nonlinearity", "gelu"))

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        pe = cs.get("position_embedding_type", "learned")
        if pe != "learned":
            raise fail(f"Can't convert config with position_embedding_type={pe!r}. Only 'learned' is supported.")
        hf["position_embedding_type"] = "absolute"
        enc = cs.get("encoder_nonlinearity", "gelu")
        pooler = cs.get("pooler_nonlinearity")
        if pooler is None and enc != "tanh":
            raise fail("pooler_nonlinearity is absent and encoder_nonlinearity is not tanh: cannot express in HF")
        if pooler not in (None, "tanh"):
            raise fail(f"Can't convert config with pooler_nonlinearity={pooler!r}. Only 'tanh' is supported.")
        mlm = cs.get("mlm_nonlinearity")
        if mlm not in (None, enc) and not ctx.param("mlm_gelu"):
            raise fail(f"Can't convert config with mlm_nonlinearity={mlm!r}. Only the encoder nonlinearity ({enc}).")
