"""The config hook of the BTLM table (``btlm.yaml`` beside this module): the part of its
config conversion the table cannot say as data."""

from __future__ import annotations

from typing import Any

from ckptconv.engine.layouts.dictpath import get_path
from ckptconv.engine.layouts.hooks import Ctx, hook


@hook("btlm_mup")
class _BtlmMup:
    """BTLM/JAIS native muP: output_logits_scale = mup_output_alpha x mup_width_scale; the width
    scale lives in the CS run YAML as optimizer.adjust_learning_rate.decoder_kernel."""

    reads = ("mup_output_alpha", "mup_width_scale")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        alpha, width = hf.get("mup_output_alpha"), hf.get("mup_width_scale")
        if alpha is not None and width is not None:
            cs["output_logits_scale"] = alpha * width
        if width is not None:
            ctx.top.setdefault("optimizer", {}).setdefault("adjust_learning_rate", {})["decoder_kernel"] = width

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        scale = cs.get("output_logits_scale")
        width = get_path(ctx.top, "optimizer.adjust_learning_rate.decoder_kernel", None)
        if width is None:
            width = get_path(ctx.top, "trainer.init.optimizer.adjust_learning_rate.decoder_kernel", None)
        if width is not None:
            hf["mup_width_scale"] = width
            if scale is not None:
                hf["mup_output_alpha"] = scale / width
        elif scale is not None:
            hf["mup_output_alpha"] = scale
            hf["mup_width_scale"] = 1.0
