"""Feed-forward blocks of the simulator's transformers: dense, GLU and mixture-of-experts.

GLU feed-forwards compute ``linear_layer(x) * act(linear_layer_for_glu(x))``; fused experts are
stored ``[out, num_experts, in]``. Module attribute names match Cerebras checkpoint keys (see
``layers``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ckptconv.core.errors import SimulationError
from ckptconv.engine.simulator.layers import GLU_ACTIVATIONS, UNARY_ACTIVATIONS, check_activation, is_glu


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
