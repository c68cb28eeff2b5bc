"""The global gradient norm computed by DTensor itself: a cross-check for clipping code.

``||g||_2 = sqrt(sum_p sum(g_p ** 2))``. For a DTensor gradient, ``(g ** 2).sum()`` is a DTensor
op: torch's sharding propagation knows every placement (``Shard``, ``_StridedShard`` of FSDP x TP,
``Replicate``) and yields a ``Partial`` scalar over exactly the mesh dimensions that hold different
pieces; ``full_tensor()`` all-reduces it. Plain tensors (DDP replicas, TP-replicated norms) are
complete on each rank. With pipeline stages the per-stage sums are added over ``pp_group``.

Communication: one scalar all-reduce per DTensor parameter (plus one over pp): simple and exact,
meant for verification (``shardwise verify``, parity tests), not for the hot path of every step;
:func:`shardwise.train.clip.global_grad_norm` groups these reductions for training.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def reference_grad_norm(parameters: Iterable[torch.nn.Parameter], *, pp_group: dist.ProcessGroup | None = None,
                        skip: Iterable[torch.nn.Parameter] = ()) -> torch.Tensor:
    """The 2-norm of all gradients (0-d fp32, the same on every rank); see the module doc.
    ``skip``: second copies of a weight that two pipeline stages hold (tied embeddings)."""
    total = torch.zeros((), dtype=torch.float64)
    skipped = {id(p) for p in skip}
    for p in parameters:
        g = p.grad
        if g is None or id(p) in skipped:
            continue
        square = g.detach().float().pow(2).sum()
        if isinstance(square, DTensor):
            square = square.full_tensor()
        total += square.double().cpu()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt().float()
