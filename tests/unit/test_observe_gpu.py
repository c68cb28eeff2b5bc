"""CUDA paths of the observers (one process, one GPU): the step profiler and NaN guard on device
tensors, and the deep profiler's device-kernel view. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.observe.deep import DeepProfiler
from shardwise.observe.nan import NanGuard
from shardwise.observe.profiler import StepProfiler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()


def test_profiler_and_nan_guard_on_cuda() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = StepProfiler().attach(model, opt)
    guard = NanGuard(model, policy="warn").attach()
    for step in range(1, 4):
        x = torch.randn(32, 256, device="cuda")
        if step == 3:
            x[0, 0] = float("nan")
        loss = model(x).square().mean()
        loss.backward()
        finding = guard.local_finding(step, loss)
        opt.step()
        opt.zero_grad()
        prof.end_step(step)
    prof.detach()
    guard.detach()
    assert len(prof.records) == 3 and all(r.forward_s > 0 and r.backward_s > 0 for r in prof.records)
    assert finding is not None and finding.stage == "forward" and finding.module == "0"


def test_deep_profile_sees_cuda_kernels(tmp_path) -> None:
    model = _model()
    with DeepProfiler(tmp_path, skip=0, warmup=1, active=2) as deep:
        for _ in range(4):
            model(torch.randn(64, 256, device="cuda")).sum().backward()
            deep.step()
    torch.cuda.synchronize()
    assert deep.result is not None and (tmp_path / "trace_rank0.json").exists()
    assert "cuda" in deep.result.top_ops.lower() or "gemm" in deep.result.top_ops.lower()
