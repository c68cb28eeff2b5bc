"""Callbacks and loggers through a real fit: CSV/TensorBoard/PNG outputs, monitors, early stopping."""

from __future__ import annotations

import os

import torch.nn.functional as F
from torch.utils.data import Subset

from shardwise.train import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    LoggingOptions,
    LossMonitor,
    PlotCurves,
    ProgressBar,
    ThroughputMonitor,
    Trainer,
    TrainOptions,
    warmup_cosine,
)
from shardwise.train.plot import read_csv
from tests.helpers import make_data, make_model, sgd


class Hooks(Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_fit_start(self, trainer) -> None:
        self.calls.append(f"fit_start@{trainer.step}")

    def on_epoch_end(self, trainer) -> None:
        self.calls.append(f"epoch_end@{trainer.step}")

    def on_eval_end(self, trainer, metrics) -> None:
        self.calls.append(f"eval_end@{trainer.step}")

    def on_fit_end(self, trainer) -> None:
        self.calls.append(f"fit_end@{trainer.step}")


def fit_with_callbacks(run_dir: str, early: bool) -> dict:
    hooks = Hooks()
    callbacks = [hooks, LossMonitor(), ThroughputMonitor(), LearningRateMonitor(), PlotCurves(), ProgressBar()]
    if early:  # an improvement of more than 1e9 never happens: no improvement after the first evaluation
        callbacks.append(EarlyStopping("val_loss", mode="min", patience=2, min_delta=1e9))
    trainer = Trainer(make_model(), loss_fn=F.cross_entropy, optimizer=sgd, global_batch_size=32,
                      train=TrainOptions(lr_scheduler=warmup_cosine(warmup_steps=2, total_steps=20), max_epochs=2,
                                         eval_every=4 if early else None),
                      logging=LoggingOptions(log_every=5, metrics=["accuracy"], tokens_per_sample=8,
                                             flops_per_sample=1e6, peak_flops_per_device=1e12, run_dir=run_dir),
                      callbacks=callbacks)
    result = trainer.fit(make_data(), Subset(make_data(), range(50)))
    return {
        "calls": hooks.calls,
        "step": result.step,
        "epoch": result.epoch,
        "val": result.val_metrics,
        "train_loss": result.train_loss,
        "history": result.history,
    }


def test_outputs_and_hook_order(pools, tmp_path) -> None:
    res = pools(1).run(fit_with_callbacks, str(tmp_path), False)[0]
    # Epochs of 10 steps; without eval_every, evaluation runs at every epoch end.
    assert res["calls"] == ["fit_start@0", "epoch_end@10", "eval_end@10", "epoch_end@20", "eval_end@20", "fit_end@20"]
    assert res["step"] == 20 and res["epoch"] == 2 and set(res["val"]) == {"val_loss", "val_accuracy"}
    rows = read_csv(str(tmp_path / "metrics.csv"))
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [5, 10, 15, 20]
    assert all(r["tokens_per_s"] == r["samples_per_s"] * 8 and 0 < r["mfu"] for r in train_rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20]
    assert train_rows[-1]["loss"] == res["train_loss"] < train_rows[0]["loss"]
    assert os.path.getsize(tmp_path / "curves.png") > 1000
    assert os.listdir(tmp_path / "tensorboard")


def test_early_stopping_agrees_on_every_rank(pools, tmp_path) -> None:
    results = pools(2).run(fit_with_callbacks, str(tmp_path), True)
    for res in results:
        # evaluations at steps 4 (best), 8 and 12 (worse twice) -> stop after step 12
        assert res["step"] == 12 and res["calls"][-1] == "fit_end@12"
        assert res["val"] == results[0]["val"]
