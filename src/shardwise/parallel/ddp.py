"""Data parallel with DDP (placeholder options; the trainer work fills in hooks and tuning)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class DDPOptions:
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, *, options: DDPOptions) -> nn.Module:
    """Wrap ``model`` in DDP over the ``dp`` mesh: one gradient all-reduce per bucket per step."""
    device = next(model.parameters()).device
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=dp_mesh.get_group(),
        bucket_cap_mb=options.bucket_cap_mb,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        static_graph=options.static_graph,
        find_unused_parameters=options.find_unused_parameters,
    )
