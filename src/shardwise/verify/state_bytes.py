"""What a rank holds: its parameter, gradient and optimizer-state bytes over its local shards
(a DTensor counts its local tensor), reported beside the single-process figures."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def memory_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes, summed over its local tensors."""
    opt = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"param": _local_bytes(params), "grad": _local_bytes(p.grad for p in params if p.grad is not None),
            "optim": _local_bytes(state)}
