"""Folding training-time reparametrizations into plain weights.

muP -> sP (reference §6.1): a Cerebras muP model scales attention logits by 1/d (not 1/sqrt(d)),
multiplies embeddings by ``embeddings_scale`` and the output logits by ``output_logits_alpha / w``
(w = hidden_size / mup_base_hidden_size). Hugging Face models have none of these, so on export
the factors are multiplied into the k projection, the embeddings (or the embedding LayerNorm)
and the LM head; the config loses its muP keys and the embeddings are untied (they now differ
from the head).

LoRA (reference §6.2): ``<path>.lora_A`` [r, in] and ``<path>.lora_B`` [out, r] fold into
``<path>.weight`` as ``W + (B @ A) * alpha / r`` (transposed for embeddings and fan-in-fan-out).

Both produce per-key "pre-transforms" that the planner applies to source values before the
layout rules run; they never read data themselves.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptconv.core.errors import ConfigConversionError, ConversionError
from ckptconv.core.releases import release_key

_MUP_KEYS_NEW = (
    "mup_base_hidden_size",
    "mup_base_filter_size",
    "attention_logits_alpha",
    "output_logits_alpha",
    "scale_output_logits_by_d",
    "embeddings_scale",
    "scale_qk_dot_by_d",
)
_MUP_KEYS_OLD = ("output_logits_scale", "embeddings_scale", "scale_qk_dot_by_d")

_K_PROJ = re.compile(r"(?:.*\.)?proj_k_dense_layer\.(?:weight|bias)")
_LM_HEAD = re.compile(r"(?:.*\.)?(?:lm_head|mlm_head|cls_head)\.weight")
_EMB = re.compile(r"(?:.*\.)?embedding_layer\.(?:word_embeddings|position_embeddings(?:\.embed)?)\.weight")
_EMB_LN = re.compile(r"(?:.*\.)?embedding_ln_f\.(?:weight|bias)")


def is_mup(model: Mapping[str, Any], release: str) -> bool:
    if release_key(release) >= (2, 3):
        return any(k.startswith("mup_base_") and v is not None for k, v in model.items())
    flags = [bool(model.get(k)) for k in _MUP_KEYS_OLD]
    if any(flags) and not all(flags):
        raise ConfigConversionError(
            "the config sets some of scale_qk_dot_by_d, embeddings_scale, output_logits_scale but not all; "
            "a pre-2.3 muP model needs all three",
            hint="set all three muP keys, or none",
        )
    return all(flags)


@dataclass(frozen=True)
class MupFold:
    """Scale factors by key pattern, and the sP config they produce."""

    factors: tuple[tuple[re.Pattern[str], float, str], ...]
    config: dict[str, Any]

    def factor(self, key: str) -> tuple[float, str] | None:
        for rx, f, why in self.factors:
            if rx.fullmatch(key):
                return f, why
        return None


def mup_fold(model: Mapping[str, Any], release: str, family: str = "") -> MupFold:
    """The muP -> sP folding of a CS model config (assumed to be muP; see :func:`is_mup`)."""
    if family == "t5":
        return _mup_fold_t5(model)
    hidden = int(model["hidden_size"])
    heads = int(model["num_heads"])
    head_dim = hidden // heads
    factors: list[tuple[re.Pattern[str], float, str]] = []
    new = release_key(release) >= (2, 3)
    if new:
        alpha = float(model.get("attention_logits_alpha") or 1.0)
        k = alpha / math.sqrt(head_dim) if model.get("scale_qk_dot_by_d", True) else alpha
        factors.append((_K_PROJ, k, "muP attention logits 1/d -> 1/sqrt(d)"))
        base = model.get("mup_base_hidden_size")
        if base:
            w = hidden / float(base)
            out_alpha = float(model.get("output_logits_alpha") or 1.0)
            head = out_alpha / w if model.get("scale_output_logits_by_d", True) else out_alpha / math.sqrt(w)
            factors.append((_LM_HEAD, head, "muP output logits"))
    else:
        if model.get("scale_qk_dot_by_d"):
            factors.append((_K_PROJ, 1.0 / math.sqrt(head_dim), "muP attention logits 1/d -> 1/sqrt(d)"))
        factors.append((_LM_HEAD, float(model.get("output_logits_scale") or 1.0), "muP output logits"))
    emb = model.get("embeddings_scale")
    if emb is not None and float(emb) != 1.0:
        target = _EMB_LN if model.get("embedding_layer_norm") else _EMB
        factors.append((target, float(emb), "muP embeddings scale"))
    config = {k: v for k, v in model.items() if k not in (_MUP_KEYS_NEW if new else _MUP_KEYS_OLD)}
    config["share_embedding_weights"] = False
    return MupFold(tuple((rx, f, why) for rx, f, why in factors if f != 1.0), config)


_T5_Q = re.compile(r"(?:.*\.)?(?:self_attn|multihead_attn)\.proj_q_dense_layer\.weight")
_T5_K_ENC = re.compile(r"(?:.*\.)?encoder\.layers\.\d+\.self_attn\.proj_k_dense_layer\.weight")
_T5_K_DEC = re.compile(r"(?:.*\.)?decoder\.layers\.\d+\.(?:self_attn|multihead_attn)\.proj_k_dense_layer\.weight")
_T5_V = re.compile(r"(?:.*\.)?(?:self_attn|multihead_attn)\.proj_v_dense_layer\.weight")
_T5_OUT = re.compile(r"(?:.*\.)?(?:self_attn|multihead_attn)\.proj_output_dense_layer\.weight")
_T5_HEAD = re.compile(r"(?:.*\.)?lm_head\.weight")
_T5_EMB = re.compile(r"(?:.*\.)?(?:encoder|decoder)_embeddings\.word_embeddings\.weight")
_T5_MUP_KEYS = (
    "encoder_attention_logits_alpha",
    "decoder_attention_logits_alpha",
    "scale_encoder_qk_dot_by_d",
    "scale_decoder_qk_dot_by_d",
    "output_logits_alpha",
    "scale_output_logits_by_d",
    "embeddings_alpha",
)


def _mup_fold_t5(model: Mapping[str, Any]) -> MupFold:
    """T5's muP (reference §6.1): ``w = d_model / mup_base_d_model``, ``p = w**-0.5`` (1 when
    ``mup_base_d_kv`` is set) scale the attention projections, the LM head and the embeddings."""
    d_model = int(model["d_model"])
    d_kv = int(model["d_kv"])
    w = d_model / float(model["mup_base_d_model"])
    per_kv = model.get("mup_base_d_kv") is not None
    p = 1.0 if per_kv else w**-0.5

    def k_factor(stack: str) -> float:
        alpha = float(model.get(f"{stack}_attention_logits_alpha") or 1.0)
        scaled = model.get(f"scale_{stack}_qk_dot_by_d", True)
        return alpha * p / math.sqrt(d_kv) if scaled else alpha * p

    out_alpha = float(model.get("output_logits_alpha") or 1.0)
    head = out_alpha / w if model.get("scale_output_logits_by_d", False) else out_alpha / math.sqrt(w)
    emb_alpha = float(model.get("embeddings_alpha") or 1.0)
    factors = [
        (_T5_Q, p / math.sqrt(d_kv), "muP query scale"),
        (_T5_K_ENC, k_factor("encoder"), "muP encoder attention logits"),
        (_T5_K_DEC, k_factor("decoder"), "muP decoder attention logits"),
        (_T5_V, p, "muP value scale"),
        (_T5_OUT, 1.0 if per_kv else math.sqrt(w), "muP attention output scale"),
        (_T5_HEAD, head, "muP output logits"),
        (_T5_EMB, emb_alpha * math.sqrt(d_model), "muP embeddings scale"),
    ]
    config = {k: v for k, v in model.items() if k not in _T5_MUP_KEYS and not k.startswith("mup_base_")}
    config["share_embedding_weights"] = False  # the head and the embeddings now differ
    return MupFold(tuple((rx, f, why) for rx, f, why in factors if f != 1.0), config)


# --- LoRA ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraGroup:
    r: int
    alpha: float
    fan_in_fan_out: bool
    target_modules: tuple[str, ...] | None

    @property
    def scale(self) -> float:
        return self.alpha / self.r


def lora_groups(model: Mapping[str, Any]) -> list[LoraGroup]:
    params = model.get("lora_params")
    if not params:
        return []
    items = params if isinstance(params, list) else [params]
    groups = []
    for p in items:
        r = int(p.get("r", 0))
        if r <= 0:
            continue
        tm = p.get("target_modules")
        groups.append(
            LoraGroup(r, float(p.get("alpha", 1)), bool(p.get("fan_in_fan_out", False)), tuple(tm) if tm else None)
        )
    return groups


@dataclass(frozen=True)
class LoraSite:
    base: str  # <path>.weight
    a: str
    b: str
    scale: float
    fan_in_fan_out: bool
    embedding: bool


def lora_sites(keys: list[str], shapes: Mapping[str, tuple[int, ...]], model: Mapping[str, Any]) -> list[LoraSite]:
    """Every adapted weight among ``keys`` (CS model keys) with its scale.

    The Model Zoo picks a ``lora_params`` group by module class names, which a checkpoint does not
    record; here a site takes the single group whose rank matches ``lora_A`` (ambiguity is an
    error that asks for one group per rank).
    """
    groups = lora_groups(model)
    present = set(keys)
    sites = []
    for k in keys:
        if not k.endswith(".lora_A"):
            continue
        path = k[: -len(".lora_A")]
        b, w = f"{path}.lora_B", f"{path}.weight"
        if b not in present or w not in present:
            raise ConversionError(f"{k} has no matching {b} and {w}")
        rank = shapes[k][0]
        cands = [g for g in groups if g.r == rank] or ([groups[0]] if len(groups) == 1 else [])
        if len(cands) != 1:
            raise ConfigConversionError(
                f"cannot tell which lora_params group adapts {path} (rank {rank})",
                hint="give lora_params one entry per distinct rank r",
            )
        g = cands[0]
        w_shape = shapes[w]
        out_dim, in_dim = shapes[b][0], shapes[k][1]
        embedding = "embeddings" in path.rsplit(".", 1)[-1] or (
            tuple(w_shape) == (in_dim, out_dim) and tuple(w_shape) != (out_dim, in_dim)
        )
        sites.append(LoraSite(w, k, b, g.scale, g.fan_in_fan_out, embedding))
    return sites


def lora_config(model: Mapping[str, Any], sites: list[LoraSite]) -> dict[str, Any]:
    out = {k: v for k, v in model.items() if k != "lora_params"}
    if any(s.embedding and "word_embeddings" in s.base for s in sites) and out.get("share_embedding_weights", True):
        out["share_embedding_weights"] = False
    return out
