"""Distributed sampling: strided shards, whole global batches, mid-epoch resume, exact eval shards."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from shardwise.data.loader import DistributedLoader, eval_loader, train_loader
from shardwise.data.sampler import EvalSampler, ShardedSampler
from shardwise.errors import ShardwiseError


def _ranks(length: int, n: int, **kw) -> list[ShardedSampler]:
    return [ShardedSampler(length, num_replicas=n, rank=r, **kw) for r in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_first_k_of_every_rank_are_a_prefix_of_the_permutation(n: int) -> None:
    samplers = _ranks(50, n, seed=3, drop_unit=12)
    streams = [list(s) for s in samplers]
    perm = samplers[0].permutation(0)
    for k in range(1, len(streams[0]) + 1):
        assert sorted(i for st in streams for i in st[:k]) == sorted(perm[: k * n])


def test_epoch_is_cut_to_whole_global_batches_and_reshuffled() -> None:
    s = ShardedSampler(50, num_replicas=2, rank=0, seed=1, drop_unit=16)
    assert s.total_size == 48 and len(s) == 24
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first
    assert sorted(s.permutation(1)) == sorted(set(s.permutation(1)))  # no duplicates
    assert ShardedSampler(50, num_replicas=2, rank=0, seed=1, drop_unit=16).permutation(1) == s.permutation(1)


def test_padding_without_drop_last_wraps_around() -> None:
    s = ShardedSampler(5, num_replicas=4, rank=3, shuffle=False, drop_last=False)
    assert s.total_size == 8 and list(s) == [3, 2]


@pytest.mark.parametrize("new_n", [2, 4, 1])
def test_resume_mid_epoch_continues_the_same_order(new_n: int) -> None:
    """Saved after 3 global batches of 8 on 2 ranks; resumed on ``new_n`` ranks."""
    old = _ranks(40, 2, seed=5, drop_unit=8)
    for s in old:
        s.set_epoch(2)
    full = [list(s) for s in old]
    for s in old:
        s.advance(24)
    state = old[0].state_dict()
    assert state["epoch"] == 2 and state["consumed"] == 24
    new = _ranks(40, new_n, seed=0, drop_unit=8)
    for s in new:
        s.load_state_dict(state)
        s.set_epoch(2)  # same epoch: keeps the position
    rest = sorted(i for s in new for i in s)
    expected = sorted(i for st in full for i in st[12:])
    assert rest == expected
    assert sorted(old[0].permutation(2)[24:]) == expected
    if new_n == 2:
        assert [list(s) for s in new] == [st[12:] for st in full]


def test_resume_refuses_a_position_or_dataset_that_does_not_fit() -> None:
    s = ShardedSampler(40, num_replicas=4, rank=0, drop_unit=8)
    with pytest.raises(ShardwiseError, match="does not split over 4 ranks"):
        s.load_state_dict({"epoch": 0, "consumed": 6, "seed": 0, "length": 40})
    with pytest.raises(ShardwiseError, match="dataset of 41 samples"):
        s.load_state_dict({"epoch": 0, "consumed": 8, "seed": 0, "length": 41})


def test_dataset_smaller_than_a_global_batch_is_an_error() -> None:
    with pytest.raises(ShardwiseError, match="fewer than one global batch"):
        ShardedSampler(10, num_replicas=2, rank=0, drop_unit=16)


@pytest.mark.parametrize("length,n", [(10, 4), (3, 4), (8, 2), (7, 3)])
def test_eval_shards_cover_every_sample_exactly_once(length: int, n: int) -> None:
    shards = [list(EvalSampler(length, num_replicas=n, rank=r)) for r in range(n)]
    assert sorted(i for sh in shards for i in sh) == list(range(length))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_loaders_batch_shapes_and_epoch_advance() -> None:
    ds = TensorDataset(torch.arange(20).float().unsqueeze(1), torch.arange(20))
    loader = train_loader(ds, micro_batch_size=2, global_batch_size=8, dp_rank=1, dp_size=2, seed=0)
    assert len(loader) == 4  # 16 of 20 samples per epoch, 8 per rank, micro-batches of 2
    dl = DistributedLoader(loader)
    first = [y.tolist() for _, y in dl]
    assert dl.sampler.consumed == 16 and dl.sampler.epoch == 0
    second = [y.tolist() for _, y in dl]
    assert dl.sampler.epoch == 1 and first != second
    ev = eval_loader(ds, batch_size=3, dp_rank=3, dp_size=4)
    assert [y.tolist() for _, y in ev] == [[3, 7, 11], [15, 19]]
