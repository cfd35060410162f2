"""The config hook of the BLOOM table (``bloom.yaml`` beside this module): the part of its
config conversion the table cannot say as data."""

from __future__ import annotations

from typing import Any

from ckptconv.engine.layouts.hooks import Ctx, fail, hook


@hook("bloom")
class _Bloom:
    """n_embed (legacy) overrides hidden_size; filter_size is 4 x hidden; CS has no max positions."""

    reads = ("n_embed",)

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        if hf.get("n_embed") is not None:
            cs["hidden_size"] = hf["n_embed"]
        cs["filter_size"] = 4 * int(cs["hidden_size"])

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        hidden = cs["hidden_size"]
        if cs.get("filter_size", 4 * hidden) != 4 * hidden:
            raise fail(f"Can't convert config with filter_size={cs.get('filter_size')}. Only {4 * hidden}.")
        inner = cs.get("attention_inner_dim")
        if inner not in (None, hidden):
            raise fail(f"Can't convert config with attention_inner_dim={inner}. Only null or {hidden}.")
        emb_drop = cs.get("embedding_dropout_rate", cs.get("dropout_rate", 0.0))
        if emb_drop not in (0, 0.0, None):
            raise fail("Can't convert config with embedding_dropout_rate != 0. Only 0.0 is supported.")
