"""``shardwise.optim.Muon``: Muon on the matrices, AdamW on the rest, exact under every plan.

Per Muon parameter ``W`` with gradient ``G`` (torch's ``torch.optim.Muon``, the same formulas)::

    B ← μ B + (1-μ) G                      momentum (one state, where W lives: a DTensor shard)
    U ← (1-μ) G + μ B  if nesterov else B
    O ← NS(U) per unit, scaled by adjust_lr   on whole matrices (shardwise.optim.exchange)
    W ← W (1 - lr·wd) - lr · O

Per AdamW parameter: torch's AdamW (decoupled weight decay, bias-corrected moments). Everything
but Newton–Schulz is element-wise and runs on the local shard; the parameters and states keep the
plan's placements, so DCP checkpoints save and reshard them like any optimizer's. The parameter
groups carry ``muon: True/False``; a Muon parameter's units come from
:func:`shardwise.optim.units.route` (build it with :func:`shardwise.optim.muon`, or pass ``units``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch
from torch.optim import Optimizer

from shardwise.optim.newton_schulz import ADJUST_LR, DEFAULT_COEFFICIENTS, DEFAULT_EPS, DEFAULT_STEPS, Units
from shardwise.optim.exchange import ROUTES, Item, orthogonalized
from shardwise.parallel.local import local_tensor


class Muon(Optimizer):
    """Muon (module doc). ``params``: tensors (all Muon, 2-D or 3-D) or groups with ``muon`` set;
    ``units``: ``{id(param): Units}`` (default: the whole parameter, a batch over dim 0 if 3-D);
    ``ns_dtype``: Newton–Schulz dtype (bf16 as torch; fp32 for exactness); ``route``: ``"all_to_all"``
    (owner ranks) or ``"gather"`` (the reference path)."""

    def __init__(self, params: Iterable[Any], lr: float = 0.02, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
                 ns_steps: int = DEFAULT_STEPS, eps: float = DEFAULT_EPS, adjust_lr: str | None = "original",
                 ns_dtype: torch.dtype = torch.bfloat16, route: str = "all_to_all",
                 adamw_lr: float = 3e-4, adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 0.1, units: Mapping[int, Units] | None = None) -> None:
        if adjust_lr not in (None, *ADJUST_LR):
            raise ValueError(f"adjust_lr={adjust_lr!r}: use one of {ADJUST_LR}")
        if route not in ROUTES:
            raise ValueError(f"route={route!r}: use one of {ROUTES}")
        if not 0 < ns_steps < 100 or lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError("Muon needs 0 < ns_steps < 100 and non-negative lr, momentum, weight_decay")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, muon=True,
                        betas=adamw_betas, eps=adamw_eps)
        self.adamw_defaults = dict(lr=adamw_lr, weight_decay=adamw_weight_decay)
        self.ns = dict(
            coefficients=tuple(ns_coefficients), steps=ns_steps, eps=eps, dtype=ns_dtype, adjust_lr=adjust_lr
        )
        self.route = route
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for g in groups:
            if not g.get("muon", True):
                g.update({k: v for k, v in self.adamw_defaults.items() if k not in g})
        super().__init__(groups, defaults)
        self.units: dict[int, Units] = {}
        for g in self.param_groups:
            for p in g["params"] if g["muon"] else ():
                u = (units or {}).get(id(p))
                if u is None and p.dim() not in (2, 3):
                    raise ValueError(
                        f"Muon takes 2-D (or 3-D batched) parameters, not shape {tuple(p.shape)}: give it to AdamW"
                    )
                self.units[id(p)] = u or Units(
                    logical=tuple(int(s) for s in p.shape), split_dim=p.dim() - 2, fan_out_dim=p.dim() - 2
                )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon(group, params)
            else:
                for p in params:
                    self._adamw(group, p)
        return loss

    def _muon(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        m, items = group["momentum"], []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)  # the parameter's own placement
            g, buf = local_tensor(p.grad), local_tensor(state["momentum_buffer"])
            buf.lerp_(g, 1 - m)
            items.append(Item(param=p, update=g.lerp(buf, m) if group["nesterov"] else buf, units=self.units[id(p)]))
        for item, o in zip(items, orthogonalized(items, route=self.route, **self.ns)):
            w = local_tensor(item.param)
            w.mul_(1 - group["lr"] * group["weight_decay"])
            w.add_(o.to(w.dtype), alpha=-group["lr"])

    def _adamw(self, group: dict[str, Any], p: torch.Tensor) -> None:
        """torch's single-tensor AdamW on the local shard."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        (b1, b2), lr = group["betas"], group["lr"]
        state["step"] += 1
        t = float(state["step"])
        w, g = local_tensor(p), local_tensor(p.grad)
        m, v = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
        w.mul_(1 - lr * group["weight_decay"])
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
        w.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
