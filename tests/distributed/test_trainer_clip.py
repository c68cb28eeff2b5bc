"""Global gradient norm and clipping with DTensor gradients, and the Trainer on every plan.

``global_grad_norm`` must sum squared *local shard* norms over the mesh dimensions a gradient is
sharded on, and must not count replicated dimensions twice; the reference is the norm of the full
(unsharded) gradients, which every rank can compute because the test builds them from one seed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from shardwise.plan import Plan
from shardwise.train.clip import clip_grad_norm_, global_grad_norm
from tests.helpers import Record, make_data, make_model, sgd

LAYOUTS = [
    (Shard(0), Replicate()),  # sharded over rows of the mesh, replicated over columns
    (Replicate(), Shard(1)),
    (Shard(0), Shard(1)),  # sharded over both mesh dimensions
    (Replicate(), Replicate()),
]


def dtensor_norms() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    torch.manual_seed(0)
    fulls = [torch.randn(4, 6) * (i + 1) for i in range(len(LAYOUTS) + 2)]
    params = []
    for full, layout in zip(fulls, LAYOUTS):
        p = nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, layout))
        p.grad = distribute_tensor(full, mesh, layout)
        params.append(p)
    # A Partial gradient: each rank holds a quarter of the full value (its sum is the full tensor).
    partial = nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, (Replicate(), Replicate())))
    from torch.distributed.tensor import DTensor

    partial.grad = DTensor.from_local(fulls[-2] / 4, mesh, (Partial(), Partial()), run_check=False)
    params.append(partial)
    plain = nn.Parameter(torch.zeros(4, 6))  # an unsharded (replicated) plain tensor
    plain.grad = fulls[-1].clone()
    params.append(plain)
    expected = math.sqrt(sum(f.pow(2).sum().item() for f in fulls))
    got = global_grad_norm(params).item()
    got_inf = global_grad_norm(params, norm_type=float("inf")).item()
    before = clip_grad_norm_(params, max_norm=1.0).item()
    clipped = math.sqrt(
        sum(
            p.grad.full_tensor().pow(2).sum().item() if hasattr(p.grad, "full_tensor") else p.grad.pow(2).sum().item()
            for p in params
        )
    )
    return {
        "expected": expected,
        "got": got,
        "expected_inf": max(f.abs().max().item() for f in fulls),
        "got_inf": got_inf,
        "before": before,
        "clipped": clipped,
    }


def test_dtensor_grad_norm_counts_each_shard_once(dist4) -> None:
    results = dist4.run(dtensor_norms)
    for res in results:
        assert res["got"] == results[0]["got"]  # the same float on every rank
        assert res["got"] == pytest.approx(res["expected"], rel=1e-6)
        assert res["got_inf"] == pytest.approx(res["expected_inf"], rel=1e-6)
        assert res["before"] == pytest.approx(res["expected"], rel=1e-6)
        assert res["clipped"] == pytest.approx(1.0, rel=1e-5)


def fit_with_plan(plan: str) -> dict:
    from shardwise.train import LoggingOptions, TrainOptions, Trainer

    rec = Record()
    trainer = Trainer(make_model(), loss_fn=torch.nn.functional.cross_entropy, optimizer=sgd, plan=plan,
                      global_batch_size=32, train=TrainOptions(clip_grad_norm=0.5, max_steps=12, seed=7),
                      logging=LoggingOptions(log_every=1, progress_bar=False), callbacks=[rec])
    trainer.fit(make_data())
    return {
        "losses": rec.losses,
        "norms": rec.norms,
        "val": trainer.evaluate(make_data(10)),
        "world": dist.get_world_size(),
    }


@pytest.mark.parametrize("plan", ["zero=3,dp=2", "zero=1,dp=2", "tp=2", "pp=2,schedule=gpipe,microbatches=2"])
def test_trainer_on_sharded_plans_equals_one_process(pools, plan: str) -> None:
    """Through the Trainer, FSDP / ZeRO-1 / TP / PP agree with one process (losses and clip norms)."""
    ref = pools(1).run(fit_with_plan, "dp")[0]
    assert max(ref["norms"]) > 0.5
    for got in pools(2).run(fit_with_plan, plan):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
        assert got["val"]["loss"] == pytest.approx(ref["val"]["loss"], rel=1e-5)


def fit_gpt(plan: str, run_dir: str | None = None) -> dict:
    """A tiny GPT (a model the planner can size): the auto plan must train like one process."""
    from torch.utils.data import TensorDataset

    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.train import LoggingOptions, TrainOptions, Trainer

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (64, 9), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    rec = Record()
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, layers=2, hidden=16, heads=2), seed=0)
    trainer = Trainer(model, loss_fn=lm_loss, optimizer=sgd, plan=plan, global_batch_size=16,
                      train=TrainOptions(max_steps=6, seed=7),
                      logging=LoggingOptions(log_every=1, progress_bar=False, run_dir=run_dir), callbacks=[rec])
    trainer.fit(data)
    return {"losses": rec.losses, "plan": str(trainer.plan)}


def test_auto_plan_is_the_same_on_every_rank_and_trains(pools, tmp_path) -> None:
    results = pools(2).run(fit_gpt, "auto", str(tmp_path))
    assert results[0]["plan"] == results[1]["plan"]
    # rank 0 saved the choice with its predictions and the reason next to the run's logs
    saved = json.loads((tmp_path / "auto_plan.json").read_text())
    assert str(Plan.from_dict(saved["plan"])) == results[0]["plan"]
    assert saved["prediction"]["step_time_s"] > 0 and saved["explanation"]
    ref = pools(1).run(fit_gpt, "dp")[0]
    for got in results:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)


def auto_on_too_small_cluster() -> str:
    """Rank 0 plans (a given cluster: nothing is checked before it); nothing fits its memory."""
    from dataclasses import replace

    from shardwise.errors import ConfigError
    from shardwise.plan.cluster import resolve
    from shardwise.train import LoggingOptions, ParallelOptions, Trainer

    tiny = replace(resolve("cpu", devices=2), memory_bytes=1e3)
    try:
        Trainer(make_model(), loss_fn=torch.nn.functional.cross_entropy, plan="auto", global_batch_size=32,
                parallel=ParallelOptions(cluster=tiny), logging=LoggingOptions(progress_bar=False)).fit(make_data())
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_auto_plan_failure_reaches_every_rank(dist2) -> None:
    for message in dist2.run(auto_on_too_small_cluster):
        assert message.startswith("plan='auto' found no plan: no plan fits") and "explicit plan" in message
