"""DDP options: bucket size, static graph and gradient-as-bucket-view change nothing numerically;
the fp16 compression hook changes gradients by its rounding only (bf16 needs NCCL); PowerSGD keeps replicas
identical; SyncBatchNorm conversion on CPU warns and keeps per-rank BatchNorm."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.ddp import DDPOptions, apply_ddp
from shardwise.parallel.mesh import build_mesh
from shardwise.layout import Plan
from tests.helpers import make_data, make_model


def train_ddp(options: DDPOptions, steps: int = 6) -> dict:
    import torch.distributed as dist

    meshes = build_mesh(Plan(dp=dist.get_world_size()), "cpu")
    model = apply_ddp(make_model(), meshes.dp, options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    x, y = make_data().tensors
    rank = meshes.dp.get_local_rank()
    grads, losses = [], []
    for s in range(steps):
        idx = slice(s * 32 + rank * 16, s * 32 + (rank + 1) * 16)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"grads": grads, "weights": weights, "losses": losses}


def bf16_hook_error() -> str:
    try:
        train_ddp(DDPOptions(comm_hook="bf16"), steps=1)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_bucketing_and_graph_options_are_exact(dist2) -> None:
    base = dist2.run(train_ddp, DDPOptions())
    for options in (
        DDPOptions(bucket_cap_mb=0.0005),
        DDPOptions(static_graph=True),
        DDPOptions(gradient_as_bucket_view=False),
    ):
        for b, got in zip(base, dist2.run(train_ddp, options)):
            torch.testing.assert_close(got["weights"], b["weights"], rtol=1e-6, atol=1e-7)


def test_compression_hooks(dist2) -> None:
    base = dist2.run(train_ddp, DDPOptions())[0]
    results = dist2.run(train_ddp, DDPOptions(comm_hook="fp16"))
    assert torch.equal(results[0]["weights"], results[1]["weights"])
    first = results[0]["grads"][0]
    assert not torch.equal(first, base["grads"][0])  # the hook really ran: fp16 rounding is visible
    torch.testing.assert_close(first, base["grads"][0], rtol=2e-3, atol=2e-3 * first.abs().max().item())
    assert all("comm_hook='bf16' needs the NCCL backend" in m for m in dist2.run(bf16_hook_error))
    results = dist2.run(train_ddp, DDPOptions(comm_hook="powersgd", powersgd_rank=1, powersgd_start_iter=2), steps=8)
    for step in range(2):  # warm-up iterations use the exact all-reduce
        torch.testing.assert_close(results[0]["grads"][step], base["grads"][step], rtol=1e-6, atol=1e-7)
    assert torch.equal(results[0]["weights"], results[1]["weights"])  # low-rank updates agree across ranks
    assert results[0]["losses"][-1] < results[0]["losses"][0]


def sync_bn_on_cpu() -> dict:
    import torch.distributed as dist

    meshes = build_mesh(Plan(dp=dist.get_world_size()), "cpu")
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = apply_ddp(model, meshes.dp, options=DDPOptions(sync_batchnorm=True))
    ddp(torch.randn(8, 4)).sum().backward()
    return {
        "warned": any("SyncBatchNorm" in str(w.message) for w in caught),
        "types": [type(m).__name__ for m in ddp.module],
    }


def test_sync_batchnorm_on_cpu_warns(dist2) -> None:
    for res in dist2.run(sync_bn_on_cpu):
        assert res["warned"] and res["types"] == ["Linear", "BatchNorm1d"]
