"""The config hook of the CodeGen table (``codegen.yaml`` beside this module): the part of its
config conversion the table cannot say as data."""

from __future__ import annotations

from typing import Any

from ckptconv.engine.layouts.hooks import Ctx, fail, hook


@hook("codegen_heads")
class _CodegenHeads:
    """CodeGen's fused qkv is split in mp_num = 4 shards: fewer than 4 heads cannot be converted."""

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        if int(hf.get("n_head", 16)) < 4:
            raise fail(f"Can't convert CodeGen with n_head={hf.get('n_head')}; at least 4 heads are needed (mp_num=4)")

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        if int(cs.get("num_heads", 16)) < 4:
            raise fail(f"Can't convert CodeGen with num_heads={cs.get('num_heads')}; at least 4 heads are needed")
