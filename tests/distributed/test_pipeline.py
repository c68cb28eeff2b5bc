"""Pipeline parallel parity: GPipe, 1F1B and interleaved 1F1B on 2 and 4 Gloo processes, alone and
combined with data and tensor parallelism, against one process with the same seed and global batch.

Tolerance: per-step losses rtol 1e-5; final weights rtol 1e-5 with atol 1e-6 (biases start at zero,
where a relative tolerance alone is meaningless). The only numerical difference from one process
is the summation order (the batch mean becomes a mean of microbatch means), a few float32 ulps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.mesh import build_mesh
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.pipeline import PipelineOptions, stage_modules
from shardwise.layout import Plan

STEPS = 20
BATCH = 8  # global batch


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mse_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, targets)


def make_workload(kind: str):
    """(model, batch(step) -> (x, y), loss_fn) with fixed seeds."""
    if kind == "gpt":
        cfg = GPTConfig(vocab_size=32, seq_len=8, layers=4, hidden=16, heads=2)
        model = GPT(cfg, seed=0)

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(1000 + step)
            ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
            return ids, (ids * 3 + 1) % cfg.vocab_size  # learnable, so the loss falls

        return model, batch, gpt_loss
    if kind == "mlp":
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(7)], nn.Linear(16, 4))

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(2000 + step)
            return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)

        return model, batch, mse_loss
    raise ValueError(kind)


def run_parity(plan_text: str, kind: str, steps: int = STEPS, split_points: tuple | None = None) -> dict:
    """Train the pipelined model and a single-process copy side by side on this rank."""
    from shardwise.train.clip import clip_grad_norm_

    plan = Plan.parse(plan_text)
    meshes = build_mesh(plan, "cpu")
    model, batch, loss_fn = make_workload(kind)
    ref = copy.deepcopy(model)
    pm = parallelize(model, plan, meshes, loss_fn=loss_fn, pipeline=PipelineOptions(split_points=split_points))
    module, runner = pm.module, pm.pipeline
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    dp_rank, dp_size = meshes.dp.get_local_rank(), meshes.dp.size()
    local = BATCH // dp_size
    out: dict = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": []}
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = runner.step(x[dp_rank * local : (dp_rank + 1) * local], y[dp_rank * local : (dp_rank + 1) * local])
        if dp_size > 1:  # each data-parallel group reports the loss of its share of the batch
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=meshes.dp.get_group())
        # max_norm small enough that clipping is active: the norm must be global over the stages.
        norm = clip_grad_norm_(module.parameters(), 0.5, pp_group=meshes.pp.get_group())
        opt.step()
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        out["loss"].append(loss.item())
        out["ref_loss"].append(ref_loss.item())
        out["norm"].append(norm.item())
        out["ref_norm"].append(ref_norm.item())
    ref_params = dict(ref.named_parameters())
    out["weights"] = {}
    for stage in stage_modules(module):
        for name, p in stage.named_parameters():
            name = name.removeprefix("module.")  # DDP's wrapper
            value = p.full_tensor() if isinstance(p, DTensor) else p
            out["weights"][name] = (value.detach().clone(), ref_params[name].detach().clone())
    out["all_names"] = sorted(ref_params)
    return out


def check_parity(results: list[dict]) -> None:
    covered: set[str] = set()
    for rank, r in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(r["loss"]),
            torch.tensor(r["ref_loss"]),
            rtol=1e-5,
            atol=0,
            msg=lambda m: f"rank {rank} loss: {m}",
        )
        torch.testing.assert_close(
            torch.tensor(r["norm"]),
            torch.tensor(r["ref_norm"]),
            rtol=1e-5,
            atol=0,
            msg=lambda m: f"rank {rank} grad norm: {m}",
        )
        for name, (got, want) in r["weights"].items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
        covered |= set(r["weights"])
    assert covered == set(results[0]["all_names"]), "the stages must hold every parameter of the model"
    # the loss went down, so the test trains something
    assert results[0]["loss"][-1] < results[0]["loss"][0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "plan_text,kind",
    [
        ("pp=2,schedule=gpipe,microbatches=4", "gpt"),
        ("pp=2,schedule=1f1b,microbatches=4", "mlp"),
        ("pp=2,schedule=interleaved_1f1b,virtual_stages=2,microbatches=4", "gpt"),
    ],
)
def test_pp2_parity(dist2, plan_text: str, kind: str) -> None:
    check_parity(dist2.run(run_parity, plan_text, kind))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "plan_text,kind",
    [
        ("pp=4,schedule=gpipe,microbatches=4", "mlp"),
        ("pp=4,schedule=1f1b,microbatches=8", "gpt"),
    ],
)
def test_pp4_parity(dist4, plan_text: str, kind: str) -> None:
    check_parity(dist4.run(run_parity, plan_text, kind))


@pytest.mark.timeout(120)
def test_pp2_explicit_split_points(dist2) -> None:
    """An uneven user split (1 block + 3 blocks) trains identically too."""
    results = dist2.run(run_parity, "pp=2,schedule=1f1b,microbatches=2", "gpt", 5, ("blocks.1",))
    check_parity(results)
    assert sorted(n for n in results[0]["weights"] if n.startswith("blocks.")) == sorted(
        n for n in results[0]["all_names"] if n.startswith("blocks.0.")
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "plan_text", ["dp=2,pp=2,schedule=1f1b,microbatches=2", "zero=3,shard=2,pp=2,schedule=gpipe,microbatches=2"]
)
def test_dp2_pp2_parity(dist4, plan_text: str) -> None:
    check_parity(dist4.run(run_parity, plan_text, "gpt"))


@pytest.mark.timeout(120)
def test_tp2_pp2_parity(dist4) -> None:
    check_parity(dist4.run(run_parity, "tp=2,pp=2,schedule=1f1b,microbatches=2", "gpt"))


def meta_init_weights(plan_text: str, kind: str) -> dict:
    """Build on meta, parallelize with pp, materialize the local stages: values must equal the
    single-process construction with the same seed (GPT: init_weights; MLP: replayed resets)."""
    from shardwise.parallel.init import parallelize_on_meta

    plan = Plan.parse(plan_text)
    meshes = build_mesh(plan, "cpu")

    def factory() -> nn.Module:
        return make_workload(kind)[0] if kind == "gpt" else nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])

    pm = parallelize_on_meta(factory, plan, meshes, device="cpu", seed=0 if kind == "gpt" else 5, loss_fn=mse_loss)
    if kind == "gpt":
        ref = make_workload(kind)[0]
    else:
        torch.manual_seed(5)
        ref = factory()
    ref_params = dict(ref.named_parameters())
    out = {}
    for stage in stage_modules(pm.module):
        for name, p in stage.named_parameters():
            value = p.full_tensor() if isinstance(p, DTensor) else p
            out[name] = float((value - ref_params[name]).abs().max())
    return out


@pytest.mark.timeout(120)
def test_meta_init_of_pipeline_stages(dist2, dist4) -> None:
    for pool, plan_text, kind in (
        (dist2, "pp=2,schedule=interleaved_1f1b,virtual_stages=2,microbatches=2", "gpt"),
        (dist2, "pp=2,microbatches=2", "mlp"),
        (dist4, "tp=2,pp=2,microbatches=2", "gpt"),
    ):
        per_rank = pool.run(meta_init_weights, plan_text, kind)
        merged = {k: v for r in per_rank for k, v in r.items()}
        assert len(merged) == (len(list(make_workload("gpt")[0].parameters())) if kind == "gpt" else 8), plan_text
        assert max(merged.values()) == 0.0, (plan_text, {k: v for k, v in merged.items() if v})


def eval_and_shape_changes(plan_text: str) -> tuple[list[float], list[float]]:
    """Training steps and evaluations of several batch sizes, interleaved, against one process."""
    plan = Plan.parse(plan_text)
    meshes = build_mesh(plan, "cpu")
    model, batch, loss_fn = make_workload("gpt")
    ref = copy.deepcopy(model)
    pm = parallelize(model, plan, meshes, loss_fn=loss_fn)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    got, want = [], []
    for step, sizes in enumerate(((6, 1, 8), (3,), ())):
        x, y = batch(step)
        n = BATCH if step != 1 else BATCH // 2  # the training batch changes size too
        got.append(pm.pipeline.step(x[:n], y[:n]).item())
        ref_loss = loss_fn(ref(x[:n]), y[:n])
        ref_loss.backward()
        want.append(ref_loss.item())
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        with torch.no_grad():
            for m in sizes:  # uneven and tiny evaluation batches are fine: one microbatch
                got.append(pm.pipeline.eval_loss(x[:m], y[:m]).item())
                want.append(loss_fn(ref(x[:m]), y[:m]).item())
    return got, want


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "plan_text", ["pp=2,schedule=1f1b,microbatches=4", "pp=2,schedule=interleaved_1f1b,virtual_stages=2,microbatches=4"]
)
def test_eval_loss_and_changing_batch_sizes(dist2, plan_text: str) -> None:
    for got, want in dist2.run(eval_and_shape_changes, plan_text):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
