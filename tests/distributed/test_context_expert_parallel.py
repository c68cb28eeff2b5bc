"""Context parallel and expert parallel against one process (same seed, same global batch, fp32,
SGD with momentum, rtol 1e-5), their memory, and the bad input each refuses.

The runs of one world size share one ``parity_worker`` call (one reference run, one pool)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.verify.parity import GPTWorkload, Run, Training, parity_worker

DENSE = GPTWorkload(GPTConfig(vocab_size=64, seq_len=16, layers=2, hidden=32, heads=4))
MOE = GPTWorkload(GPTConfig(vocab_size=64, seq_len=16, layers=2, hidden=32, heads=4, experts=4, top_k=2))
TRAINING = Training(steps=4, global_batch=8)  # same rtol as at 10 steps; steps 2-4 use the momentum buffers


def _passed(reports) -> None:
    for report in reports:
        assert report.passed(1e-5), report.format(1e-5)


def test_cp_and_ep_on_2(dist2) -> None:
    per_rank = dist2.run(parity_worker, DENSE, [Run("cp=2"), Run("cp=2,recompute=full")], TRAINING)
    _passed(per_rank[0])
    # ep borrows the data-parallel ranks: dp=2,ep=2 splits the 4 experts 2 + 2
    per_rank = dist2.run(parity_worker, MOE, [Run("dp=2,ep=2"), Run("zero=3,shard=2,ep=2")], TRAINING)
    _passed(per_rank[0])


def test_cp_and_ep_compositions_on_4(dist4) -> None:
    dense = [Run("dp=2,cp=2"), Run("cp=2,tp=2"), Run("zero=3,shard=2,cp=2"), Run("cp=2,pp=2")]
    _passed(dist4.run(parity_worker, DENSE, dense, TRAINING)[0])
    moe = [Run("dp=2,pp=2,ep=2"), Run("dp=2,tp=2,ep=2"), Run("zero=3,shard=4,ep=2")]
    _passed(dist4.run(parity_worker, MOE, moe, TRAINING)[0])


def expert_bytes(plan_text: str) -> dict[str, int]:
    from shardwise.layout import Plan
    from shardwise.parallel.ep import expert_modules
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize

    plan = Plan.parse(plan_text)
    pm = parallelize(MOE.build(0), plan, build_mesh(plan, "cpu"))
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for _, m in expert_modules(pm.module) for p in m.parameters())
    full = sum(p.numel() for _, m in expert_modules(MOE.build(0)) for p in m.parameters())
    return {"local": local, "full": full}


def test_each_rank_keeps_half_of_the_experts_at_ep2(dist2) -> None:
    for got in dist2.run(expert_bytes, "dp=2,ep=2"):
        assert got["local"] * 2 == got["full"]


def saved_activation_bytes(cp: int, seq: int) -> float:
    """Bytes autograd keeps for backward in one forward of a long sequence, on this rank (each
    storage once: a tensor saved by several layers, or as several views, is held once)."""
    from shardwise.layout import Plan
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize

    shape = GPTConfig(vocab_size=64, seq_len=seq, layers=2, hidden=64, heads=4)
    plan = Plan(cp=cp) if cp > 1 else Plan(dp=2)
    pm = parallelize(GPT(shape, seed=0), plan, build_mesh(plan, "cpu"))
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(0))
    inputs, _, extra = pm.shard_batch(ids, ids)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), pm.step_context():
        pm.module(inputs, **extra).sum().backward()
    return float(sum(saved.values()))


def test_cp2_keeps_at_most_six_tenths_of_the_activations(dist2) -> None:
    one = dist2.run(saved_activation_bytes, 1, 512)[0]
    two = max(dist2.run(saved_activation_bytes, 2, 512))
    assert two <= 0.6 * one, (two, one)


class _TorchAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.attn(x, x, x)[0]


class _NoPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_bad_input_names_the_fix() -> None:
    from shardwise.layout import Plan
    from shardwise.parallel.cp import check_context_parallel
    from shardwise.parallel.ep import check_expert_parallel

    with pytest.raises(ConfigError, match=r"cp=3 needs a sequence length that is a multiple of 2\*cp=6"):
        check_context_parallel(DENSE.build(0), 3)
    with pytest.raises(ConfigError, match="MultiheadAttention.*cannot split"):
        check_context_parallel(_TorchAttention(), 2)
    with pytest.raises(ConfigError, match="takes no position_ids"):
        check_context_parallel(_NoPositions(), 2)
    with pytest.raises(ConfigError, match="ep=3 does not divide the 4 experts"):
        check_expert_parallel(MOE.build(0), 3)
    with pytest.raises(ConfigError, match="has no MoE layers"):
        check_expert_parallel(DENSE.build(0), 2)
    with pytest.raises(ConfigError, match="ep=2 does not divide dp=1"):
        Plan(ep=2)
    assert Plan.parse("ep=2", world_size=2) == Plan(dp=2, ep=2)  # ep borrows the data-parallel ranks
    assert Plan.parse("cp=2", world_size=4) == Plan(dp=2, cp=2)


def forward_without_attention() -> str:
    from shardwise.layout import Plan
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)

        def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
            return self.emb(ids)

    plan = Plan(cp=2)
    pm = parallelize(Plain(), plan, build_mesh(plan, "cpu"))
    inputs, _, extra = pm.shard_batch(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    try:
        with pm.step_context():
            pm.module(inputs, **extra)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_model_whose_attention_cp_cannot_see_is_refused_after_its_first_forward(dist2) -> None:
    for message in dist2.run(forward_without_attention):
        assert "called no scaled_dot_product_attention" in message


def test_zigzag_chunks_cover_the_sequence_once_with_equal_causal_work() -> None:
    from shardwise.parallel.cp import zigzag_positions

    for cp in (1, 2, 4):
        chunks = [zigzag_positions(32, cp, r) for r in range(cp)]
        assert sorted(torch.cat(chunks).tolist()) == list(range(32))
        work = [int((c + 1).sum()) for c in chunks]  # keys each query attends to under the causal mask
        assert len(set(work)) == 1, work


def trainer_run(plan: str, shape: dict, directory: str | None, stops: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Train the GPT of ``shape`` with the Trainer through ``stops`` (a fit per stop, resuming from
    ``directory``); returns the final full weights."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.utils.data import TensorDataset

    from shardwise.train import DataOptions, LoggingOptions, TrainOptions, Trainer

    cfg = GPTConfig(**shape)
    ids = torch.randint(0, cfg.vocab_size, (64, cfg.seq_len + 1), generator=torch.Generator().manual_seed(3))
    data = TensorDataset(ids[:, :-1], ids[:, 1:])
    trainer = None
    for stop in stops:
        trainer = Trainer(GPT(cfg, seed=0), loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()),
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), plan=plan, global_batch_size=8,
                          train=TrainOptions(max_steps=stop), data=DataOptions(shuffle=False),
                          logging=LoggingOptions(progress_bar=False), checkpoint=directory)
        trainer.fit(data, resume="auto" if directory else None)
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in trainer.model.module.named_parameters()
    }


@pytest.mark.parametrize(("plan", "shape"), [
    ("dp=2,ep=2", {**MOE.shape.to_dict()}),
    ("cp=2", {**DENSE.shape.to_dict()}),
])
def test_trainer_saves_and_resumes_cp_and_ep_exactly(dist2, tmp_path, plan, shape) -> None:
    """The Trainer runs cp and ep plans end to end; a checkpoint taken at step 3 and resumed gives
    the weights of a run that was never interrupted, bit for bit."""
    straight = dist2.run(trainer_run, plan, shape, None, (6,))[0]
    resumed = dist2.run(trainer_run, plan, shape, str(tmp_path / "ckpt"), (3, 6))[0]
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name
