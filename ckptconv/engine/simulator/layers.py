"""Building blocks of the Cerebras Model Zoo transformer models, on CPU.

Module attribute names are chosen so that ``state_dict()`` keys equal the keys of Cerebras
checkpoints (``self_attn.proj_q_dense_layer``, ``ffn.ffn.0.linear_layer_for_glu``,
``ffn.experts.fused_ffns.0.linear_layer.expert_weights``, ...). The arithmetic follows the Model
Zoo's conventions where they differ from Hugging Face's, because that difference is what a
conversion has to bridge and what ``verify`` must catch:

- rotary embeddings rotate interleaved pairs ``(2j, 2j+1)`` (Hugging Face llama rotates halves);
- GLU feed-forwards compute ``linear_layer(x) * act(linear_layer_for_glu(x))`` and ``geglu`` uses
  the exact (erf) GELU;
- RMSNorm multiplies by its weight directly (Gemma's ``1 + w`` is folded into the stored weight);
- ALiBi adds ``-slope * |i - j|``;
- fused experts are stored ``[out, num_experts, in]``.

This module holds activations, norms, attention and masks; position embeddings are in
``positions``, feed-forward and mixture-of-experts blocks in ``feedforward``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ckptconv.core.errors import SimulationError
from ckptconv.engine.simulator.positions import RotaryHelper

# --- activations ----------------------------------------------------------------------------


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _squared(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def act(x: torch.Tensor) -> torch.Tensor:
        y = fn(x)
        return y * y

    return act


# The names the Model Zoo accepts for `nonlinearity` (its ACT2FN table); anything else is refused
# as the appliance would refuse it.
UNARY_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "leaky_relu": F.leaky_relu,
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "tanh": torch.tanh,
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_fast,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "squared_gelu": _squared(F.gelu),
    "squared_relu": _squared(F.relu),
    "mish": F.mish,
    "linear": lambda x: x,
    "sigmoid": torch.sigmoid,
    "relu6": F.relu6,
}

# GLU variants: first argument is the linear branch, second the activated (gate) branch.
GLU_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "liglu": lambda x: x,
    "geglu": F.gelu,
    "reglu": F.relu,
    "swiglu": F.silu,
}


def is_glu(name: str | None) -> bool:
    return name is not None and name.lower() in GLU_ACTIVATIONS


def check_activation(name: str | None, *, field: str = "nonlinearity") -> None:
    if name is None:
        return
    key = name.lower()
    if key not in UNARY_ACTIVATIONS and key not in GLU_ACTIVATIONS:
        known = ", ".join(sorted([*UNARY_ACTIVATIONS, *GLU_ACTIVATIONS]))
        raise SimulationError(
            f"{field}: {name!r} is not an activation the Cerebras Model Zoo accepts",
            hint=f"use one of: {known}",
        )


# --- norms ----------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """T5-style RMS norm: no mean subtraction, no bias; variance in float32; ``weight * x``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight.to(dtype) * x.to(dtype)


NORM_TYPES = ("layernorm", "biasless-layernorm", "nonparametric-layernorm", "rmsnorm")


def make_norm(norm_type: str | None, dim: int, eps: float) -> nn.Module:
    kind = (norm_type or "layernorm").lower()
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "biasless-layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=False)
    if kind == "nonparametric-layernorm":
        return nn.LayerNorm(dim, eps=eps, elementwise_affine=False, bias=False)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise SimulationError(f"norm_type {norm_type!r} is not supported", hint=f"use one of: {', '.join(NORM_TYPES)}")


