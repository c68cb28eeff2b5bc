"""``shardwise.prepare`` for a hand-written loop: plain backward/step train exactly like the Trainer."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.utils.data import DataLoader

from tests.helpers import make_data, make_model, run_fit, sgd


def own_loop(pass_loader: bool) -> dict:
    import shardwise

    per_process = 32 // dist.get_world_size()
    data = DataLoader(make_data(), batch_size=per_process) if pass_loader else make_data()
    model, optimizer, loader = shardwise.prepare(
        make_model(), sgd, data, batch_size=None if pass_loader else per_process, seed=7
    )
    epochs = []
    for _ in range(2):  # 10 steps per epoch; the loader reshuffles by itself
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        epochs.append(loader.sampler.epoch)
    return {
        "weights": {k: v.detach().clone() for k, v in get_model_state_dict(model).items()},
        "epochs": epochs,
        "type": type(model).__name__,
    }


def test_prepare_trains_like_the_trainer(pools) -> None:
    ref = pools(1).run(run_fit)[0]["weights"]
    for n, pass_loader in ((2, False), (4, True)):
        for got in pools(n).run(own_loop, pass_loader):
            assert got["type"] == "DistributedDataParallel" and got["epochs"] == [0, 1]
            for key, value in ref.items():
                torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=1e-6)


def micro_step_loop() -> dict:
    """A loop that lets prepare() run each step's forward and backward (two micro-batches of 8 per
    rank): the Trainer's own micro-step, so it trains like Trainer(train=TrainOptions(grad_accum_steps=2))."""
    import shardwise

    prepared = shardwise.prepare(make_model(), sgd, make_data(), batch_size=8, seed=7, loss_fn=F.cross_entropy)
    model, optimizer, loader = prepared
    batches = iter(loader)
    for _ in range(10):  # one epoch: 10 steps of 2 micro-batches on each of 2 ranks
        prepared.forward_backward([next(batches), next(batches)])
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in get_model_state_dict(model).items()}


def test_prepare_forward_backward_is_the_trainers_micro_step(pools) -> None:
    ref = pools(1).run(run_fit, steps=10, accum=2)[0]["weights"]
    for got in pools(2).run(micro_step_loop):
        for key, value in ref.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
