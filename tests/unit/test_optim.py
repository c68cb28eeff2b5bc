"""shardwise.optim on one process: the classifier and its refusal, the routing of parameters to
Muon or AdamW, Newton–Schulz, and Muon's step against torch's own Muon."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.optim import Muon, Units, check, kind, muon, newton_schulz, orthogonalize, route
from shardwise.optim.exchange import chunk_sizes, owners


class Lamb(torch.optim.Adam):  # a trust-ratio optimizer: an element-wise base with its own step
    def step(self, closure=None):  # pragma: no cover - never stepped
        return super().step(closure)


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(4, 3))]


def test_kinds() -> None:
    assert kind(torch.optim.AdamW(_params())) == "elementwise"
    assert kind(torch.optim.SGD(_params(), lr=0.1)) == "elementwise"
    assert kind(torch.optim.Muon(_params())) == "whole_tensor"
    assert kind(torch.optim.Adafactor(_params())) == "whole_tensor"
    assert kind(Lamb(_params())) == "whole_tensor"
    assert kind(torch.optim.LBFGS(_params())) == "whole_model"
    assert kind(Muon(_params())) == "muon"


def test_refusal_names_optimizer_plan_and_fix() -> None:
    opt = torch.optim.Muon(_params())
    for plan in ("zero=3,shard=2", "zero=2,shard=2", "tp=2", "dp=2,tp=2", "ep=2,dp=2"):
        with pytest.raises(ConfigError) as err:
            check(opt, Plan.parse(plan))
        text = str(err.value)
        assert "torch.optim.Muon" in text and "shardwise.optim.muon" in text and "\n" not in text, text
    assert "zero=3" in str(pytest.raises(ConfigError, check, Lamb(_params()), Plan.parse("zero=3,shard=4")).value)
    for plan in ("dp=2", "zero=1,shard=2", "pp=2", "cp=2"):  # whole parameters on every rank
        check(opt, Plan.parse(plan))
    check(Muon(_params()), Plan.parse("zero=3,shard=2,tp=2"))
    check(torch.optim.AdamW(_params()), Plan.parse("zero=3,shard=2,tp=2"))
    with pytest.raises(ConfigError, match="all parameters at once"):
        check(torch.optim.LBFGS(_params()), Plan.parse("zero=1,shard=2"))


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, 2
        self.qkv_proj = nn.Linear(8, 16)  # q 8 | k 4 | v 4


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(3, 10, 8))
        self.down_proj = nn.Parameter(torch.randn(3, 8, 5))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.attn = Attn()
        self.experts = Experts()
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 11, bias=False)
        self.lm_head.weight = self.embed.weight  # tied


def test_routing_units() -> None:
    r = route(Net())
    assert [n for n, _ in r.muon] == ["attn.qkv_proj.weight", "experts.gate_up_proj", "experts.down_proj"]
    assert {n for n, _ in r.adamw} == {"embed.weight", "attn.qkv_proj.bias", "norm.weight", "norm.bias"}
    assert r.units["attn.qkv_proj.weight"].sizes == (8, 4, 4)  # grouped-query widths
    assert r.units["experts.gate_up_proj"] == Units(logical=(3, 10, 8), split_dim=1, sizes=(5, 5), fan_out_dim=1)
    assert r.units["experts.gate_up_proj"].count == 6
    assert "Muon: 3 parameters (12 matrices" in r.summary()


def test_unknown_matrix_is_refused_and_can_be_named() -> None:
    net = nn.Module()
    net.table = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ConfigError, match="cannot tell what parameter table"):
        route(net)
    assert [n for n, _ in route(net, muon=["table"]).muon] == ["table"]
    assert [n for n, _ in route(net, adamw=["tab*"]).adamw] == ["table"]


def test_newton_schulz_orthogonalizes_units() -> None:
    g = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    o = newton_schulz(g, dtype=torch.float32)
    s = torch.linalg.svdvals(o)
    assert ((s > 0.5) & (s < 1.5)).all(), s  # torch's coefficients: singular values near 1, not exactly
    pieces = orthogonalize(g, Units(logical=(12, 5), sizes=(4, 4, 4)), dtype=torch.float32, adjust_lr=None)
    for piece, part in zip(pieces.split(4), g.split(4)):
        torch.testing.assert_close(piece, newton_schulz(part, dtype=torch.float32))
    batch = orthogonalize(
        torch.randn(3, 4, 6), Units(logical=(3, 4, 6), split_dim=1, fan_out_dim=1), dtype=torch.float32
    )
    assert batch.shape == (3, 4, 6)


def test_muon_step_matches_torch_muon() -> None:
    """fp32 parameters, Nesterov (torch's bf16/non-Nesterov aliasing bug is not on this path);
    both Newton–Schulz in bf16, so within bf16 rounding."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(6, 4))
    b.data.copy_(a.data)
    start = a.detach().clone()
    ours, theirs = (
        Muon([a], lr=0.1, adjust_lr="match_rms_adamw"),
        torch.optim.Muon([b], lr=0.1, adjust_lr_fn="match_rms_adamw"),
    )
    for step in range(3):
        g = torch.randn(6, 4)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert float((a - b).norm() / (b - start).norm()) < 2e-2  # of the 3 steps' change


def test_owner_assignment_and_uneven_chunks() -> None:
    assert chunk_sizes(5, 4) == [2, 2, 1, 0] and chunk_sizes(7, 4) == [2, 2, 2, 1] and chunk_sizes(0, 2) == [0, 0]
    assert owners([10, 100, 50, 40], 2) == [1, 0, 1, 1]  # 100 -> 0, 50 -> 1, 40 -> 1, 10 -> 1


def test_muon_factory_checks_options_and_needs_the_model() -> None:
    with pytest.raises(ValueError, match="adjust_lr"):
        muon(adjust_lr="bogus")
    with pytest.raises(ConfigError, match="parameter names"):
        muon()(_params())
    opt = muon(lr=0.01).for_module(Net())
    assert [g["muon"] for g in opt.param_groups] == [True, False] and opt.param_groups[1]["lr"] == 3e-4


def test_train_optimizer_option() -> None:
    from shardwise.config.sections import TrainSection
    from shardwise.jobs.common import job_optimizer
    from shardwise.optim import MuonFactory

    factory = job_optimizer(TrainSection(optimizer="muon", muon_lr=0.03, lr=1e-3))
    assert isinstance(factory, MuonFactory) and factory.options["lr"] == 0.03 and factory.options["adamw_lr"] == 1e-3
    assert isinstance(job_optimizer(TrainSection())(Net().parameters()), torch.optim.AdamW)
    with pytest.raises(ConfigError):
        TrainSection(optimizer="lion")


def test_plan_auto_searches_only_plans_the_optimizer_runs_exactly_and_prices_muon() -> None:
    """plan="auto": a whole-tensor optimizer (torch's Muon) is offered no plan that shards
    parameters; shardwise's Muon is offered every plan, with one momentum on its matrices (less
    optimizer state than Adam's two moments); an element-wise one is unrestricted."""
    from dataclasses import replace as replaced

    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.auto.measure import module_stats
    from shardwise.optim import allows, factory_kind, muon
    from shardwise.optim.classify import sharding
    from shardwise.plan.cluster import resolve
    from shardwise.auto.choose import plan_for_trainer

    assert factory_kind(muon(lr=0.02)) == "muon"
    assert factory_kind(lambda p: torch.optim.AdamW(p, lr=1e-3)) == "elementwise"
    assert factory_kind(lambda p: torch.optim.Muon(p, lr=0.02)) == "whole_tensor"
    model = GPT(GPTConfig())
    stats = module_stats(model)
    # a device too small for the whole model's Adam states: element-wise optimizers shard
    cpu = replaced(resolve("cpu", devices=4, devices_per_node=4), memory_bytes=3.0 * 16 * stats.params_total)
    free = plan_for_trainer(model, stats, cpu, world_size=4, global_batch=16)
    assert any(sharding(e.plan) for e in free.result.plans)
    whole = plan_for_trainer(model, stats, cpu, world_size=4, global_batch=16, optimizer="whole_tensor")
    assert whole.result.plans and all(
        sharding(e.plan) is None and allows("whole_tensor", e.plan) for e in whole.result.plans
    )
    adam = plan_for_trainer(
        model, stats, cpu, world_size=4, global_batch=16, optimizer="elementwise", pipelines_allowed=False
    )
    muon_plan = plan_for_trainer(model, stats, cpu, world_size=4, global_batch=16, optimizer="muon")
    same = next(e for e in muon_plan.result.plans if any(a.plan == e.plan for a in adam.result.plans))
    theirs = next(a for a in adam.result.plans if a.plan == same.plan)
    assert same.memory["optimizer"] < theirs.memory["optimizer"]
