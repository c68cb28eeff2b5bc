"""Tensor and sequence parallel against one process (fp32, 4 steps, same seed and global batch).

Tolerance rtol 1e-5 (loss, grad norm, weights): TP changes only the order of the sums (a sharded
matmul's partial sums are all-reduced), so the observed differences are ~1e-7.

``LargeModel`` is the reference guide's MindSpore example (embedding + three dense layers with
``shard()`` strategies), scaled down and written with ``shardwise.shard``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
import shardwise.parallel.annotate as annotate
from shardwise.verify.parity import GPTWorkload, Run, Training, parity_worker

RTOL = 1e-5
TRAINING = Training(
    steps=4, global_batch=8
)  # same rtol as at 20 steps; steps 2-4 use the momentum buffers (sharded, where the layout shards them)


class LargeModel(nn.Module):
    """The guide's LargeModel; ``tp`` replaces its 8-way splits. ``fc1_colwise`` annotates fc1 as
    ``"colwise"`` instead of data parallel, leaving fc2's role to partner inference."""

    def __init__(
        self, *, tp: int, vocab: int = 64, embedding_dim: int = 32, hidden: int = 64, fc1_colwise: bool = False
    ):
        super().__init__()
        self.embedding = shardwise.shard(
            nn.Embedding(vocab, embedding_dim), ((1, tp), (1, 1))
        )  # split the embedding dim
        self.fc1 = nn.Linear(embedding_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = shardwise.shard(nn.Linear(hidden, vocab), ((tp, 1), (1, 1)))  # batch split: replicated weight
        if fc1_colwise:
            shardwise.shard(self.fc1, "colwise")  # fc2 is inferred rowwise
        else:
            shardwise.shard(self.fc1, ((tp, 1), (1, 1)))  # batch split: replicated weight
            shardwise.shard(self.fc2, ((1, tp), (tp, 1)))  # contraction dim split: rowwise
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(self.embedding(x)))
        return self.fc3(self.relu(self.fc2(x)))


@dataclass(frozen=True)
class LargeModelWorkload:
    tp: int
    fc1_colwise: bool = False

    def build(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return LargeModel(tp=self.tp, fc1_colwise=self.fc1_colwise)

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        return torch.randint(0, 64, (size, 8), generator=gen), torch.randint(0, 64, (size, 8), generator=gen)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten())


def _check(per_rank):
    for reports in per_rank:
        for report in reports:
            assert report.passed(RTOL), report.format(RTOL)


def test_gpt_tp_sp_and_loss_parallel_on_2(dist2):
    runs = [Run("tp=2"), Run("tp=2,sp"), Run("tp=2", loss_parallel=True), Run("tp=2", meta_init=True)]
    per_rank = dist2.run(parity_worker, GPTWorkload(), runs, TRAINING)
    _check(per_rank)
    for report in per_rank[0]:
        mem = report.memory
        assert mem["param"] < 0.6 * mem["ref_param"]  # everything but norms/biases of rowwise layers is split
        # gradients and (SGD momentum) state are laid out like the weights, including the
        # vocabulary-sharded embedding, whose gradient torch produces whole
        assert mem["grad"] == mem["param"] and mem["optim"] == mem["param"], (report.plan, mem)


def test_large_model_annotations_on_2(dist2):
    for workload in (LargeModelWorkload(tp=2), LargeModelWorkload(tp=2, fc1_colwise=True)):
        per_rank = dist2.run(parity_worker, workload, [Run("tp=2")], TRAINING)
        _check(per_rank)
        mem = per_rank[0][0].memory
        assert mem["param"] < 0.9 * mem["ref_param"], mem  # the annotated layers really are split


def test_gpt_and_large_model_tp_on_4(dist4):
    _check(dist4.run(parity_worker, GPTWorkload(), [Run("tp=4")], TRAINING))
    _check(dist4.run(parity_worker, LargeModelWorkload(tp=4), [Run("tp=4")], TRAINING))


def _plan_of(tp: int, fc1_colwise: bool) -> dict[str, str]:
    return annotate.annotated_styles(LargeModel(tp=tp, fc1_colwise=fc1_colwise), tp=tp).as_dict()


def test_large_model_strategy_translation():
    assert _plan_of(2, False) == {"embedding": "embedding_colwise", "fc2": "rowwise_rep"}
    assert _plan_of(2, True) == {"embedding": "embedding_colwise", "fc1": "colwise", "fc2": "rowwise"}
