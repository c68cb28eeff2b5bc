"""Distributed sampling: which sample indices each data-parallel rank reads, and in what order.

Training (:class:`ShardedSampler`) follows ``torch.utils.data.DistributedSampler``: one permutation
of ``range(len(dataset))`` per epoch, drawn from ``seed + epoch`` (identical on every rank, no
communication), and rank ``r`` of ``n`` reads the strided slice ``perm[r::n]``. Striding has a
property the trainer relies on: the first ``k`` samples of every rank together are exactly
``perm[:k * n]``. Hence

- one optimizer step over all ranks consumes a contiguous block of the permutation, the same block
  a single process with the full global batch would read (the basis of the parity tests);
- the position inside an epoch is one number, the count of *global* samples consumed, and it can
  be restored even with a different number of ranks (as long as it divides the new rank count).

With ``drop_last`` (training) the epoch is cut to a multiple of ``drop_unit`` (the global batch
size), so every step sees exactly one full global batch; otherwise the permutation is padded by
wrapping around to a multiple of ``n`` (DistributedSampler's behaviour).

Evaluation (:class:`EvalSampler`) never pads: rank ``r`` reads ``range(r, N, n)``, so shards
differ by at most one sample and every sample is counted exactly once.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from shardwise.errors import ConfigError, ShardwiseError


class ShardedSampler(Sampler[int]):
    """This rank's indices for one epoch, resumable mid-epoch (see the module doc).

    ``consumed`` is the number of *global* samples of the current epoch already trained on; the
    trainer advances it after each optimizer step (:meth:`advance`), so samples prefetched by the
    DataLoader but not yet used are not counted. :meth:`state_dict` / :meth:`load_state_dict` save
    and restore ``(epoch, consumed)``.
    """

    def __init__(
        self,
        length: int,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        drop_unit: int | None = None,
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ConfigError(
                f"sampler rank {rank} is not in a world of {num_replicas}", hint="use 0 <= rank < num_replicas"
            )
        unit = drop_unit or num_replicas
        if unit % num_replicas:
            raise ConfigError(
                f"global batch {unit} does not divide over {num_replicas} data-parallel ranks",
                hint=f"use a global batch size that is a multiple of {num_replicas}",
            )
        self.length = length
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.unit = unit
        self.epoch = 0
        self.consumed = 0
        if drop_last and length < unit:
            raise ShardwiseError(
                f"the dataset has {length} samples, fewer than one global batch of {unit}",
                hint="use a smaller global batch size or a larger dataset",
            )

    # -- sizes ----------------------------------------------------------------------------
    @property
    def total_size(self) -> int:
        """Global samples per epoch (after dropping the tail or padding)."""
        if self.drop_last:
            return self.length // self.unit * self.unit
        return -(-self.length // self.num_replicas) * self.num_replicas

    def __len__(self) -> int:
        """Indices this rank yields in the rest of the current epoch."""
        return (self.total_size - self.consumed) // self.num_replicas

    # -- iteration ------------------------------------------------------------------------
    def permutation(self, epoch: int) -> list[int]:
        """The global order of epoch ``epoch``: identical on every rank."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        total = self.total_size
        if total > len(order):  # pad by wrapping around (evaluation should use EvalSampler instead)
            order += (order * (total // len(order) + 1))[: total - len(order)]
        return order[:total]

    def __iter__(self) -> Iterator[int]:
        order = self.permutation(self.epoch)
        return iter(order[self.consumed + self.rank :: self.num_replicas])

    # -- position -------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (a new permutation)."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def advance(self, global_samples: int) -> None:
        """Mark ``global_samples`` more samples of this epoch as trained on."""
        self.consumed += global_samples

    @property
    def epoch_finished(self) -> bool:
        return self.total_size - self.consumed < self.unit if self.drop_last else self.consumed >= self.total_size

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("length", self.length)) != self.length:
            raise ShardwiseError(
                f"the saved data position is for a dataset of {state['length']} samples, this one has {self.length}",
                hint="resume with the same dataset, or start a new run",
            )
        consumed = int(state["consumed"])
        if consumed % self.num_replicas:
            raise ShardwiseError(
                f"the saved data position ({consumed} samples into the epoch) does not split over {self.num_replicas} "
                "ranks",
                hint="resume with a data-parallel size that divides the saved position",
            )
        self.epoch, self.consumed = int(state["epoch"]), consumed
        self.seed = int(state.get("seed", self.seed))


class EvalSampler(Sampler[int]):
    """Rank ``r`` of ``n`` reads ``range(r, length, n)``: no padding, no duplicates, no shuffling."""

    def __init__(self, length: int, *, num_replicas: int, rank: int) -> None:
        self.length, self.num_replicas, self.rank = length, num_replicas, rank

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.num_replicas))
