"""Helpers shared by the Trainer tests: a small classification problem, its model, SGD, a callback
that records every step, and one ``Trainer.fit`` on them (run in the worker pools' processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.utils.data import TensorDataset

from shardwise.train import Callback, LoggingOptions, TrainOptions, Trainer

SEED = 7
N_SAMPLES = 320  # 10 steps per epoch at a global batch of 32: 20 steps cross an epoch boundary


def make_data(n: int = N_SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(1)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(123)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float | None] = []

    def on_step_end(self, trainer, metrics) -> None:
        self.losses.append(metrics["loss"])
        self.norms.append(metrics.get("grad_norm"))


def run_fit(steps: int = 20, gbs: int = 32, accum: int = 1, clip: float | None = None, **options) -> dict:
    rec = Record()
    trainer = Trainer(make_model(), loss_fn=F.cross_entropy, optimizer=sgd, global_batch_size=gbs,
                      train=TrainOptions(grad_accum_steps=accum, clip_grad_norm=clip, max_steps=steps, seed=SEED),
                      logging=LoggingOptions(log_every=1, progress_bar=False), callbacks=[rec], **options)
    result = trainer.fit(make_data())
    weights = {k: v.detach().clone() for k, v in get_model_state_dict(trainer.model.module).items()}
    return {"losses": rec.losses, "norms": rec.norms, "weights": weights, "step": result.step, "epoch": result.epoch}
