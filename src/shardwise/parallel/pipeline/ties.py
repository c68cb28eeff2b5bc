"""Weights tied across pipeline stages (an embedding and the head on different ranks).

Each stage that uses a tied weight holds its own copy (:class:`TieSlot`). Per step, after the
schedule's backward, every copy's gradient increment of this step is all-reduced (SUM) over the
process group of the ranks holding a copy, so each ends with the single-process gradient of a
weight used twice: one all-reduce of the weight's size per tie and step. The groups follow the
mesh layout with ``pp`` outermost (:func:`tie_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.parallel.pipeline.split import Tie
from shardwise.parallel.local import local_tensor


@dataclass(frozen=True)
class TieSlot:
    """This rank's copy of a tied weight: its stage module, its name there, the group of the ranks
    holding the other copies, and whether it is the copy the gradient norm counts."""

    module: nn.Module
    name: str
    group: dist.ProcessGroup
    counted: bool


def tie_slots(
    ties: Sequence[Tie], pairs: Sequence[tuple[int, nn.Module]], pp_mesh: DeviceMesh, *, plan: Plan
) -> list[TieSlot]:
    """Process groups for the tied weights (collective: every rank calls it with the same ties).

    The mesh puts ``pp`` outermost, so the rank of pipeline stage-rank ``k`` at inner position
    ``j`` is ``k * inner + j`` (``inner`` = world / pp); a tie between pipeline ranks ``K`` gets
    one group per ``j``, or the pp group itself when it spans every pipeline rank.
    """
    if not ties:
        return []
    world, rank = dist.get_world_size(), dist.get_rank()
    inner = world // plan.pp
    if dist.get_process_group_ranks(pp_mesh.get_group()) != [k * inner + rank % inner for k in range(plan.pp)]:
        raise ConfigError("tied weights across pipeline stages need the default mesh layout (pp outermost)",
                          hint="untie the weights or use pp=1")
    local = dict(pairs)
    slots = []
    for tie in ties:
        holders = sorted({s % plan.pp for s, _ in tie.holders})
        group = pp_mesh.get_group() if len(holders) == plan.pp else None
        if group is None:
            for j in range(inner):
                made = dist.new_group([k * inner + j for k in holders])
                if j == rank % inner:
                    group = made
        for index, (s, name) in enumerate(tie.holders):
            if s in local:
                slots.append(TieSlot(local[s], name, group, counted=index == 0))
    return slots



def grad_copy(slot: TieSlot) -> torch.Tensor | None:
    grad = local_tensor(slot.module.get_parameter(slot.name).grad)
    return None if grad is None else grad.detach().clone()


@torch.no_grad()
def sum_tied_grad(slot: TieSlot, before: torch.Tensor | None) -> None:
    """Add the other holders' gradient contributions of this step to this copy's gradient.

    Only this step's increment ``g - g_before`` is all-reduced (SUM over the holders), so
    gradients accumulated over several steps are not summed twice; every holder ends with the
    same gradient, the one of the single-process model where the weight is used twice.
    """
    param = slot.module.get_parameter(slot.name)
    grad = local_tensor(param.grad)
    current = grad if grad is not None else torch.zeros_like(local_tensor(param))
    delta = current - before if before is not None else current.clone()
    dist.all_reduce(delta, group=slot.group)
    total = delta if before is None else before + delta
    if grad is not None:
        grad.copy_(total)
    elif isinstance(param, DTensor):
        param.grad = DTensor.from_local(
            total, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    else:
        param.grad = total
