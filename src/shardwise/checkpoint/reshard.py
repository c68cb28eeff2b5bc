"""Resharding on load: tensors via DCP, the data position by arithmetic.

**Tensors.** DCP stores each tensor with its global shape and the chunk (offsets, sizes) each rank
wrote. Loading asks for the chunks *this* rank's new layout needs (DTensor placements from
``get_state_dict`` under the new plan) and reads exactly the overlapping byte ranges, so a
checkpoint from DP4 loads under TP2 or one process with no conversion step. Nothing to do here
but to build the target state dict under the new plan, which the manager does.

**Data position.** An epoch is one permutation ``perm`` of the dataset (seeded by ``seed + epoch``,
identical on every rank). Rank ``r`` of ``D`` data-parallel ranks takes ``perm[consumed + r ::
D]``: a strided slice of what is left. After ``k`` steps of per-rank batch ``b`` the ranks together
consumed exactly the prefix ``perm[:k * b * D]``, whatever ``D`` was, so the position is one number,
``consumed`` (global samples of this epoch). Resuming under ``D'`` ranks continues from the same
prefix: no sample of the interrupted epoch is repeated or skipped. The global batch ``b * D`` must
stay the same for an exact continuation; when it changes, only the ownership of future samples
changes, never the set of samples already seen.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from shardwise.errors import ConfigError


def epoch_permutation(n: int, *, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The sample order of ``epoch``; identical on every rank and every world size."""
    if not shuffle:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=gen)


def remaining_indices(perm: torch.Tensor, *, consumed: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    """What rank ``dp_rank`` of ``dp_size`` still has to read in this epoch (see the module doc)."""
    if not 0 <= dp_rank < dp_size:
        raise ConfigError(f"data-parallel rank {dp_rank} is outside 0..{dp_size - 1}")
    if not 0 <= consumed <= len(perm):
        raise ConfigError(f"data position {consumed} is outside this epoch of {len(perm)} samples",
                          hint="the dataset changed size since the checkpoint; resume with the same dataset")
    return perm[consumed + dp_rank :: dp_size]


class ShardedSampler:
    """A resumable distributed sampler (``Stateful``): the data-position convention of this package.

    Iterating yields this rank's indices of the current epoch from the saved position on.
    ``advance(global_samples)`` records consumption (the trainer calls it once per optimizer step
    with the global batch size); the state is ``{"epoch", "consumed", "seed"}``, independent of the
    data-parallel size, which is what makes resharding the data position exact.
    """

    def __init__(self, num_samples: int, *, dp_rank: int, dp_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True) -> None:
        self.num_samples = num_samples
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self.consumed = 0

    def __iter__(self) -> Iterator[int]:
        perm = epoch_permutation(self.num_samples, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        idx = remaining_indices(perm, consumed=self.consumed, dp_rank=self.dp_rank, dp_size=self.dp_size)
        if self.drop_last:  # every rank yields the same count, so no rank waits in a collective
            idx = idx[: (self.num_samples - self.consumed) // self.dp_size]
        return iter(idx.tolist())

    def __len__(self) -> int:
        return (self.num_samples - self.consumed) // self.dp_size

    def advance(self, global_samples: int) -> None:
        self.consumed += global_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            raise ConfigError(f"the checkpoint's data order uses seed {state['seed']}, this run uses {self.seed}",
                              hint="resume with the same seed to continue the same sample order")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def convert_position(state: dict[str, Any], *, old_dp: int, new_dp: int) -> dict[str, Any]:
    """Convert a saved data position to a new data-parallel size.

    Positions in this package's convention (``consumed`` = global samples) are independent of the
    data-parallel size and returned unchanged. A per-rank count (``{"per_rank": k}`` as kept by
    samplers that count their own draws) becomes the global count ``k * old_dp``.
    """
    out = dict(state)
    if "per_rank" in out:
        out["consumed"] = int(out.pop("per_rank")) * old_dp
    return out
