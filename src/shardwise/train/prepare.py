"""``prepare``: shardwise's wrapping for users who keep their own training loop.

::

    model, optimizer, loader = shardwise.prepare(model, lambda p: torch.optim.SGD(p, lr=0.1), dataset, batch_size=32)
    for epoch in range(3):
        for x, y in loader:                      # this rank's shard, reshuffled every epoch
            x, y = x.to(device), y.to(device)
            loss = loss_fn(model(x), y)
            loss.backward()                      # DDP all-reduces the gradients
            optimizer.step(); optimizer.zero_grad()

``batch_size`` is per process (as in a plain DDP script); the global batch is ``batch_size *
dp_size``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from shardwise.runtime import env as runtime
from shardwise.data.loader import DistributedLoader, LoaderOptions, train_loader
from shardwise.errors import ConfigError
from shardwise.parallel.ddp import DDPOptions
from shardwise.layout import Plan
from shardwise.parallel.mesh import Meshes
from shardwise.parallel.parallelize import ParallelModel
from shardwise.runtime.detect import RuntimeEnv
from shardwise.train.auto import AutoData
from shardwise.train.build import build


class Prepared(tuple):
    """Unpacks as ``model, optimizer, loader``; ``.parallel`` (the ParallelModel), ``.meshes`` and
    ``.env`` are there for inspection."""

    def __new__(cls, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DistributedLoader, *, parallel: ParallelModel, meshes: Meshes, env: RuntimeEnv) -> Prepared:
        self = super().__new__(cls, (model, optimizer, loader))
        self.parallel, self.meshes, self.env = parallel, meshes, env
        return self

    @property
    def model(self) -> nn.Module:
        """The wrapped module (DDP, FSDP ...): call it and backward through it."""
        return self[0]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self[1]

    @property
    def loader(self) -> DistributedLoader:
        return self[2]


def prepare(
    model: nn.Module,
    optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    data: DataLoader | Dataset,
    *,
    plan: Plan | str = "dp",
    batch_size: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    ddp: DDPOptions = DDPOptions(),
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Prepared:
    """Initialize the process group if needed, wrap ``model`` for ``plan``, build the optimizer on
    the wrapped parameters, and shard ``data`` over the data-parallel ranks.

    A ``DataLoader`` keeps its batch size (per process), collate function, workers and pinning; its
    sampler is replaced by a distributed one (an epoch ends at the last full global batch).
    """
    if isinstance(data, DataLoader):
        dataset = data.dataset
        batch_size = batch_size or data.batch_size
        options = LoaderOptions(
            num_workers=data.num_workers if num_workers is None else num_workers,
            pin_memory=data.pin_memory if pin_memory is None else pin_memory,
            persistent_workers=data.persistent_workers,
            collate_fn=collate_fn or data.collate_fn,
        )
    else:
        dataset = data
        options = LoaderOptions(num_workers=num_workers or 0, pin_memory=bool(pin_memory), collate_fn=collate_fn)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigError(f"prepare needs a positive batch size, got {batch_size!r}",
                          hint="pass batch_size= (samples per process per step) or a DataLoader with one")
    # The Trainer's build step (train/build.py); "auto" plans for batch_size on every process, with
    # the sample shape from the dataset (no loss function here, so nothing to certify with).
    built = build(model, optimizer_factory, plan=plan, global_batch_size=batch_size * runtime.init().world_size, seed=seed, ddp=ddp,
                  data=AutoData(dataset, options.collate_fn))
    pm, meshes, env = built.model, built.meshes, built.env
    dp_rank, dp_size = built.dp_rank, built.dp_size
    optimizer = built.optimizer
    loader = train_loader(
        dataset,
        micro_batch_size=batch_size,
        global_batch_size=batch_size * dp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=shuffle,
        options=options,
    )
    return Prepared(pm.module, optimizer, DistributedLoader(loader), parallel=pm, meshes=meshes, env=env)
