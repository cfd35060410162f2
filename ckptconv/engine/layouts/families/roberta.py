"""The config hook of the RoBERTa table (``roberta.yaml`` beside this module): the part of its
config conversion the table cannot say as data."""

from __future__ import annotations

from typing import Any

from ckptconv.engine.layouts.hooks import Ctx, hook


@hook("roberta")
class _Roberta:
    """RoBERTa: CS max positions exclude the padding offset; type_vocab_size <-> num_segments."""

    reads = ("pad_token_id", "type_vocab_size", "max_position_embeddings")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        pad = int(hf.get("pad_token_id", 1))
        cs["max_position_embeddings"] = int(hf["max_position_embeddings"]) - pad - 1
        cs["pad_token_id"] = pad
        cs["num_segments"] = hf.get("type_vocab_size", 1)

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        pad = int(cs.get("pad_token_id", 1))
        hf["max_position_embeddings"] = int(cs["max_position_embeddings"]) + pad + 1
        hf["pad_token_id"] = pad
        seg = cs.get("num_segments")
        hf["type_vocab_size"] = seg if seg else 1