# --- attention ------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head, grouped-query (``kv_groups``) or multi-query attention with Model Zoo names."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        inner_dim: int | None = None,
        kv_dim: int | None = None,
        kv_groups: int | None = None,
        use_projection_bias: bool = True,
        use_output_bias: bool = True,
        attention_type: str = "scaled_dot_product",
        scale_qk_dot_by_d: bool = False,
        logits_alpha: float = 1.0,
        scale_qk_dot_by_layer_idx: bool = False,
        logit_softcapping: float | None = None,
        softmax_fp32: bool = True,
        dropout: float = 0.0,
        qk_norm: str | None = None,
        qk_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        if attention_type not in ("scaled_dot_product", "dot_product"):
            raise SimulationError(f"attention_type {attention_type!r} is not supported")
        inner = inner_dim or embed_dim
        if inner % num_heads:
            raise SimulationError(f"attention inner dim {inner} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = inner // num_heads
        self.kv_groups = kv_groups
        kv_heads = kv_groups if kv_groups else num_heads
        if num_heads % kv_heads:
            raise SimulationError(f"num_heads {num_heads} is not a multiple of num_kv_groups {kv_heads}")
        kv_in = kv_dim or embed_dim
        self.proj_q_dense_layer = nn.Linear(embed_dim, inner, bias=use_projection_bias)
        self.proj_k_dense_layer = nn.Linear(kv_in, kv_heads * self.head_dim, bias=use_projection_bias)
        self.proj_v_dense_layer = nn.Linear(kv_in, kv_heads * self.head_dim, bias=use_projection_bias)
        if qk_norm is not None:
            self.q_norm = make_norm(qk_norm, self.head_dim, qk_norm_eps)
            self.k_norm = make_norm(qk_norm, self.head_dim, qk_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None
        self.dropout_layer = nn.Dropout(dropout)
        self.proj_output_dense_layer = nn.Linear(inner, embed_dim, bias=use_output_bias)
        self.attention_type = attention_type
        self.scale_qk_dot_by_d = scale_qk_dot_by_d
        self.logits_alpha = logits_alpha
        self.scale_qk_dot_by_layer_idx = scale_qk_dot_by_layer_idx
        self.logit_softcapping = logit_softcapping
        self.softmax_fp32 = softmax_fp32

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim)

    def _expand(self, x: torch.Tensor) -> torch.Tensor:
        # [B, G, S, D] -> [B, H, S, D]: each kv group serves H/G consecutive query heads.
        b, g, s, d = x.shape
        if g == self.num_heads:
            return x
        return x.unsqueeze(2).expand(b, g, self.num_heads // g, s, d).reshape(b, self.num_heads, s, d)

    def forward(
        self,
        x: torch.Tensor,
        kv: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
        rotary: RotaryHelper | None = None,
        layer_idx: int = 0,
    ) -> torch.Tensor:
        kv = x if kv is None else kv
        kv_heads = self.kv_groups or self.num_heads
        q = self._heads(self.proj_q_dense_layer(x), self.num_heads)
        k = self._heads(self.proj_k_dense_layer(kv), kv_heads)
        v = self._heads(self.proj_v_dense_layer(kv), kv_heads).transpose(1, 2)
        if self.scale_qk_dot_by_d and self.attention_type == "scaled_dot_product":
            k = k * torch.tensor(1 / float(self.head_dim) ** 0.5, dtype=k.dtype)
        if rotary is not None:
            k = rotary.rotate(k)
            q = rotary.rotate(q)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.attention_type == "scaled_dot_product":
            q = q * torch.tensor(1 / float(self.head_dim) ** 0.5, dtype=q.dtype)
        if self.scale_qk_dot_by_layer_idx:
            q = q * torch.tensor(1 / float(layer_idx + 1), dtype=q.dtype)
        logits = self.logits_alpha * torch.matmul(q, self._expand(k).transpose(-1, -2))
        if self.logit_softcapping is not None:
            logits = torch.tanh(logits / self.logit_softcapping) * self.logit_softcapping
        if position_bias is not None:
            logits = logits + position_bias.to(logits.dtype)
        if mask is not None:
            logits = logits + mask.to(logits.dtype)
        if self.softmax_fp32 and logits.dtype != torch.float32:
            scores = F.softmax(logits.float(), dim=-1).type_as(logits)
        else:
            scores = F.softmax(logits, dim=-1)
        scores = self.dropout_layer(scores)
        out = torch.matmul(scores, self._expand(v))
        b, h, s, d = out.shape
        out = out.transpose(1, 2).reshape(b, s, h * d)
        return self.proj_output_dense_layer(out)


# --- masks --------------------------------------------------------------------------------


def causal_mask(seq: int, *, window: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive ``[1, 1, seq, seq]`` mask: 0 where ``0 <= i - j`` (and ``i - j < window``), -inf elsewhere."""
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    m = torch.zeros(seq, seq, dtype=dtype).masked_fill(~allowed, float("-inf"))
    return m[None, None]


def padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[B, S]`` 1 = attend -> additive ``[B, 1, 1, S]``."""
    m = torch.zeros(attention_mask.shape, dtype=dtype).masked_fill(attention_mask == 0, float("-inf"))
    return m[:, None, None, :]
