"""Checkpoints reshard across pipeline layouts, through the real Trainer.

One run of a tiny 4-block GPT (SGD with momentum, warmup-cosine LR, fp32; not Adam, which turns the float noise on
the zero gradient of an attention key bias into steps of full size) is cut into legs, each on another
layout, each resuming the previous leg's checkpoint and training 3 more steps:
``pp=2`` (1F1B) -> one process -> ``pp=4`` (GPipe) -> ``dp=2`` -> ``pp=2`` (interleaved 1F1B, two
virtual stages per rank, explicit split points) -> ``tp=2``. The epoch (8 steps) ends inside the
``pp=4`` leg. The legs' per-step losses equal the uninterrupted one-process run's (the same
samples in the same order: the data position carried over every change of layout) and the
consolidated weights of the last checkpoint equal that run's at rtol 1e-5 (atol 1e-6 for values
near zero).

Then the last checkpoint is loaded under several layouts and saved again by each, unchanged:
the consolidated safetensors of those copies are byte-identical, whichever layout wrote them.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from shardwise.checkpoint import CheckpointManager
from shardwise.checkpoint.consolidate import consolidate
from shardwise.train import Callback, warmup_cosine

LEG_STEPS = 3
LEGS = [  # (processes, plan, split points)
    (2, "pp=2,schedule=1f1b,microbatches=2", None),
    (1, "dp", None),
    (4, "pp=4,schedule=gpipe,microbatches=4", None),
    (2, "dp=2", None),
    (2, "pp=2,schedule=interleaved_1f1b,virtual_stages=2,microbatches=4", (1, 2, 3)),
    (2, "tp=2", None),
]
TOTAL = LEG_STEPS * len(LEGS)


def _data() -> TensorDataset:
    # counting sequences from random starts (learnable in a few steps), with some noise
    g = torch.Generator().manual_seed(0)
    tokens = (torch.randint(0, 16, (64, 1), generator=g) + torch.arange(9)) % 16
    tokens = torch.where(torch.rand(64, 9, generator=g) < 0.1, torch.randint(0, 16, (64, 9), generator=g), tokens)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_step_end(self, trainer, metrics) -> None:
        self.losses.append(metrics["loss"])


def _gpt(seed: int) -> torch.nn.Module:
    from shardwise.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=16, seq_len=8, layers=4, hidden=16, heads=2), seed=seed)


def _trainer(
    plan: str, directory: str, max_steps: int, *, model_seed: int, split: tuple[int, ...] | None, callbacks=()
):
    from shardwise.parallel.pipeline import PipelineOptions
    from shardwise.train import LoggingOptions, ParallelOptions, TrainOptions, Trainer

    return Trainer(_gpt(model_seed), loss_fn=_lm_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
                   plan=plan, global_batch_size=8,
                   train=TrainOptions(lr_scheduler=warmup_cosine(warmup_steps=4, total_steps=TOTAL),
                                      max_steps=max_steps, seed=7),
                   parallel=ParallelOptions(pipeline=PipelineOptions(split_points=split) if split else None),
                   logging=LoggingOptions(log_every=1, progress_bar=False), callbacks=list(callbacks),
                   checkpoint=CheckpointManager(directory, keep_last_n=None))


def leg(plan: str, directory: str, max_steps: int, split: tuple[int, ...] | None, model_seed: int) -> dict:
    """Resume the newest checkpoint in ``directory`` (if any) under ``plan`` and train to ``max_steps``."""
    rec = _Losses()
    trainer = _trainer(plan, directory, max_steps, model_seed=model_seed, split=split, callbacks=[rec])
    trainer.fit(_data(), resume="auto")
    loaded = trainer.checkpoint.loaded
    return {"losses": rec.losses, "step": trainer.step, "resumed_from": loaded.step if loaded else None}


def resave(plan: str, source: str, target: str, step: int) -> int:
    """Load ``source``'s step ``step`` under ``plan`` and save it, unchanged, into ``target``."""
    trainer = _trainer(plan, source, step, model_seed=99, split=None)
    trainer.fit(_data(), resume=step)  # restores, then has no step left to take
    CheckpointManager(target).save(trainer.stateful_components(), step=step)
    return trainer.step


def test_pp2_to_one_to_pp4_to_dp2_to_interleaved_to_tp2_equals_one_run(pools, tmp_path) -> None:
    chain, straight = str(tmp_path / "chain"), str(tmp_path / "straight")
    ref = pools(1).run(leg, "dp", straight, TOTAL, None, 0)[0]
    assert ref["losses"][-1] < 0.7 * ref["losses"][0]  # it trains
    losses: list[float] = []
    for k, (nprocs, plan, split) in enumerate(LEGS):
        # every leg after the first starts from a model seeded differently: only the checkpoint carries over
        results = pools(nprocs).run(leg, plan, chain, LEG_STEPS * (k + 1), split, k)
        for got in results:
            assert got["step"] == LEG_STEPS * (k + 1) and got["resumed_from"] == (LEG_STEPS * k if k else None), (
                plan,
                got,
            )
            assert got["losses"] == results[0]["losses"]
        losses.extend(results[0]["losses"])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)

    consolidate(chain, str(tmp_path / "chain.safetensors"))
    consolidate(straight, str(tmp_path / "straight.safetensors"))
    got, want = load_file(str(tmp_path / "chain.safetensors")), load_file(str(tmp_path / "straight.safetensors"))
    assert got.keys() == want.keys() == set(_gpt(0).state_dict())
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)

    # the same state, written by four layouts: one consolidated file, byte for byte
    blobs = {}
    for nprocs, plan in [(1, "dp"), (2, "pp=2"), (2, "tp=2"), (4, "dp=2,pp=2,schedule=gpipe")]:
        target = str(tmp_path / f"copy-{plan.replace(',', '_').replace('=', '')}")
        assert pools(nprocs).run(resave, plan, chain, target, TOTAL) == [TOTAL] * nprocs
        out = target + ".safetensors"
        consolidate(target, out)
        with open(out, "rb") as f:
            blobs[plan] = f.read()
    assert all(blob == blobs["dp"] for blob in blobs.values()), [p for p, b in blobs.items() if b != blobs["dp"]]
    assert os.path.getsize(str(tmp_path / "chain.safetensors")) == len(blobs["dp"])
