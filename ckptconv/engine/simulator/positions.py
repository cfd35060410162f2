"""Position information for the simulator's transformers, as the Model Zoo computes it.

Learned and fixed (sinusoidal) position embeddings, ALiBi and T5 relative-position biases, and
rotary embeddings that rotate interleaved pairs ``(2j, 2j+1)`` (Hugging Face llama rotates halves).
Module attribute names match Cerebras checkpoint keys (see ``layers``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckptconv.core.errors import SimulationError


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
