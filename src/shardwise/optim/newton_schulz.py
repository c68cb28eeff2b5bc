"""The Newton–Schulz orthogonalization of Muon, on whole matrices or their units.

Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training") replaces the
momentum ``M`` of a weight matrix by ``O ≈ U Vᵀ`` (``M = U S Vᵀ``), computed with ``k`` steps of
the quintic iteration (torch's ``torch.optim.Muon``: ``(a, b, c) = (3.4445, -4.7750, 2.0315)``,
``k = 5``)::

    X ← M / max(‖M‖_F, eps)           (transposed first when M has more rows than columns)
    A ← X Xᵀ;  X ← a X + (b A + c A²) X      (k times)

``O`` depends on the whole matrix (its Frobenius norm and its Gram matrix), so a shard of ``M``
gives another ``O``: callers must hand this module whole matrices (:mod:`shardwise.optim.exchange`).

A parameter is orthogonalized per *unit* (:class:`Units`): the pieces of a fused projection
(q|k|v, gate|up) one by one, every expert of a 3-D MoE weight one by one (a batch). Each unit's
result is scaled by its learning-rate ratio (``adjust_lr``, from the unit's global shape ``(A, B)``
= (fan-out, fan-in)): ``"original"``: ``sqrt(max(1, A/B))``; ``"match_rms_adamw"``: ``0.2 sqrt(max(A, B))``.
Pure tensor math, no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_STEPS = 5
DEFAULT_EPS = 1e-7
ADJUST_LR = ("original", "match_rms_adamw")


@dataclass(frozen=True)
class Units:
    """How a parameter's global tensor divides into the matrices Muon orthogonalizes.

    ``logical``: the single-device shape the global tensor is reshaped to first (a tensor-parallel
    fused view ``(3, w, in)`` is ``(3w, in)`` again); 2-D, or 3-D for a batch (MoE experts, dim 0).
    ``split_dim``/``sizes``: the fused pieces along that dim of ``logical`` (None: one piece).
    ``fan_out_dim``: the logical dim that is the output features (0 for Linear, 1 for GPT-2's
    Conv1D, which stores ``(in, out)``), for ``adjust_lr``'s ``(A, B)``.
    """

    logical: tuple[int, ...]
    split_dim: int = 0
    sizes: tuple[int, ...] | None = None
    fan_out_dim: int = 0

    def __post_init__(self) -> None:
        if len(self.logical) not in (2, 3):
            raise ValueError(f"Muon units are matrices or batches of matrices, not shape {self.logical}")
        if self.sizes is not None and sum(self.sizes) != self.logical[self.split_dim]:
            raise ValueError(f"pieces {self.sizes} do not add up to dim {self.split_dim} of {self.logical}")

    @property
    def count(self) -> int:
        """How many matrices this parameter is (pieces x experts)."""
        return (len(self.sizes) if self.sizes else 1) * (self.logical[0] if len(self.logical) == 3 else 1)


def newton_schulz(
    g: torch.Tensor,
    *,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    steps: int = DEFAULT_STEPS,
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``steps`` quintic Newton–Schulz iterations on the last two dims of ``g`` (a matrix or a batch),
    in ``dtype``; returns ``dtype``. FLOPs per (m x n) matrix, m <= n: ``steps * (4 m² n + 2 m³)``."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:  # torch's own kernels and order (addmm), so bf16 rounds as torch.optim.Muon does
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x
    batch = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.reshape(*batch, *x.shape[-2:])
    return x.mT if tall else x


def lr_ratio(shape: tuple[int, int], adjust_lr: str | None) -> float:
    """``adjust_lr`` for one matrix of ``shape = (A, B)`` = (fan-out, fan-in), as torch's Muon."""
    a, b = shape
    if adjust_lr in (None, "original"):
        return math.sqrt(max(1.0, a / b))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    raise ValueError(f"adjust_lr={adjust_lr!r}: use one of {ADJUST_LR}")


def orthogonalize(
    full: torch.Tensor, units: Units, *, adjust_lr: str | None = "original", **ns: object
) -> torch.Tensor:
    """Newton–Schulz of every unit of ``full`` (a parameter's whole update, in its global shape),
    each scaled by its ``lr_ratio``; returns ``full``'s shape in the Newton–Schulz dtype."""
    x = full.reshape(units.logical)
    pieces = x.split(list(units.sizes), dim=units.split_dim) if units.sizes else (x,)
    out = []
    for piece in pieces:
        rows, cols = piece.shape[-2:]
        fan = (rows, cols) if units.fan_out_dim == len(units.logical) - 2 else (cols, rows)
        out.append(newton_schulz(piece, **ns) * lr_ratio(fan, adjust_lr))  # type: ignore[arg-type]
    return torch.cat(out, dim=units.split_dim).reshape(full.shape)
