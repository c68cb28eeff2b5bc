"""A mixture-of-experts MLP for the built-in GPT, written as plain single-device code.

Each token's hidden state ``x`` picks its ``k`` best experts by a linear router (Shazeer et al.
2017; Mixtral, Jiang et al. 2024)::

    p = softmax(W_r x)                     over the E experts
    S = top_k(p)                           k experts per token, weights w_i = p_i / sum_{j in S} p_j
    y = sum_{i in S} w_i * down_i(gelu(up_i(x)))

Dropless: every token is processed by all of its ``k`` experts (no capacity limit). The expert
weights are stored as 3-D tensors (``up_proj[E, F, H]``, ``down_proj[E, H, F]``) with the same
interface as Hugging Face's fused experts, ``experts(x[T, H], top_k_index[T, k],
top_k_weights[T, k])``, so expert parallelism (:mod:`shardwise.parallel.ep`) treats both alike.

**Load balancing, sequence-wise** (DeepSeek-V3, Liu et al. 2024, eqs. 17-20): for each sequence of
``S`` tokens, ``f_i = E / (k S) * #{tokens routed to i}`` and ``P_i = mean_t p_{i,t}``;
``L_bal = alpha * sum_i f_i P_i``, averaged over the sequences. Computed per sequence, it is a mean
over samples like the language-model loss, so data and expert parallelism reproduce one process
exactly. The term reaches the router through the output (``_AuxLoss``: the output is unchanged,
and backward adds ``aux_loss_scale * dL_bal`` to the router's gradient); the trainer sets
``aux_loss_scale`` to the factor it scales the main loss by (accumulation, fp16 loss scale).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """Top-k softmax gating: ``(probabilities[T, E], top_k_weights[T, k], top_k_index[T, k])``."""

    def __init__(self, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        return probs, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), index


class Experts(nn.Module):
    """``E`` GELU MLPs as 3-D weights; ``forward(x[T, H], top_k_index[T, k], top_k_weights[T, k])``."""

    def __init__(self, hidden: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.up_proj = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, ffn))
        nn.init.normal_(self.up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in torch.unique(top_k_index).tolist():
            if not 0 <= expert < self.up_proj.shape[0]:
                continue  # an index a caller marks as "no expert"
            token, slot = torch.where(top_k_index == expert)
            h = F.linear(F.gelu(F.linear(x[token], self.up_proj[expert])), self.down_proj[expert])
            out.index_add_(0, token, h * top_k_weights[token, slot, None])
        return out


class _AuxLoss(torch.autograd.Function):
    """Identity on ``y``; backward also sends ``scale`` as the gradient of ``aux`` (Megatron-LM's
    MoEAuxLossAutoScaler), so the balancing loss trains the router without changing the output."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.shape, ctx.dtype = scale, aux.shape, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.shape, ctx.scale, dtype=ctx.dtype, device=grad.device), None


class MoE(nn.Module):
    """Router + experts in place of a block's MLP (see the module doc)."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, aux_loss: float) -> None:
        super().__init__()
        self.gate = Router(hidden, experts, top_k)
        self.experts = Experts(hidden, ffn, experts)
        self.aux_loss = aux_loss
        self.aux_loss_scale = 1.0  # set by the trainer to the main loss's scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        probs, weights, index = self.gate(flat)
        y = self.experts(flat, index, weights).view(b, s, h)
        if self.training and self.aux_loss > 0 and torch.is_grad_enabled():
            y = _AuxLoss.apply(y, self.balance_loss(probs.view(b, s, -1), index.view(b, s, -1)), self.aux_loss_scale)
        return y

    def balance_loss(self, probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``alpha * mean_sequences sum_i f_i P_i`` (module doc); ``probs[B, S, E]``, ``index[B, S, k]``."""
        b, s, e = probs.shape
        k = index.shape[-1]
        counts = torch.zeros(b, e, device=probs.device).scatter_add_(
            1, index.reshape(b, -1), torch.ones(b, s * k, device=probs.device)
        )
        f = counts * (e / (k * s))
        return self.aux_loss * (f * probs.mean(dim=1)).sum(dim=1).mean()
