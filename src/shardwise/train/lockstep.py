"""The batch loop that evaluation and prediction share: every batch of a rank's shard, with the
ranks' forwards in lockstep.

Each data-parallel rank reads its own unpadded shard (:class:`~shardwise.data.sampler.EvalSampler`),
so shards may differ by one sample and so by one batch. When the forward itself communicates
(FSDP all-gathers, TP collectives, pipeline sends) every rank must run the same number of
forwards: the count of batches is agreed by one all-reduce MAX over the world, and a rank with
fewer batches repeats its last one (or, with an empty shard, a batch of the dataset's first
sample) and drops the result. Without such communication each rank runs only its own batches.

Per step, in eval mode and under ``no_grad``: ``part = shard(batch)`` (this rank's part of the
batch: under context parallelism its sequence chunks, which the split attention needs before the
step context opens), ``output = forward(part)`` under autocast and the plan's step context
(:meth:`~shardwise.parallel.parallelize.ParallelModel.step_context`), then, for a real batch only
and outside those contexts, ``collect(output)``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from shardwise.parallel.parallelize import ParallelModel
from shardwise.data.batch import move_batch
from shardwise.parallel.precision import autocast


def forward_module(pm: ParallelModel) -> nn.Module:
    """The module to call for a no-grad forward: DDP adds nothing to one but may sync buffers, so
    its replica itself."""
    return pm.module.module if isinstance(pm.module, DistributedDataParallel) else pm.module


def forwards_communicate(pm: ParallelModel) -> bool:
    """Whether a forward under ``pm.plan`` talks to other ranks (so all must run equally many)."""
    plan = pm.plan
    return plan.fsdp_enabled or plan.tp_enabled or plan.pp_enabled or plan.cp_enabled


def _agreed_steps(pm: ParallelModel, n_local: int, device: torch.device) -> int:
    if not (forwards_communicate(pm) and dist.is_initialized()):
        return n_local
    count = torch.tensor([n_local], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


@torch.no_grad()
def run_batches(
    pm: ParallelModel,
    loader: DataLoader,
    *,
    shard: Callable[[Any], Any],
    forward: Callable[[Any], Any],
    collect: Callable[[Any], None],
    precision: str,
    device: torch.device,
    non_blocking: bool = False,
) -> None:
    """``forward(shard(batch))`` on every batch behind ``loader`` (and the extra lockstep forwards),
    ``collect`` on the real ones (see the module doc); the module's train/eval mode is restored after."""
    module = forward_module(pm)
    was_training = module.training
    module.eval()
    n_local = len(loader)
    it, last = iter(loader), None
    try:
        for i in range(_agreed_steps(pm, n_local, device)):
            real = i < n_local
            if real:
                last = move_batch(next(it), device, non_blocking)
            elif last is None:  # this rank's shard is empty: borrow one sample for the forward
                last = move_batch(loader.collate_fn([loader.dataset[0]]), device, non_blocking)
            part = shard(last)
            with autocast(precision, device.type), pm.step_context():
                output = forward(part)
            if real:
                collect(output)
    finally:
        module.train(was_training)
