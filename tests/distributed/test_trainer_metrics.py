"""Exact evaluation: uneven shards, every sample counted once, global sums over global counts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.train import LoggingOptions, TrainOptions, Trainer
from tests.helpers import make_data, make_model


def top2(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    hit = (outputs.topk(2, dim=-1).indices == targets.unsqueeze(-1)).any(-1)
    return hit.sum(), targets.numel()


def evaluate_on(n_samples: int, eval_batch_size: int) -> dict:
    trainer = Trainer(make_model(), loss_fn=F.cross_entropy, global_batch_size=4,
                      train=TrainOptions(eval_batch_size=eval_batch_size),
                      logging=LoggingOptions(metrics={"accuracy": "accuracy", "top2": top2}, progress_bar=False))
    return trainer.evaluate(make_data(n_samples))


def reference(n_samples: int) -> dict:
    data = make_data(n_samples)
    x, y = data.tensors
    with torch.no_grad():
        out = make_model()(x)
    return {
        "loss": F.cross_entropy(out, y).item(),
        "accuracy": (out.argmax(1) == y).sum().item() / len(y),
        "top2": top2(out, y)[0].item() / len(y),
        "out": out,
        "y": y,
    }


def test_ten_samples_on_four_ranks_give_the_single_process_metrics(pools) -> None:
    ref = reference(10)
    # The naive average of per-rank averages (shards of 3, 3, 2, 2 samples) is measurably different.
    per_rank = [F.cross_entropy(ref["out"][r::4], ref["y"][r::4]).item() for r in range(4)]
    assert abs(sum(per_rank) / 4 - ref["loss"]) > 1e-3
    for batch in (2, 8):  # batches of 2 (a ragged last batch on two ranks) or one batch per rank
        results = pools(4).run(evaluate_on, 10, batch)
        for got in results:
            assert got == results[0]  # every rank reports the same numbers
            assert got["accuracy"] == ref["accuracy"] and got["top2"] == ref["top2"]
            assert abs(got["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"])
    assert 0.0 < ref["accuracy"] < 1.0


def test_more_ranks_than_samples(pools) -> None:
    ref = reference(3)
    for got in pools(4).run(evaluate_on, 3, 2):  # rank 3 has no sample at all
        assert got["accuracy"] == ref["accuracy"]
        assert abs(got["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"])
