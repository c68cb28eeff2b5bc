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
    model, optimizer, loader = shardwise.prepare(make_model(), sgd, data, batch_size=None if pass_loader else per_process, seed=7)
    epochs = []
    for _ in range(2):  # 10 steps per epoch; the loader reshuffles by itself
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        epochs.append(loader.sampler.epoch)
    return {"weights": {k: v.detach().clone() for k, v in get_model_state_dict(model).items()}, "epochs": epochs, "type": type(model).__name__}


def test_prepare_trains_like_the_trainer(pools) -> None:
    ref = pools(1).run(run_fit)[0]["weights"]
    for n, pass_loader in ((2, False), (4, True)):
        for got in pools(n).run(own_loop, pass_loader):
            assert got["type"] == "DistributedDataParallel" and got["epochs"] == [0, 1]
            for key, value in ref.items():
                torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=1e-6)
