"""Replaying a model's construction-time initialization after it was built on ``meta``.

For each module in registration order that owns parameters, its ``reset_parameters()`` runs on a
full-size CPU stand-in under ``torch.manual_seed(seed)``, and each tensor keeps its own slice
(``distribute_tensor(..., src_data_rank=None)``: a local slice, no communication). Used by
:mod:`shardwise.parallel.init` (materializing a parallelized model) and by pipeline stages
cut from a meta model (:mod:`shardwise.parallel.pipeline.split`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardwise.errors import ConfigError


@torch.no_grad()
def replay_reset_parameters(model: nn.Module, *, seed: int) -> None:
    """Re-draw ``model``'s parameters as construction would have with ``torch.manual_seed(seed)``
    (module by module, in registration order), each rank keeping only its own shard."""
    torch.manual_seed(seed)
    for name, module in model.named_modules():
        params = {n: p for n, p in module._parameters.items() if p is not None}
        buffers = {n: b for n, b in module._buffers.items() if b is not None}
        if not params and not buffers:
            continue
        if not callable(getattr(module, "reset_parameters", None)):
            if not params:
                continue  # buffers without a reset (e.g. a constant mask) are the model's business
            raise ConfigError(
                f"cannot initialize {name or type(model).__name__} ({type(module).__name__}) after meta construction: "
                "it owns parameters but has no reset_parameters()",
                hint="give the model an init_weights(seed) method, or pass init=... to materialize",
            )
        stand_in = _stand_in(module, params, buffers)
        stand_in.reset_parameters()
        for n, p in params.items():
            _copy_shard(p, stand_in._parameters[n])
        for n, b in buffers.items():
            _copy_shard(b, stand_in._buffers[n])


def _stand_in(module: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of ``module`` whose own tensors are full-size CPU tensors (children dropped)."""
    stand_in = object.__new__(type(module))
    stand_in.__dict__.update(module.__dict__)
    stand_in.__dict__["_parameters"] = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype)) for n, p in params.items()}
    stand_in.__dict__["_buffers"] = {n: torch.empty(b.shape, dtype=b.dtype) for n, b in buffers.items()}
    stand_in.__dict__["_modules"] = {}
    return stand_in


def _copy_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        local = distribute_tensor(full.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(full)
