"""The checkpoint callback inside the real Trainer: ``Trainer(checkpoint=...)``, ``fit(resume="auto")``.

For each plan the Trainer can run on 2 processes, 12 steps straight must equal (bitwise: model
weights and optimizer momentum, gathered to full tensors) 7 steps with an async save every 3 steps
and one at the end of fit, then a fresh Trainer with a differently seeded model resuming the newest
complete checkpoint and training to step 12. 7 is past the last periodic save (6), so the end-of-
fit save is what the resume must find.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from shardwise.checkpoint import CheckpointManager
from shardwise.train import LoggingOptions, TrainOptions, Trainer, warmup_cosine
from tests.helpers import make_data, sgd

TOTAL, STOP = 12, 7


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 3))


def fit_with_checkpoint(plan: str, directory: str, max_steps: int, resume: str | None, model_seed: int) -> dict:
    manager = CheckpointManager(directory, every_n_steps=3, async_save=True, keep_last_n=2)
    trainer = Trainer(_model(model_seed), loss_fn=F.cross_entropy, optimizer=sgd, plan=plan, global_batch_size=32,
                      train=TrainOptions(lr_scheduler=warmup_cosine(warmup_steps=3, total_steps=TOTAL),
                                         max_steps=max_steps, seed=7),
                      logging=LoggingOptions(log_every=1, progress_bar=False), checkpoint=manager)
    trainer.fit(make_data(), resume=resume)
    msd, osd = get_state_dict(trainer.model.module, [trainer.optimizer], options=StateDictOptions(full_state_dict=True))
    full = {f"model.{k}": v.clone() for k, v in msd.items()}
    full.update(
        {
            f"optim.{fqn}.{key}": v.clone()
            for fqn, st in osd["state"].items()
            for key, v in st.items()
            if isinstance(v, torch.Tensor)
        }
    )
    loaded = trainer.checkpoint.loaded
    return {"state": full, "step": trainer.step, "resumed_from": loaded.step if loaded else None}


@pytest.mark.parametrize("plan", ["dp=2", "zero=3,dp=2", "tp=2", "pp=2,schedule=gpipe,microbatches=2"])
def test_trainer_resume_auto_is_bitwise(dist2, tmp_path_factory, plan):
    straight_dir, cut_dir = (str(tmp_path_factory.mktemp(n)) for n in ("straight", "cut"))
    straight = dist2.run(fit_with_checkpoint, plan, straight_dir, TOTAL, None, 0)
    first = dist2.run(fit_with_checkpoint, plan, cut_dir, STOP, "auto", 0)
    assert all(r["resumed_from"] is None and r["step"] == STOP for r in first)
    resumed = dist2.run(fit_with_checkpoint, plan, cut_dir, TOTAL, "auto", 99)
    for s, r in zip(straight, resumed):
        assert r["resumed_from"] == STOP and r["step"] == TOTAL
        assert s["state"].keys() == r["state"].keys() and s["state"]
        for key in s["state"]:
            assert torch.equal(s["state"][key], r["state"][key]), key
