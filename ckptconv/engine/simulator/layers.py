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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckptconv.core.errors import SimulationError

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


# --- position embeddings --------------------------------------------------------------------


class LearnedPositionEmbedding(nn.Module):
    """``position_embeddings.embed``: positions start at ``offset``; RoBERTa-style padding masks give
    pad tokens position ``offset`` and the others ``offset + 1 + index`` (pads assumed at the end)."""

    def __init__(
        self, max_positions: int, dim: int, *, offset: int = 0, mask_padding: bool = False, pad_token_id: int = 0
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(max_positions + offset + (1 if mask_padding else 0), dim)
        self.offset = offset
        self.mask_padding = mask_padding
        self.pad_token_id = pad_token_id

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[-1]
        if self.mask_padding:
            ids = torch.arange(1, seq + 1, device=input_ids.device)
            positions = torch.where(input_ids.ne(self.pad_token_id), ids, 0) + self.offset
        else:
            positions = (torch.arange(seq, device=input_ids.device) + self.offset).expand(input_ids.shape[0], -1)
        return self.embed(positions)


class FixedPositionEmbedding(nn.Module):
    """``position_embeddings.fpe``: the sinusoid table (sin/cos interleaved per timescale), frozen."""

    def __init__(self, max_positions: int, dim: int, min_timescale: float = 1.0, max_timescale: float = 1.0e4):
        super().__init__()
        position = torch.arange(max_positions, dtype=torch.float32)
        n = dim // 2
        increment = math.log(float(max_timescale) / float(min_timescale)) / (float(n) - 1)
        inv = min_timescale * torch.exp(torch.arange(n, dtype=torch.float32) * -increment)
        scaled = position[:, None] * inv[None, :]
        signal = torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)
        signal = signal.reshape(max_positions, 2, n).transpose(1, 2).reshape(max_positions, 2 * n)
        signal = F.pad(signal, (0, dim % 2, 0, 0))
        self.fpe = nn.Parameter(signal, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.fpe[: input_ids.shape[-1]].unsqueeze(0).expand(input_ids.shape[0], -1, -1)


def alibi_slopes(n: int) -> list[float]:
    """ALiBi head slopes: geometric for powers of two, interleaved from the next power otherwise."""

    def power_of_2(k: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(k) - 3)))
        return [start * start**i for i in range(k)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    p = 2 ** math.floor(math.log2(n))
    return power_of_2(p) + alibi_slopes(2 * p)[0::2][: n - p]


class AlibiBias(nn.Module):
    """``position_embed_helper.slopes`` ``[H, 1]``; bias ``-slope / scaling * |i - j|``."""

    def __init__(self, num_heads: int, *, trainable: bool = False, scaling_factor: float = 1.0) -> None:
        super().__init__()
        init = torch.zeros(num_heads, 1) if trainable else torch.tensor(alibi_slopes(num_heads)).unsqueeze(-1)
        self.slopes = nn.Parameter(init, requires_grad=trainable)
        self.scaling_factor = scaling_factor

    def forward(self, q_len: int, k_len: int) -> torch.Tensor:
        rel = torch.arange(k_len)[None, :] - torch.arange(q_len)[:, None]
        rel = rel.abs().to(self.slopes.dtype)
        return (self.slopes / -self.scaling_factor).unsqueeze(1) * rel.unsqueeze(0)


class RelativePositionBias(nn.Module):
    """T5 bucketed relative bias, ``position_embed_helper.relative_attention_bias`` ``[buckets, H]``."""

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__()
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional

    def _bucket(self, rel: torch.Tensor) -> torch.Tensor:
        buckets = torch.zeros_like(rel)
        n = self.num_buckets
        if self.bidirectional:
            n //= 2
            buckets = buckets + (rel > 0).to(rel.dtype) * n
            rel = rel.abs()
        else:
            rel = -torch.min(rel, torch.zeros_like(rel))
        max_exact = n // 2
        small = rel < max_exact
        large = max_exact + (
            torch.log(rel.float() / max_exact) / math.log(self.max_distance / max_exact) * (n - max_exact)
        ).to(torch.long)
        large = torch.min(large, torch.full_like(large, n - 1))
        return buckets + torch.where(small, rel, large)

    def forward(self, q_len: int, k_len: int) -> torch.Tensor:
        rel = torch.arange(k_len)[None, :] - torch.arange(q_len)[:, None]
        values = self.relative_attention_bias(self._bucket(rel))  # [q, k, H]
        return values.permute(2, 0, 1)


class RotaryHelper:
    """Interleaved-pair rotary embedding of the first ``rotary_dim`` features of each head.

    Holds no tensors that belong in a checkpoint (rotary models store no position tensors).
    """

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        base: float = 10000.0,
        scaling_factor: float = 1.0,
        scaling_type: str = "linear",
        extra_args: dict[str, Any] | None = None,
    ) -> None:
        if rotary_dim % 2:
            raise SimulationError(f"rotary_dim must be even, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        self.base = base
        self.scaling_factor = scaling_factor
        self.scaling_type = (scaling_type or "linear").lower()
        self.extra = dict(extra_args or {})
        if self.scaling_type not in ("linear", "yarn", "llama3"):
            raise SimulationError(
                f"pos_scaling_type {scaling_type!r} is not supported by the rotary helper",
                hint="use linear, yarn or llama3",
            )
        self._cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _inv_freq(self) -> tuple[torch.Tensor, float]:
        r = self.rotary_dim
        inv_freq = 1.0 / (self.base ** (torch.arange(0, r, 2) / r))
        mscale = 1.0
        if self.scaling_type == "yarn":
            inv_freq, mscale = self._yarn(inv_freq)
        elif self.scaling_type == "llama3":
            inv_freq = self._llama3(inv_freq)
        return inv_freq, mscale

    def _yarn(self, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
        r = self.rotary_dim
        extrapolation = float(self.extra.get("extrapolation_factor", 1.0))
        original = self.extra.get("original_max_position_embeddings")
        if original is None:
            raise SimulationError("yarn rotary scaling needs pos_scaling_extra_args.original_max_position_embeddings")
        beta_fast = self.extra.get("beta_fast", 32)
        beta_slow = self.extra.get("beta_slow", 1)

        def correction_dim(rotations: float) -> float:
            return (r * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(self.base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), r - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        mask = (1 - ramp) * extrapolation
        inv_freq = (inv_freq / self.scaling_factor) * (1 - mask) + inv_freq * mask
        scale = self.scaling_factor
        mscale = (
            1.0 if scale <= 1 else self.extra.get("mscale_a", 0.1) * math.log(scale) + self.extra.get("mscale_b", 1.0)
        )
        return inv_freq, mscale

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        factor = self.scaling_factor
        low_f = self.extra.get("low_freq_factor", 1)
        high_f = self.extra.get("high_freq_factor", 4)
        original = self.extra.get("original_max_position_embeddings", 8192)
        low_wavelen = original / low_f
        high_wavelen = original / high_f
        out = []
        for freq in inv_freq.tolist():
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                out.append(freq)
            elif wavelen > low_wavelen:
                out.append(freq / factor)
            else:
                smooth = (original / wavelen - low_f) / (high_f - low_f)
                out.append((1 - smooth) * freq / factor + smooth * freq)
        return torch.tensor(out, dtype=inv_freq.dtype)

    def _sin_cos(self, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if seq > self.max_positions:
            raise SimulationError(
                f"sequence length {seq} exceeds max_position_embeddings {self.max_positions} (rotary)",
                hint="use a shorter sequence",
            )
        if self._cache is None or self._cache[0] < seq:
            inv_freq, mscale = self._inv_freq()
            t = torch.arange(self.max_positions)
            if self.scaling_type == "linear":
                t = t / self.scaling_factor
            angles = torch.einsum("i,j->ij", t.to(inv_freq.dtype), inv_freq)
            sin = (torch.sin(angles) * mscale).repeat_interleave(2, dim=-1)
            cos = (torch.cos(angles) * mscale).repeat_interleave(2, dim=-1)
            self._cache = (self.max_positions, sin, cos)
        _, sin, cos = self._cache
        return sin[None, :seq, None, :].to(dtype), cos[None, :seq, None, :].to(dtype)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[batch, seq, heads, head_dim]``."""
        r = self.rotary_dim
        sin, cos = self._sin_cos(x.shape[1], x.dtype)
        rot, rest = x[..., :r], x[..., r:]
        x1 = rot[..., ::2]
        x2 = rot[..., 1::2]
        every_two = torch.stack((-x2, x1), dim=-1).flatten(-2)
        rot = rot * cos + every_two * sin
        return torch.cat([rot, rest], dim=-1) if rest.shape[-1] else rot


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


# --- feed-forward ---------------------------------------------------------------------------


class SingleFeedForwardLayer(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, activation: str | None, dropout: float | None
    ) -> None:
        super().__init__()
        check_activation(activation)
        self.linear_layer = nn.Linear(in_features, out_features, bias=bias)
        self.glu = is_glu(activation)
        if self.glu:
            self.linear_layer_for_glu = nn.Linear(in_features, out_features, bias=bias)
            self.act: Callable[[torch.Tensor], torch.Tensor] | None = GLU_ACTIVATIONS[activation.lower()]
        else:
            self.act = UNARY_ACTIVATIONS[activation.lower()] if activation else None
        self.dropout_layer = nn.Dropout(dropout) if dropout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.glu:
            out = self.linear_layer(x) * self.act(self.linear_layer_for_glu(x))
        else:
            out = self.linear_layer(x)
            if self.act is not None:
                out = self.act(out)
        if self.dropout_layer is not None:
            out = self.dropout_layer(out)
        return out


class FeedForwardNetwork(nn.Module):
    """``ffn.{i}.linear_layer``: a stack of linear layers with per-layer activation and dropout."""

    def __init__(
        self,
        input_unit: int,
        layers_units: list[int],
        *,
        activations: list[str | None] | None = None,
        dropouts: list[float | None] | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        n = len(layers_units)
        activations = activations or [None] * n
        dropouts = dropouts or [None] * n
        ins = [input_unit, *layers_units[:-1]]
        self.ffn = nn.ModuleList(
            SingleFeedForwardLayer(i, o, bias=bias, activation=a, dropout=d)
            for i, o, a, d in zip(ins, layers_units, activations, dropouts, strict=True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.ffn:
            x = layer(x)
        return x


class ExpertsLinear(nn.Module):
    """``expert_weights`` ``[out, num_experts, in]`` (``expert_biases`` ``[out, num_experts, 1]``)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.expert_weights = nn.Parameter(torch.empty(out_features, num_experts, in_features))
        self.expert_biases = nn.Parameter(torch.empty(out_features, num_experts, 1)) if bias else None
        bound = 1.0 / math.sqrt(in_features)
        nn.init.uniform_(self.expert_weights, -bound, bound)
        if self.expert_biases is not None:
            nn.init.uniform_(self.expert_biases, -bound, bound)

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        # x [B, S, K, in], indices [B, S, K] -> [B, S, K, out]
        w = self.expert_weights.permute(1, 0, 2)[indices]  # [B, S, K, out, in]
        out = torch.einsum("bski,bskoi->bsko", x, w)
        if self.expert_biases is not None:
            out = out + self.expert_biases.permute(1, 0, 2)[indices].squeeze(-1)
        return out


class FusedExpertsLayer(nn.Module):
    def __init__(self, num_experts: int, in_f: int, out_f: int, *, bias: bool, activation: str | None) -> None:
        super().__init__()
        check_activation(activation)
        self.linear_layer = ExpertsLinear(num_experts, in_f, out_f, bias)
        self.glu = is_glu(activation)
        if self.glu:
            self.linear_layer_for_glu = ExpertsLinear(num_experts, in_f, out_f, bias)
            self.act = GLU_ACTIVATIONS[activation.lower()]
        else:
            self.act = UNARY_ACTIVATIONS[activation.lower()] if activation else None

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self.glu:
            return self.linear_layer(x, indices) * self.act(self.linear_layer_for_glu(x, indices))
        out = self.linear_layer(x, indices)
        return self.act(out) if self.act is not None else out


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, d_model: int, filter_size: int, *, bias: bool, activation: str) -> None:
        super().__init__()
        self.fused_ffns = nn.ModuleList(
            [
                FusedExpertsLayer(num_experts, d_model, filter_size, bias=bias, activation=activation),
                FusedExpertsLayer(num_experts, filter_size, d_model, bias=bias, activation=None),
            ]
        )

    def forward(self, x: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        out = x[:, :, None, :].expand(-1, -1, indices.shape[-1], -1)
        for layer in self.fused_ffns:
            out = layer(out, indices)
        return (out * probs[..., None]).sum(-2)


class SparseMoE(nn.Module):
    """Learned top-k routing: softmax over ``gate`` logits (float32), top-k, renormalised weights."""

    def __init__(
        self,
        d_model: int,
        filter_size: int,
        *,
        num_experts: int,
        top_k: int,
        bias: bool,
        activation: str,
        normalize: bool = True,
        router_fp32: bool = True,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise SimulationError(f"moe.top_k {top_k} must be between 1 and num_experts {num_experts}")
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, d_model, filter_size, bias=bias, activation=activation)
        self.top_k = top_k
        self.normalize = normalize
        self.router_fp32 = router_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.router_fp32:
            logits = logits.float()
        weights = F.softmax(logits, dim=-1).to(x.dtype)
        probs, indices = weights.topk(self.top_k)
        if self.normalize:
            probs = probs / probs.sum(-1, keepdim=True)
        return self.experts(x, probs, indices)


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
