"""The Trainer's build step and its arguments through real fits: schedules that need the step count,
learning-rate scaling with the plan, FSDP options next to the plan's precision, a loss that is not
a scalar, and the restore-first order of ``on_fit_start``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.callback import Callback
from shardwise.errors import ConfigError
from shardwise.parallel.fsdp import FSDPOptions
from shardwise.train import LoggingOptions, ParallelOptions, TrainOptions, Trainer, warmup_cosine
from tests.helpers import make_data, make_model, sgd


class LRs(Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_step_end(self, trainer, metrics) -> None:
        self.lrs.append(metrics["lr"])


def fit_with_deferred_schedule(scale: str) -> dict:
    rec = LRs()
    trainer = Trainer(make_model(), loss_fn=F.cross_entropy, optimizer=sgd, global_batch_size=32,
                      train=TrainOptions(max_epochs=2, lr_scheduler=warmup_cosine(warmup_steps=4, min_lr_ratio=0.1),
                                         scale_lr=scale),
                      logging=LoggingOptions(progress_bar=False), callbacks=[rec])
    before = (trainer.lr_scheduler, trainer.total_steps_for(make_data()), trainer.optimizer.param_groups[0]["lr"])
    trainer.fit(make_data())
    return {"scheduler_before_fit": before[0] is not None, "total": before[1], "base_lr": before[2], "lrs": rec.lrs,
            "steps": trainer.step, "total_steps": trainer.total_steps}


def test_a_schedule_without_total_steps_is_built_when_fit_knows_them(pools) -> None:
    got = pools(1).run(fit_with_deferred_schedule, "none")[0]
    # 320 samples, global batch 32: 10 steps per epoch, 2 epochs.
    assert not got["scheduler_before_fit"] and got["total"] == got["total_steps"] == got["steps"] == 20
    assert got["lrs"][3] == pytest.approx(0.2 * 1.0)  # the end of the warmup reaches the peak lr
    assert got["lrs"][-1] == pytest.approx(
        0.2 * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 16 / 16)).item())), abs=1e-6
    )


def test_scale_lr_follows_the_plans_data_parallel_size(pools) -> None:
    for got in pools(2).run(fit_with_deferred_schedule, "linear"):
        assert got["base_lr"] == pytest.approx(0.4)  # sgd's 0.2 for one replica, times dp=2
    for got in pools(2).run(fit_with_deferred_schedule, "sqrt"):
        assert got["base_lr"] == pytest.approx(0.2 * 2**0.5)


def fsdp_compute_dtype() -> dict:
    seen: list[torch.dtype] = []
    model = make_model()
    model[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    trainer = Trainer(model, loss_fn=F.cross_entropy, optimizer=sgd, global_batch_size=32, plan="zero=3,precision=bf16",
                      train=TrainOptions(max_steps=1),
                      parallel=ParallelOptions(fsdp=FSDPOptions(reshard_after_forward=True)),
                      logging=LoggingOptions(progress_bar=False))
    trainer.fit(make_data())
    master = {str(p.dtype) for p in trainer.model.parameters()}
    return {"compute": [str(d) for d in seen], "master": sorted(master)}


def test_fsdp_options_keep_the_plans_precision(pools) -> None:
    """Passing FSDPOptions used to replace the plan's precision (and CPU offload) by the options'
    defaults; now the plan decides them and the options only what the plan leaves open."""
    got = pools(1).run(fsdp_compute_dtype)[0]
    assert got["compute"] == ["torch.bfloat16"] and got["master"] == ["torch.float32"]


def fit_with_vector_loss() -> str:
    trainer = Trainer(make_model(), loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"), optimizer=sgd,
                      global_batch_size=32, train=TrainOptions(max_steps=1), logging=LoggingOptions(progress_bar=False))
    try:
        trainer.fit(make_data())
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_loss_that_is_not_a_scalar_names_loss_fn(pools) -> None:
    message = pools(1).run(fit_with_vector_loss)[0]
    assert message.startswith("loss_fn returned a tensor of shape (32,), not a scalar")


class SeesStep(Callback):
    def __init__(self) -> None:
        self.at_start: int | None = None

    def on_fit_start(self, trainer) -> None:
        self.at_start = trainer.step


def fit_and_resume(directory: str) -> list[int | None]:
    seen = []
    for max_steps in (3, 6):
        cb = SeesStep()
        trainer = Trainer(make_model(), loss_fn=F.cross_entropy, optimizer=sgd, global_batch_size=32,
                          train=TrainOptions(max_steps=max_steps), logging=LoggingOptions(progress_bar=False),
                          callbacks=[cb], checkpoint=directory)
        trainer.fit(make_data(), resume="auto")
        seen.append(cb.at_start)
    return seen


def test_every_callback_sees_the_restored_state_at_fit_start(pools, tmp_path) -> None:
    """The checkpoint restores first, whatever the callbacks' order (a user callback is listed before it)."""
    assert pools(1).run(fit_and_resume, str(tmp_path / "ckpt"))[0] == [0, 3]
