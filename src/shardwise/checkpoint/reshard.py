"""Resharding on load: tensors via DCP, the data position by arithmetic.

**Tensors.** DCP stores each tensor with its global shape and the chunk (offsets, sizes) each rank
wrote. Loading asks for the chunks *this* rank's new layout needs (DTensor placements from
``get_state_dict`` under the new plan) and reads exactly the overlapping byte ranges, so a
checkpoint from DP4 loads under TP2 or one process with no conversion step. Nothing to do here
but to build the target state dict under the new plan, which the manager does.

**Data position.** (Implemented by ``shardwise.data.sampler.ShardedSampler``, which the
Trainer uses.) An epoch is one permutation ``perm`` of the dataset (seeded by ``seed + epoch``,
identical on every rank). Rank ``r`` of ``D`` data-parallel ranks takes ``perm[consumed + r ::
D]``: a strided slice of what is left. After ``k`` steps of per-rank batch ``b`` the ranks together
consumed exactly the prefix ``perm[:k * b * D]``, whatever ``D`` was, so the position is one number,
``consumed`` (global samples of this epoch). Resuming under ``D'`` ranks continues from the same
prefix: no sample of the interrupted epoch is repeated or skipped. The global batch ``b * D`` must
stay the same for an exact continuation; when it changes, only the ownership of future samples
changes, never the set of samples already seen.
"""

from __future__ import annotations


def source_rank(rank: int, saved_world: int) -> int:
    """Which saved rank's small state (counters, scheduler, data position, RNG) rank ``rank`` reads.

    Same world: its own. Another world: ``rank % saved_world``; counters, scheduler and the global
    data position are identical on every saved rank, and RNG streams stay distinct per rank where
    they can (a restarted run on a new world size is not bitwise comparable anyway).
    """
    return rank % saved_world
