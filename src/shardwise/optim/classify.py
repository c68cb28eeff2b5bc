"""Which optimizers a plan may shard, and the one-line refusal of those it cannot.

- **element-wise** (each value's update reads only that value's gradient and state): torch's SGD,
  Adam, AdamW, Adamax, NAdam, RAdam, Adagrad, Adadelta, RMSprop, Rprop, ASGD, SparseAdam. Exact on
  any shard, under every plan.
- **whole-tensor** (a norm, a factorization or a matrix function of a whole parameter): Muon,
  Adafactor's factored statistics, LAMB/LARS trust ratios, Shampoo/SOAP, and any optimizer shardwise
  does not know that defines its own ``step``. On a ZeRO-2/3, TP or EP shard it would run another
  algorithm, silently; the exception is :class:`shardwise.optim.Muon`, which moves whole matrices.
- **whole-model** (reads every parameter at once: L-BFGS): wrong on any partition, ZeRO-1's too.

Replicated parameters (dp, ZeRO-1's whole-parameter partitions for whole-tensor optimizers, a
pipeline stage's whole parameters, cp's replicas) are safe for all but whole-model ones.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.optim.muon import Muon

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop,
               torch.optim.ASGD, torch.optim.SparseAdam)
WHOLE_MODEL = (torch.optim.LBFGS,)


def kind(optimizer: torch.optim.Optimizer) -> str:
    """``"elementwise"``, ``"whole_tensor"``, ``"whole_model"`` or ``"muon"`` (shardwise's own, exact
    everywhere). A subclass of an element-wise optimizer that overrides ``step`` is whole-tensor."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim
    cls = type(optimizer)
    if isinstance(optimizer, Muon):
        return "muon"
    if isinstance(optimizer, WHOLE_MODEL):
        return "whole_model"
    stepper = next(c for c in cls.__mro__ if "step" in c.__dict__)  # the class whose step runs
    return "elementwise" if stepper in ELEMENTWISE else "whole_tensor"


def sharding(plan: Plan) -> str | None:
    """How ``plan`` splits parameters ("zero=3", "tp=2", ...), or None when every rank's
    parameters are whole (dp, ZeRO-1, pp, cp)."""
    parts = []
    if plan.zero >= 2 and plan.shard > 1:
        parts.append(f"zero={plan.zero}")
    parts += [f"{k}={getattr(plan, k)}" for k in ("tp", "ep") if getattr(plan, k) > 1]
    return ",".join(parts) or None


def allows(kind_: str, plan: Plan) -> bool:
    """Whether an optimizer of this :func:`kind` computes under ``plan`` what it computes on one
    process (``plan="auto"`` searches only such plans)."""
    split = sharding(plan)
    if kind_ == "whole_model":
        return not (split or (plan.zero == 1 and plan.shard > 1))
    return kind_ != "whole_tensor" or not split


def factory_kind(factory: Callable[..., torch.optim.Optimizer]) -> str:
    """The :func:`kind` of what ``factory`` builds (``shardwise.optim.muon(...)``: ``"muon"``),
    found by building it once over a 2x2 probe parameter."""
    if getattr(factory, "kind", None) == "muon":
        return "muon"
    return kind(factory([torch.nn.Parameter(torch.zeros(2, 2))]))


def check(optimizer: torch.optim.Optimizer, plan: Plan) -> None:
    """Refuse, before training, an optimizer that this plan would run wrongly (module doc)."""
    k = kind(optimizer)
    if allows(k, plan):
        return
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    name = f"{type(inner).__module__}.{type(inner).__qualname__}"
    split = sharding(plan)
    if k == "whole_model":
        raise ConfigError(
            f"optimizer {name} reads all parameters at once, which plan {split or 'zero=1'} splits over ranks",
            hint="use dp (replicated parameters), or an element-wise optimizer",
        )
    raise ConfigError(f"optimizer {name} acts on whole tensors, but plan {split} gives each rank shards of them "
                      "(it would silently run another algorithm)",
                      hint="use shardwise.optim.muon(...) for Muon, an element-wise optimizer (AdamW), or dp/zero=1/pp")
