"""The Trainer end to end with pipeline parallelism: ``Trainer(..., plan="pp=2,microbatches=4")``
equals the one-process Trainer (fp32, 20 steps, same seed and global batch; losses, clipped
gradient norms and final weights within rtol 1e-5, weights with atol 1e-6 for values near zero).
The one-process Trainer is itself checked against a hand-written loop in test_trainer_parity."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from shardwise.errors import ConfigError
from shardwise.train import Callback, LoggingOptions, TrainOptions, Trainer

SEED = 7


def make_data(n: int = 320) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x @ torch.randn(8, 3, generator=g)).argmax(1))


def make_model() -> nn.Module:
    torch.manual_seed(123)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []

    def on_step_end(self, trainer, metrics) -> None:
        self.losses.append(metrics["loss"])
        self.norms.append(metrics["grad_norm"])


def run_fit(plan: str, accum: int = 1, gbs: int = 32) -> dict:
    rec = Record()
    trainer = Trainer(make_model(), loss_fn=F.cross_entropy,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9), plan=plan, global_batch_size=gbs,
                      train=TrainOptions(grad_accum_steps=accum, clip_grad_norm=0.5, max_steps=20, seed=SEED),
                      logging=LoggingOptions(log_every=1, progress_bar=False), callbacks=[rec])
    trainer.fit(make_data())
    weights = {}
    for name, p in trainer.model.module.named_parameters():
        name = name.removeprefix("module.")
        weights[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return {"losses": rec.losses, "norms": rec.norms, "weights": weights}


def bad_batch() -> str:
    try:
        run_fit("pp=2,microbatches=4", gbs=6)  # 6 samples do not split into 4 microbatches
    except ConfigError as exc:
        return str(exc)
    return "no error"


def check(ref: dict, results: list[dict]) -> None:
    assert ref["losses"][-1] < 0.7 * ref["losses"][0]  # it trains
    assert max(ref["norms"]) > 0.5  # clipping is active on some steps
    weights: dict[str, torch.Tensor] = {}
    for got in results:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
        weights.update(got["weights"])
    assert weights.keys() == ref["weights"].keys()
    for key, value in ref["weights"].items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_trainer_pp2_and_dp2_pp2_equal_one_process(pools) -> None:
    ref = pools(1).run(run_fit, "dp")[0]
    check(ref, pools(2).run(run_fit, "pp=2,microbatches=4"))
    # data x pipeline, with gradient accumulation: 2 micro-steps of 8 per rank, 2 microbatches each
    check(ref, pools(4).run(run_fit, "dp=2,pp=2,schedule=gpipe,microbatches=2", 2))


def test_trainer_refuses_a_batch_that_does_not_split_into_microbatches(pools) -> None:
    messages = pools(2).run(bad_batch)
    assert all("does not split into 4 equal microbatches" in m for m in messages), messages
