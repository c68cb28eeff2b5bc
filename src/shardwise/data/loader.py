"""DataLoaders over the data-parallel mesh: training (sharded, resumable) and exact evaluation.

Ranks are data-parallel ranks (``meshes.dp``), never world ranks: the tensor- and
pipeline-parallel ranks of one replica must read the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from shardwise.data.sampler import EvalSampler, ShardedSampler


@dataclass(frozen=True)
class LoaderOptions:
    """``torch.utils.data.DataLoader`` options the trainer passes through."""

    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    collate_fn: Callable[[list[Any]], Any] | None = None
    worker_start_method: str | None = None  # "fork" (fast), "spawn", "forkserver"; None: Python's default

    def kwargs(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.num_workers > 0:
            # Persistent workers keep their processes (and dataset copies) across epochs.
            extra["persistent_workers"] = self.persistent_workers
            extra["prefetch_factor"] = 2
            if self.worker_start_method is not None:
                extra["multiprocessing_context"] = self.worker_start_method
        if self.collate_fn is not None:
            extra["collate_fn"] = self.collate_fn
        return {"num_workers": self.num_workers, "pin_memory": self.pin_memory, **extra}


def train_loader(
    dataset: Dataset,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int = 0,
    shuffle: bool = True,
    options: LoaderOptions = LoaderOptions(),
) -> DataLoader:
    """Micro-batches of ``micro_batch_size`` for this data-parallel rank.

    Each epoch holds ``len(dataset) // global_batch_size`` full global batches; the tail is dropped
    so every optimizer step averages over exactly ``global_batch_size`` samples. The sampler
    (``loader.sampler``, a :class:`ShardedSampler`) carries the resumable position.
    """
    sampler = ShardedSampler(
        len(dataset),  # type: ignore[arg-type]
        num_replicas=dp_size,
        rank=dp_rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=True,
        drop_unit=global_batch_size,
    )
    generator = torch.Generator()
    generator.manual_seed(seed + dp_rank)  # worker seeds: reproducible, different per rank
    return DataLoader(
        dataset, batch_size=micro_batch_size, sampler=sampler, drop_last=True, generator=generator, **options.kwargs()
    )


def eval_loader(
    dataset: Dataset, *, batch_size: int, dp_rank: int, dp_size: int, options: LoaderOptions = LoaderOptions()
) -> DataLoader:
    """This rank's share of ``dataset``, unpadded: every sample appears on exactly one rank.

    Shards differ by at most one sample, so ranks may run a different number of batches; the
    evaluation loop equalizes the count (see :func:`shardwise.train.evaluate.evaluate`).
    """
    sampler = EvalSampler(len(dataset), num_replicas=dp_size, rank=dp_rank)  # type: ignore[arg-type]
    opts = {**options.kwargs(), "persistent_workers": False} if options.num_workers else options.kwargs()
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False, **opts)


class DistributedLoader:
    """A training loader that moves to the next epoch by itself (for :func:`shardwise.prepare`).

    Iterating it once is one epoch; each new iteration calls ``sampler.set_epoch`` with the next
    epoch number, so shuffling changes every epoch without the user calling ``set_epoch``.
    """

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.sampler: ShardedSampler = loader.sampler  # type: ignore[assignment]
        self._started = False

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self._started:
            self.sampler.set_epoch(self.sampler.epoch + 1)
        self._started = True
        for batch in self.loader:
            yield batch
            self.sampler.advance(self.loader.batch_size * self.sampler.num_replicas)  # type: ignore[operator]

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size


def stop_workers(loader: Any) -> None:
    """Stops the worker processes of ``loader``'s live iterator now (a ``DataLoader`` with
    ``persistent_workers``, or torchdata's ``StatefulDataLoader``, which keeps its iterator).

    torch stops them when the iterator is garbage-collected. When the loader sits in a reference
    cycle (a trainer, its callbacks), that happens in the cyclic collector, which closes the
    iterator's queues before the iterator's own ``__del__`` runs: the stop signal never reaches the
    workers, and each one is waited for 5 s (``MP_STATUS_CHECK_INTERVAL``) and then killed. A
    ``DataLoader`` without persistent workers keeps no iterator: nothing to do."""
    iterator = getattr(loader, "_iterator", None)
    shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's and torchdata's multi-process iterator
    if shutdown is not None:
        shutdown()
