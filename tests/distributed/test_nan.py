"""A NaN injected into one layer's output is reported with that layer's name, the step and the rank.

Four real Gloo processes train a DDP model; at step 5 rank 1's ``fc1`` output gets a NaN (a forward
hook registered before the guard, as a real bad activation would be). Every rank must stop with
the same report naming rank 1, ``fc1`` and step 5 (stop policy), or skip exactly that step and
keep the weights finite and equal across ranks (skip policy).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardwise.observe.nan import NanGuard, NonFiniteError

BAD_STEP, BAD_RANK = 5, 1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(8, 16), act=nn.Tanh(), fc2=nn.Linear(16, 4)))


def _train(policy: str, steps: int = 7):
    rank = dist.get_rank()
    net = _model()
    state = {"step": 0}

    def inject(module, args, out):
        if rank == BAD_RANK and state["step"] == BAD_STEP:
            out = out.clone()
            out[0, 3] = float("nan")
        return out

    net.fc1.register_forward_hook(inject)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NanGuard(model, policy=policy).attach()
    applied = []
    try:
        for step in range(1, steps + 1):
            state["step"] = step
            torch.manual_seed(100 + step * 10 + rank)
            loss = model(torch.randn(4, 8)).square().mean()
            opt.zero_grad()
            loss.backward()
            if guard.check(step, loss):
                opt.step()
                applied.append(step)
    except NonFiniteError as err:
        return "stopped", str(err), [f.__dict__ for f in guard.findings]
    finally:
        guard.detach()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return "done", applied, weights


def test_nan_in_one_layer_is_named_with_step_and_rank_and_stops_every_rank(dist4) -> None:
    results = dist4.run(_train, "stop")
    for status, message, findings in results:
        assert status == "stopped"
        assert f"non-finite values at step {BAD_STEP}" in message
        assert (
            f"rank {BAD_RANK}: first non-finite output in module 'fc1' (Linear output contains NaN or inf)" in message
        )
        first = min(findings, key=lambda f: ("forward", "loss", "gradient").index(f["stage"]))
        assert (first["rank"], first["stage"], first["module"], first["step"]) == (BAD_RANK, "forward", "fc1", BAD_STEP)
        # The other ranks only see the NaN arrive in their gradients through DDP's all-reduce.
        assert {f["rank"]: f["stage"] for f in findings if f["rank"] != BAD_RANK} == {
            0: "gradient",
            2: "gradient",
            3: "gradient",
        }
    assert len({r[1] for r in results}) == 1  # the same report on every rank


def test_skip_policy_drops_only_the_bad_step(dist4) -> None:
    results = dist4.run(_train, "skip")
    for status, applied, weights in results:
        assert status == "done"
        assert applied == [s for s in range(1, 8) if s != BAD_STEP]
        assert torch.isfinite(weights).all()
        torch.testing.assert_close(weights, results[0][2], rtol=0, atol=0)


def test_single_process_loss_check_and_unknown_policy() -> None:
    net = _model()
    guard = NanGuard(net, policy="warn", check_grads=False).attach()
    net(torch.randn(2, 8))
    assert guard.local_finding(1, torch.tensor(float("inf"))).stage == "loss"
    with pytest.raises(Exception, match="policy"):
        NanGuard(net, policy="ignore")  # type: ignore[arg-type]
