"""Clipping by the global gradient norm, correct under every sharding.

The global 2-norm of the gradient is ``sqrt(sum_p ||g_p||^2)`` over *all* parameters of the
model, wherever their pieces live. Each rank computes the sum of squares of its local pieces and
reduces only over the ranks that hold *different* pieces:

- a plain tensor (DDP replica, unsharded parameter) is complete on this rank: no reduction;
- a DTensor contributes ``||local shard||^2``, summed (all-reduce SUM) over each mesh dimension
  on which it is ``Shard``-ed, and *not* over its ``Replicate`` dimensions (the same values are
  held there; summing would count them several times). ``Partial`` gradients are first reduced to
  ``Replicate`` (a Partial local value is an addend, and the norm of a sum is not the sum of norms);
- with pipeline parallelism each stage holds different layers, so the per-stage totals are summed
  over the ``pp`` group.

For the inf-norm, SUM becomes MAX. The result is the same float on every rank, so every rank
applies the same clipping coefficient ``min(1, max_norm / (norm + 1e-6))`` and replicas stay
identical.

Communication: one scalar all-reduce per distinct set of sharded mesh dimensions (usually zero
for DDP, one for FSDP or TP), plus one over ``pp``.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

try:  # FSDP x TP parameters carry _StridedShard, which (in torch 2.13) is not a Shard subclass
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = ()  # type: ignore[assignment,misc]


def _is_sharded(placement: Placement) -> bool:
    return placement.is_shard() or isinstance(placement, _StridedShard)


def _sharded_groups(grad: DTensor) -> tuple[tuple[str, dist.ProcessGroup], ...]:
    """The process groups of the mesh dimensions ``grad`` is sharded on, in mesh order."""
    mesh = grad.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    return tuple(
        (f"{names[i]}:{dist.get_process_group_ranks(mesh.get_group(i))}", mesh.get_group(i))
        for i, placement in enumerate(grad.placements)
        if _is_sharded(placement) and mesh.size(i) > 1
    )


def global_grad_norm(
    parameters: Iterable[torch.nn.Parameter], *, norm_type: float = 2.0, pp_group: dist.ProcessGroup | None = None,
    skip: Iterable[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """The norm of all gradients of the model as a 0-d fp32 tensor, equal on every rank (see module
    doc). ``skip``: second copies of a weight held by two pipeline stages (counted once)."""
    inf = math.isinf(norm_type)
    partials: dict[str, tuple[tuple[dist.ProcessGroup, ...], torch.Tensor]] = {}
    device = None
    skipped = {id(p) for p in skip}
    for p in parameters:
        g = p.grad
        if g is None or id(p) in skipped:
            continue
        groups: tuple[tuple[str, dist.ProcessGroup], ...] = ()
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
            groups = _sharded_groups(g)
            g = g.to_local()
        device = g.device
        local = g.detach().abs().max().float() if inf else g.detach().float().pow(2).sum()
        if g.numel() == 0:
            local = torch.zeros((), device=g.device)
        key = "|".join(name for name, _ in groups)
        if key in partials:
            prev = partials[key][1]
            partials[key] = (partials[key][0], torch.maximum(prev, local) if inf else prev + local)
        else:
            partials[key] = (tuple(pg for _, pg in groups), local)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = torch.zeros((), device=device or "cpu")
    # Sorted keys: every member of a group issues its all-reduces in the same order.
    for key in sorted(partials):
        pgs, value = partials[key]
        for pg in pgs:  # reducing over each sharded dimension in turn = reducing over their product
            dist.all_reduce(value, op=op, group=pg)
        total = torch.maximum(total, value) if inf else total + value
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, op=op, group=pp_group)
    return total if inf else total.sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
    skip: Iterable[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Scale all gradients in place so their global norm is at most ``max_norm``; return the norm
    before clipping (a 0-d tensor, the same on every rank). ``skip`` as in :func:`global_grad_norm`
    (those gradients are scaled too, by the same coefficient)."""
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params, norm_type=norm_type, pp_group=pp_group, skip=skip)
    # No host sync (no `if isfinite`): like torch.nn.utils.clip_grad_norm_, a non-finite norm
    # propagates into the gradients; fp16 steps with inf/nan are skipped by the loss scaler before.
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), group in by_device.items():
        torch._foreach_mul_(group, coef.to(dev))
    return norm
