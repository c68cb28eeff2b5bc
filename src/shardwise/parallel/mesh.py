"""Build the named device meshes a :class:`~shardwise.layout.Plan` describes.

The root mesh is always 5-D, ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``, size-1 dimensions
included, so code can always ask for a dimension by name. :class:`Meshes` also keeps flattened
views:

- ``dp`` = dp_replicate x dp_shard: the ranks that load different batches (data loading);
- ``tokens`` = dp_replicate x dp_shard x cp: the ranks that see different tokens, over which the
  loss, the metrics and the gradients are reduced (with ``cp == 1`` it is ``dp``);
- ``shard`` = dp_shard x cp: what FSDP shards over (context-parallel ranks hold the same weights,
  so torchtitan folds cp into the shard dimension; with ``cp == 1`` it is ``dp_shard``).

Rank order: tp is innermost, so with ``tp <= GPUs per node`` the TP group stays inside one node
(the fastest links); cp next (its K/V all-gather is the next heaviest traffic); pp is outermost
(only point-to-point activations cross it).
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
    tokens: DeviceMesh  # flattened (dp_replicate, dp_shard, cp), 1-D
    shard: DeviceMesh  # flattened (dp_shard, cp), 1-D

    @property
    def pp(self) -> DeviceMesh:
        return self.root["pp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.root["tp"]

    @property
    def cp(self) -> DeviceMesh:
        return self.root["cp"]

    @property
    def dp_replicate(self) -> DeviceMesh:
        return self.root["dp_replicate"]

    @property
    def dp_shard(self) -> DeviceMesh:
        return self.root["dp_shard"]

    @property
    def hsdp(self) -> DeviceMesh:
        """2-D (dp_replicate, shard) mesh for HSDP: replicate across rows, shard within a row."""
        if self.cp.size() == 1:
            return self.root["dp_replicate", "dp_shard"]
        return self.root["dp_replicate", "dp_shard_cp"]

    @property
    def device_type(self) -> str:
        return self.root.device_type


def build_mesh(plan: Plan, device_type: str) -> Meshes:
    """The meshes for ``plan`` over the current world (the default process group must exist)."""
    plan.check_world(dist.get_world_size())
    root = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=MESH_DIMS)
    dp = root["dp_replicate", "dp_shard"]._flatten("dp")
    if not plan.cp_enabled:
        return Meshes(root=root, dp=dp, tokens=dp, shard=root["dp_shard"])
    tokens = root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    shard = root["dp_shard", "cp"]._flatten("dp_shard_cp")
    return Meshes(root=root, dp=dp, tokens=tokens, shard=shard)
