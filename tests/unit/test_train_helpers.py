"""Trainer building blocks that need no process group: LR helpers, loss scaler, metrics, loggers."""

from __future__ import annotations

import math
import os

import pytest
import torch

from shardwise.errors import ConfigError, ShardwiseError
from shardwise.parallel.ddp import DDPOptions
from shardwise.data.batch import split_batch
from shardwise.train.loggers import CSVLogger
from shardwise.train.lr import scale_lr, warmup_cosine, warmup_cosine_factor
from shardwise.train.metrics import SumCount, accuracy, resolve_metrics, throughput
from shardwise.train.plot import plot_curves, read_csv
from shardwise.train.precision import LossScaler, check_precision


def test_scale_lr_rules() -> None:
    assert scale_lr(0.1, 8) == pytest.approx(0.8)
    assert scale_lr(0.1, 16, rule="sqrt", base_dp_size=4) == pytest.approx(0.2)
    assert scale_lr(0.1, 8, rule="none") == 0.1
    with pytest.raises(ConfigError, match="rule"):
        scale_lr(0.1, 2, rule="cubic")


def test_warmup_cosine_shape() -> None:
    f = lambda s: warmup_cosine_factor(s, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)  # noqa: E731
    assert f(0) == 0.0 and f(5) == pytest.approx(0.5) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = warmup_cosine(warmup_steps=2, total_steps=4)(opt)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 1.0, 2.0, 1.0])
    with pytest.raises(ConfigError):
        warmup_cosine(warmup_steps=5, total_steps=3)


def test_loss_scaler_unscales_detects_and_adapts() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    scaler = LossScaler(init_scale=8.0, growth_interval=2, backoff_factor=0.5, growth_factor=2.0)
    p.grad = torch.tensor([8.0, 16.0, -8.0])
    assert scaler.unscale_([p]) is True
    assert p.grad.tolist() == [1.0, 2.0, -1.0]
    scaler.update()
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    assert scaler.unscale_([p]) is False
    scaler.update()
    assert scaler.scale == 4.0 and scaler.clean_steps == 0 and scaler.skipped_steps == 1
    for _ in range(2):
        p.grad = torch.ones(3)
        assert scaler.unscale_([p])
        scaler.update()
    assert scaler.scale == 8.0
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_fp16_on_cpu_warns() -> None:
    with pytest.warns(UserWarning, match="bf16"):
        check_precision("fp16", "cpu")
    with pytest.raises(ConfigError):
        check_precision("fp64", "cpu")
    check_precision("fp8", "cpu")  # torchao float8 Linear layers (emulated here), bf16 autocast elsewhere


def test_metrics_are_sums_over_counts() -> None:
    out = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    correct, total = accuracy(out, torch.tensor([1, 1, 1]))
    assert correct.item() == 2 and total == 3
    acc = SumCount()
    acc.add("accuracy", torch.tensor(2), 3)
    acc.add("accuracy", torch.tensor(1), 1)
    assert acc.reduce(None, ["accuracy"], torch.device("cpu"))["accuracy"] == pytest.approx(0.75)  # not (2/3 + 1)/2
    assert set(resolve_metrics(["accuracy"])) == {"accuracy"}
    with pytest.raises(ConfigError, match="unknown metric"):
        resolve_metrics(["f1"])
    rates = throughput(samples=100, seconds=2.0, tokens_per_sample=10, flops_per_sample=1e9, peak_flops_total=1e12)
    assert rates == pytest.approx({"samples_per_s": 50.0, "tokens_per_s": 500.0, "mfu": 0.05})


def test_csv_logger_widens_header_and_plot_writes_png(tmp_path) -> None:
    logger = CSVLogger(tmp_path)
    logger.log({"loss": 2.0, "samples_per_s": 10.0, "epoch": 0}, step=1)
    logger.log({"loss": 1.5, "samples_per_s": 12.0, "epoch": 0}, step=2)
    logger.log({"val_loss": 1.7, "epoch": 0}, step=2)
    rows = read_csv(logger.path)
    assert [r["step"] for r in rows] == [1, 2, 2] and rows[2]["val_loss"] == 1.7 and "loss" not in rows[2]
    png = plot_curves(logger.path, str(tmp_path / "curves.png"))
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 1000


