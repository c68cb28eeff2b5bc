"""Resuming from ``trainer.stateful_components()`` mid-epoch continues exactly where training stopped.

The state dicts are kept in memory here (a checkpoint manager writes the same objects to disk):
an uninterrupted run of 14 steps and a run stopped after 13 steps (mid second epoch) and resumed
in a fresh Trainer with a differently initialized model must agree step for step.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from shardwise.train import Callback, LoggingOptions, TrainOptions, Trainer, warmup_cosine
from tests.helpers import Record, make_data, make_model, sgd

STOP_AT, TOTAL = 13, 14


class Restore(Callback):
    def __init__(self, saved: dict) -> None:
        self.saved = saved

    def on_fit_start(self, trainer) -> None:
        for name, part in trainer.stateful_components().items():
            part.load_state_dict(self.saved[name])


def _trainer(model: nn.Module, max_steps: int, callbacks: list) -> Trainer:
    return Trainer(model, loss_fn=F.cross_entropy, optimizer=sgd, global_batch_size=32,
                   train=TrainOptions(lr_scheduler=warmup_cosine(warmup_steps=3, total_steps=TOTAL),
                                      max_steps=max_steps, seed=7),
                   logging=LoggingOptions(log_every=1, progress_bar=False), callbacks=callbacks)


def _weights(trainer: Trainer) -> dict:
    return {k: v.detach().clone() for k, v in get_model_state_dict(trainer.model.module).items()}


def interrupted_and_straight() -> dict:
    straight = Record()
    t = _trainer(make_model(), TOTAL, [straight])
    t.fit(make_data())
    full_weights = _weights(t)

    first = _trainer(make_model(), STOP_AT, [])
    first.fit(make_data())
    saved = {name: copy.deepcopy(part.state_dict()) for name, part in first.stateful_components().items()}

    torch.manual_seed(999)
    resumed_rec = Record()
    resumed = _trainer(
        nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3)), TOTAL, [Restore(saved), resumed_rec]
    )
    result = resumed.fit(make_data())
    return {
        "saved_position": saved["train_state"]["sampler"],
        "straight": straight.losses[STOP_AT:],
        "resumed": resumed_rec.losses,
        "straight_weights": full_weights,
        "resumed_weights": _weights(resumed),
        "step": result.step,
    }


def test_resume_mid_epoch_matches_an_uninterrupted_run(pools) -> None:
    for res in pools(2).run(interrupted_and_straight):
        assert res["saved_position"]["epoch"] == 1 and res["saved_position"]["consumed"] == 3 * 32
        assert res["step"] == TOTAL and len(res["resumed"]) == TOTAL - STOP_AT
        torch.testing.assert_close(torch.tensor(res["resumed"]), torch.tensor(res["straight"]), rtol=1e-6, atol=0)
        for key, value in res["straight_weights"].items():
            torch.testing.assert_close(res["resumed_weights"][key], value, rtol=1e-6, atol=0)
