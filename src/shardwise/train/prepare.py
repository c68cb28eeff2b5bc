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

A token-mean loss (masked cross-entropy, ``-100`` for padding and prompts) with accumulation or
uneven masks: ``prepare(..., loss_reduction="tokens")`` and weigh each micro-batch's loss by
:meth:`Prepared.loss_weights` before backward, counted once per optimizer step::

    weights = prepared.loss_weights([y for _, y in micro_batches])   # one all-reduce of one integer
    for i, (x, y) in enumerate(micro_batches):
        (loss_fn(model(x), y) * weights[i]).backward()                # = one process on the global batch

A plan with runtime options (``params16``, ``chunked_loss``, ``sharded_accumulation``): pass the
loop's ``loss_fn=`` and call ``prepared.loss_fn(model(x), y)``, the loss as the plan runs it
(:func:`~shardwise.parallel.parallelize.training_loss`: with ``chunked_loss`` the model returns its
LM head's input while training and this loss applies the head chunk by chunk, so ``chunked_loss``
needs it; with ``params16`` it computes under autocast). With ``sharded_accumulation`` leave
the gradient sync on in every micro-batch (FSDP2 then reduce-scatters each one); without it,
``with prepared.parallel.gradient_sync(last):`` holds the unsharded gradients until the last.

Or let shardwise run the step's forward and backward, exactly as its Trainer does (weighing,
context-parallel sharding, gradient sync on the last micro-batch, pipelines)::

    loss = prepared.forward_backward(micro_batches, loss_fn)   # [(x, y), ...] on the device
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from shardwise.runtime import env as runtime
from shardwise.data.loader import DistributedLoader, LoaderOptions, train_loader
from shardwise.errors import ConfigError
from shardwise.parallel.ddp import DDPOptions
from shardwise.layout import Plan
from shardwise.parallel.mesh import Meshes
from shardwise.parallel.micro_step import MicroBatch
from shardwise.parallel.parallelize import ParallelModel
from shardwise.parallel.reduction import IGNORE_INDEX, LossReduction, check_loss_reduction
from shardwise.runtime.detect import RuntimeEnv
from shardwise.auto.sample import AutoData
from shardwise.train.build import build


class Prepared(tuple):
    """Unpacks as ``model, optimizer, loader``; ``.parallel`` (the ParallelModel), ``.meshes`` and
    ``.env`` are there for inspection."""

    def __new__(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: DistributedLoader,
        *,
        parallel: ParallelModel,
        meshes: Meshes,
        env: RuntimeEnv,
        reduction: LossReduction = LossReduction(),
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> Prepared:
        self = super().__new__(cls, (model, optimizer, loader))
        self.parallel, self.meshes, self.env, self.reduction = parallel, meshes, env, reduction
        self.loss_fn = parallel.loss_for(loss_fn) if loss_fn is not None else None  # the loss as the plan runs it
        return self

    def loss_weights(self, targets: Sequence[Any]) -> list[Any]:
        """What each micro-batch's mean loss is multiplied by before backward, for the targets of
        every micro-batch of one optimizer step (as the model sees them: under context parallelism
        each rank's chunks, ``prepared.parallel.local_targets(y)``). ``loss_reduction="samples"``:
        ``1 / k``; ``"tokens"``: ``D n_i / N`` (:mod:`shardwise.parallel.reduction`), one all-reduce of
        one integer over the ranks that hold different tokens. The data-parallel reduction's average
        then gives one process's update on the whole global batch."""
        return list(self.reduction.weigh(list(targets), device=self.env.device).weights)

    def forward_backward(self, micro_batches: Sequence[tuple[Any, Any]],
                         loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward of one optimizer step's ``(inputs, targets)`` micro-batches (on the
        device), weighed by ``loss_reduction`` and with the gradient sync on the last only: the
        Trainer's own micro-step (:meth:`ParallelModel.forward_backward
        <shardwise.parallel.parallelize.ParallelModel.forward_backward>`). ``loss_fn``: the loop's
        loss (default: the ``loss_fn`` given to ``prepare``). Returns the step's loss share (a
        device tensor; averaged over the data-parallel ranks it is the global batch's mean)."""
        if loss_fn is None and self.loss_fn is None:
            raise ConfigError("forward_backward needs a loss function", hint="pass loss_fn= here or to prepare()")
        loss = self.parallel.loss_for(loss_fn) if loss_fn is not None else self.loss_fn
        return self.parallel.forward_backward(
            [MicroBatch(x, y) for x, y in micro_batches], loss_fn=loss, reduction=self.reduction, device=self.env.device
        ).loss

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
    loss_reduction: str = "samples",
    ignore_index: int = IGNORE_INDEX,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> Prepared:
    """Initialize the process group if needed, wrap ``model`` for ``plan``, build the optimizer on
    the wrapped parameters, and shard ``data`` over the data-parallel ranks.

    A ``DataLoader`` keeps its batch size (per process), collate function, workers and pinning; its
    sampler is replaced by a distributed one (an epoch ends at the last full global batch).
    ``loss_reduction`` and ``ignore_index`` set what :meth:`Prepared.loss_weights` gives;
    ``loss_fn``: the loop's loss, which ``prepared.loss_fn`` gives as the plan runs it (module doc).
    """
    check_loss_reduction(loss_reduction)
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
    def check(resolved: Plan, device_type: str) -> None:  # before any mesh or wrapping
        if resolved.chunked_loss and loss_fn is None:
            raise ConfigError(
                "plan chunked_loss with prepare() needs loss_fn=: the model returns its LM head's input while training",
                hint="prepare(..., loss_fn=your_loss) and call prepared.loss_fn(model(x), y), which applies the head",
            )

    built = build(
        model,
        optimizer_factory,
        plan=plan,
        global_batch_size=batch_size * runtime.init().world_size,
        seed=seed,
        ddp=ddp,
        data=AutoData(dataset, options.collate_fn),
        check=check,
    )
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
    return Prepared(pm.module, optimizer, DistributedLoader(loader), parallel=pm, meshes=meshes, env=env,
                    reduction=LossReduction.over(meshes.tokens, loss_reduction, ignore_index), loss_fn=loss_fn)
