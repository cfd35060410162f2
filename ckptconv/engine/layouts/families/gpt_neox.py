"""The config hook of the GPT-NeoX table (``gpt_neox.yaml`` beside this module): the part of its
config conversion the table cannot say as data."""

from __future__ import annotations

from typing import Any

from ckptconv.engine.layouts.hooks import Ctx, fail, hook


@hook("neox_rotary")
class _NeoxRotary:
    """rotary_pct <-> rotary_dim = int(head_dim x pct); rotary_emb_base must be 10000."""

    reads = ("rotary_pct", "partial_rotary_factor", "rotary_emb_base", "rope_theta")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        pct = hf.get("rotary_pct", hf.get("partial_rotary_factor", 0.25))
        base = hf.get("rotary_emb_base", hf.get("rope_theta", 10000))
        if float(base) != 10000.0:
            raise fail(f"Can't convert config with rotary_emb_base={base}. Only 10000 is supported.")
        cs["rotary_dim"] = int((hf["hidden_size"] // hf["num_attention_heads"]) * pct)

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        head = cs["hidden_size"] // cs["num_heads"]
        hf["rotary_pct"] = cs.get("rotary_dim", head) / head
        hf["rotary_emb_base"] = 10000