def test_csv_logger_writes_nothing_before_begin_and_keeps_history_on_resume(tmp_path) -> None:
    first = CSVLogger(tmp_path)
    assert not os.path.exists(first.path)  # a run refused at start leaves no (empty) file behind
    for step in (1, 2, 3, 4):
        first.log({"loss": 1.0 / step}, step=step)
    first.log({"val_loss": 0.5}, step=4)
    before = open(first.path).read()
    CSVLogger(tmp_path)  # constructing a logger changes nothing
    assert open(first.path).read() == before
    resumed = CSVLogger(tmp_path)
    resumed.begin(2)  # resumed from the checkpoint of step 2: steps 3 and 4 are redone
    resumed.log({"loss": 0.3}, step=3)
    rows = read_csv(resumed.path)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["loss"] == 0.3
    fresh = CSVLogger(tmp_path)
    fresh.begin(0)
    assert read_csv(fresh.path) == []


def test_trainer_arguments_fail_before_any_process_group(monkeypatch) -> None:
    from torch import nn

    from shardwise.train.options import TrainOptions
    from shardwise.train.trainer import Trainer

    def no_init(*args, **kwargs):
        raise AssertionError("the process group must not be touched")

    monkeypatch.setattr("shardwise.runtime.env.init", no_init)
    model = nn.Linear(2, 2)
    for kwargs, pattern in [
        ({"train": TrainOptions(max_steps=-5)}, "max_steps=-5 must be a positive integer"),
        ({"train": TrainOptions(max_epochs=0)}, "max_epochs=0"),
        ({"train": TrainOptions(eval_every=0)}, "eval_every=0"),
        ({"train": TrainOptions(clip_grad_norm=-1.0)}, "clip_grad_norm=-1.0"),
        ({"global_batch_size": 0}, "global_batch_size=0"),
        ({"loss_fn": "mse"}, "loss_fn='mse' is not callable"),
    ]:
        args = {"loss_fn": nn.functional.mse_loss, "global_batch_size": 4, **kwargs}
        with pytest.raises(ConfigError, match=pattern):
            Trainer(model, **args)


def test_a_non_scalar_loss_names_loss_fn() -> None:
    import torch

    from shardwise.train.checks import scalar_loss

    with pytest.raises(ConfigError, match=r"loss_fn returned a tensor of shape \(4,\), not a scalar"):
        scalar_loss(lambda out, y: (out - y) ** 2)(torch.zeros(4), torch.ones(4))
    with pytest.raises(ConfigError, match="loss_fn returned a float"):
        scalar_loss(lambda out, y: 1.0)(torch.zeros(4), torch.ones(4))
    assert scalar_loss(lambda out, y: ((out - y) ** 2).mean())(torch.zeros(4), torch.ones(4)).item() == 1.0


def test_schedules_that_need_the_step_count_are_built_by_fit() -> None:
    import torch

    from shardwise.train.checks import wants_total_steps

    deferred = warmup_cosine(warmup_steps=50)
    assert wants_total_steps(deferred) and not wants_total_steps(warmup_cosine(warmup_steps=2, total_steps=4))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = deferred(opt, 10)  # warmup clipped to the 10 steps there are
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[-1] == pytest.approx(0.9)


def test_batch_and_ddp_option_errors() -> None:
    assert split_batch({"inputs": 1, "targets": 2}) == (1, 2)
    with pytest.raises(ShardwiseError, match="inputs, targets"):
        split_batch((1, 2, 3))
    with pytest.raises(ConfigError, match="comm_hook"):
        DDPOptions(comm_hook="int8")
    assert math.isfinite(DDPOptions().bucket_cap_mb)
