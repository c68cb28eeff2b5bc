"""Trainer(plan="auto") on the user's own model: the sample shape comes from the data, an impossible
request fails before any measuring, and the chosen plan is certified by parity (and refused when
its parity is broken on purpose). The planner plans with the ``cpu`` preset here (``cluster=``), so
no test calibrates the machine."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from shardwise.layout import Plan


class SmallCNN(nn.Module):
    """Two identical conv stages between a stem and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU()) for _ in range(3)
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = x + stage(x)
        return self.head(x.mean((2, 3)))


class Wrapped(nn.Module):
    """forward(ids) -> logits around an HF model, with an .item() in it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if ids.min().item() >= 0 else 0.0
        return self.model(ids).logits * scale


def make(kind: str) -> tuple[nn.Module, TensorDataset, object]:
    g = torch.Generator().manual_seed(0)
    ce = nn.functional.cross_entropy
    if kind == "mlp":
        torch.manual_seed(0)
        x = torch.randn(64, 12, generator=g)
        return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4)), TensorDataset(x, (x[:, :4]).argmax(1)), ce
    if kind == "cnn":
        x = torch.randn(64, 1, 8, 8, generator=g)
        return SmallCNN(), TensorDataset(x, (x.mean((1, 2, 3)) > 0).long() + 2 * (x[:, 0, 0, 0] > 0).long()), ce
    from shardwise.models.hf import build_causal_lm, lm_loss, tiny_config

    if (
        kind == "wrapped"
    ):  # a user's wrapper: eager attention and a data-dependent op, which the meta forward cannot run
        config = tiny_config("llama", layers=3, hidden=32, heads=4, kv_heads=2, vocab=64, seq=32)
        config._attn_implementation = "eager"
        model = Wrapped(build_causal_lm(config, seed=0))
        tokens = torch.randint(0, 64, (64, 17), generator=g)
        return model, TensorDataset(tokens[:, :-1], tokens[:, 1:]), lm_loss
    model = build_causal_lm(tiny_config(kind, layers=3, hidden=32, heads=4, kv_heads=2, vocab=64, seq=32), seed=0)
    tokens = torch.randint(0, 64, (64, 17), generator=g)
    return model, TensorDataset(tokens[:, :-1], tokens[:, 1:]), lm_loss


def fit_auto(kind: str, run_dir: str | None = None, corrupt: bool = False) -> dict:
    from shardwise.train import LoggingOptions, ParallelOptions, TrainOptions, Trainer
    from shardwise.auto.certify import CertifyOptions

    model, data, loss = make(kind)
    options = CertifyOptions(enabled=True, after_backward=corrupt_first_plan if corrupt else None)
    CORRUPTED.clear()
    trainer = Trainer(model, loss_fn=loss, plan="auto", global_batch_size=8,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.05), train=TrainOptions(max_steps=4),
                      parallel=ParallelOptions(cluster="cpu", certify=options),
                      logging=LoggingOptions(log_every=1, progress_bar=False, run_dir=run_dir))
    result = trainer.fit(data)
    return {
        "plan": str(trainer.plan),
        "loss": result.train_loss,
        "world": dist.get_world_size(),
        "corrupted": list(CORRUPTED),
    }


CORRUPTED: list[str] = []


def corrupt_first_plan(pm, plan) -> None:
    """Break the first candidate on purpose: rank 1 scales its local shard of one gradient."""
    if CORRUPTED and CORRUPTED[0] != str(plan):
        return
    if not CORRUPTED:
        CORRUPTED.append(str(plan))
    if dist.get_rank() == 1:
        p = next(q for q in pm.parameters() if q.grad is not None)
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grad.mul_(1.5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "kind,world",
    [("mlp", 2), ("mlp", 4), ("cnn", 2), ("cnn", 4), ("llama", 2), ("gpt2", 2), ("mixtral", 2), ("wrapped", 2)],
)
def test_auto_trains_any_model_with_a_certified_plan(pools, tmp_path, kind: str, world: int) -> None:
    results = pools(world).run(fit_auto, kind, str(tmp_path))
    plan = Plan.parse(results[0]["plan"])
    assert plan.world_size == world and all(r["plan"] == results[0]["plan"] for r in results)
    assert all(r["loss"] is not None and r["loss"] == r["loss"] for r in results)
    saved = json.loads((tmp_path / "auto_plan.json").read_text())
    cert = saved["certificate"]
    assert cert["certified"] == results[0]["plan"] == str(Plan.from_dict(saved["plan"]))
    assert cert["rtol"] == 1e-5 and cert["seconds"] > 0 and cert["candidates"][-1]["passed"]
    assert cert["compared"]["steps"] == 3 and "of the training data" in cert["compared"]["samples"]
    if kind in ("llama", "gpt2", "mixtral", "wrapped"):
        assert "of 3 layers" in cert["compared"]["model"] or "2 of 3 blocks" in cert["compared"]["model"]


@pytest.mark.timeout(300)
def test_certification_refuses_a_broken_plan_and_falls_back(dist2, tmp_path) -> None:
    results = dist2.run(fit_auto, "mlp", str(tmp_path), True)
    broken = results[0]["corrupted"][0]
    assert results[0]["plan"] != broken and all(r["plan"] == results[0]["plan"] for r in results)
    cert = json.loads((tmp_path / "auto_plan.json").read_text())["certificate"]
    first, last = cert["candidates"][0], cert["candidates"][-1]
    assert (
        first["plan"] == broken
        and not first["passed"]
        and "diverged" in first["failed"]
        and "> rtol 1e-05" in first["failed"]
    )
    assert last["passed"] and cert["certified"] == results[0]["plan"]


def impossible_requests() -> list[dict]:
    """Each request fails with one ConfigError line, in well under a second of this process's CPU
    time, and before the machine is measured (measuring is replaced by a failure here)."""
    import shardwise.auto.machine as machine
    from shardwise.errors import ConfigError
    from shardwise.train import LoggingOptions, TrainOptions, Trainer

    def no_measuring(env):  # noqa: ANN001
        raise AssertionError("the machine was measured before the request was checked")

    huge = nn.Sequential(
        nn.Linear(100_000, 100_000, device="meta"), nn.ReLU(), nn.Linear(100_000, 4, device="meta")
    )  # 10B
    labels = torch.zeros(8, dtype=torch.long)
    cases = {
        "too big": (huge, TensorDataset(torch.zeros(8, 100_000), labels)),
        "wrong input": (nn.Sequential(nn.Linear(12, 4)), TensorDataset(torch.zeros(8, 5), labels)),
        "too little data": (nn.Sequential(nn.Linear(12, 4)), TensorDataset(torch.zeros(3, 12), labels[:3])),
    }
    out = []
    measure, machine.machine_spec = machine.machine_spec, no_measuring
    try:
        for name, (model, data) in cases.items():
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                Trainer(model, loss_fn=nn.functional.cross_entropy, plan="auto", global_batch_size=4,
                        train=TrainOptions(max_steps=2), logging=LoggingOptions(progress_bar=False)).fit(data)
                message = "no error"
            except ConfigError as exc:
                message = str(exc)
            out.append(
                {
                    "case": name,
                    "message": message,
                    "cpu_s": time.process_time() - cpu,
                    "wall_s": time.perf_counter() - wall,
                }
            )
    finally:
        machine.machine_spec = measure  # the pool's processes serve later tests
    return out


@pytest.mark.timeout(120)
def test_impossible_auto_requests_fail_fast_before_measuring(dist2) -> None:
    for rank in dist2.run(impossible_requests):
        got = {r["case"]: r for r in rank}
        assert got["too big"]["message"].startswith("plan='auto' found no plan: no plan fits")
        assert "cannot run its first training sample" in got["wrong input"]["message"]
        assert "smaller than one global batch" in got["too little data"]["message"]
        for r in rank:
            assert "\n" not in r["message"]
            assert r["cpu_s"] < 1.0, r  # CPU time of this process: the load of other processes does not count


def certify_each(kind: str, plans: list[str]) -> list[dict]:
    """Certify each layout alone on a shrunken copy of ``kind`` and the first batches of its data."""
    from shardwise.runtime.env import init
    from shardwise.auto.certify import CertifyOptions, certify_plans
    from shardwise.auto.sample import AutoData

    model, data, loss = make(kind)
    auto = AutoData(data, certify=CertifyOptions(enabled=True))
    return [
        certify_plans(
            model, [Plan.parse(p, world_size=dist.get_world_size())], data=auto, env=init(), loss_fn=loss
        ).to_dict()
        for p in plans
    ]


@pytest.mark.timeout(300)
def test_certification_passes_sharded_layouts_of_a_hugging_face_model(dist2) -> None:
    """Not only data parallelism: TP, ZeRO-3 and a pipeline of a Llama agree with one process at
    rtol 1e-5 on real batches (a false refusal would make plan="auto" fall back for nothing)."""
    plans = ["tp=2", "zero=3", "pp=2,microbatches=2"]
    for rank in dist2.run(certify_each, "llama", plans):
        for want, cert in zip(plans, rank):
            assert cert["certified"] == str(Plan.parse(want, world_size=2)), cert["candidates"]
        assert "2 of 3 blocks" in rank[2]["compared"]["model"]  # one block per pipeline stage at least
