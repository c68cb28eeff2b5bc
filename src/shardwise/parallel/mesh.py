"""Build the named device meshes a :class:`~shardwise.plan.Plan` describes.

The root mesh is always 4-D, ``("pp", "dp_replicate", "dp_shard", "tp")``, size-1 dimensions
included, so code can always ask for a dimension by name. :class:`Meshes` also keeps the
flattened data-parallel mesh ``dp`` = dp_replicate x dp_shard: the ranks that see different
batches (data loading, loss and metric reduction, DDP's all-reduce).

Rank order: tp is innermost, so with ``tp <= GPUs per node`` the TP group stays inside one node
(the fastest links); pp is outermost (only point-to-point activations cross it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.layout import MESH_DIMS, Plan


@dataclass(frozen=True)
class Meshes:
    """The root mesh and the views each technique uses."""

    root: DeviceMesh
    dp: DeviceMesh  # flattened (dp_replicate, dp_shard), 1-D

    @property
    def pp(self) -> DeviceMesh:
        return self.root["pp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.root["tp"]

    @property
    def dp_replicate(self) -> DeviceMesh:
        return self.root["dp_replicate"]

    @property
    def dp_shard(self) -> DeviceMesh:
        return self.root["dp_shard"]

    @property
    def hsdp(self) -> DeviceMesh:
        """2-D (dp_replicate, dp_shard) mesh for HSDP: replicate across rows, shard within a row."""
        return self.root["dp_replicate", "dp_shard"]

    @property
    def device_type(self) -> str:
        return self.root.device_type


def build_mesh(plan: Plan, device_type: str) -> Meshes:
    """The meshes for ``plan`` over the current world (the default process group must exist)."""
    plan.check_world(dist.get_world_size())
    root = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=MESH_DIMS)
    dp = root["dp_replicate", "dp_shard"]._flatten("dp")
    return Meshes(root=root, dp=dp)
