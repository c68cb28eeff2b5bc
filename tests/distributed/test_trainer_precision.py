"""Mixed precision in the Trainer: the fp16 loss scaler decides inf/nan steps for the whole world.

An inf is written into one rank's gradients *after* DDP's all-reduce (``on_after_backward``), so
only that rank sees it locally; the world-wide MAX of the found-inf flag must still make every rank
skip the step, keep identical weights and back off the scale.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from shardwise.train import Callback, LoggingOptions, LossScaler, PrecisionOptions, TrainOptions, Trainer
from tests.helpers import Record, make_data, make_model, run_fit, sgd

INJECT_AT = 3  # the 3rd optimizer step


class InjectInf(Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_after_backward(self, trainer) -> None:
        if trainer.step + 1 == INJECT_AT and trainer.env.rank == self.rank:
            next(iter(trainer.model.parameters())).grad.view(-1)[0] = float("inf")


class Snapshot(Callback):
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_step_end(self, trainer, metrics) -> None:
        flat = torch.cat([v.detach().flatten().float() for v in get_model_state_dict(trainer.model.module).values()])
        self.rows.append({"scale": metrics["loss_scale"], "skipped": metrics["skipped"], "weights": flat.clone()})


def run_fp16(inject_rank: int) -> dict:
    snap = Snapshot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(make_model(), loss_fn=F.cross_entropy, optimizer=sgd, global_batch_size=32,
                          precision=PrecisionOptions("fp16",
                                                     loss_scaler=LossScaler(init_scale=2.0**10, growth_interval=3)),
                          train=TrainOptions(max_steps=6), logging=LoggingOptions(log_every=1, progress_bar=False),
                          callbacks=[InjectInf(inject_rank), snap])
    trainer.fit(make_data())
    return {
        "rows": snap.rows,
        "warned": any("fp16" in str(w.message) and "CPU" in str(w.message) for w in caught),
        "skipped": trainer.scaler.skipped_steps,
    }


def run_bf16() -> dict:
    rec = Record()
    trainer = Trainer(make_model(), loss_fn=F.cross_entropy, optimizer=sgd, precision="bf16", global_batch_size=32,
                      train=TrainOptions(max_steps=20, seed=7), logging=LoggingOptions(log_every=1, progress_bar=False),
                      callbacks=[rec])
    trainer.fit(make_data())
    return {"losses": rec.losses}


def test_inf_on_one_rank_skips_the_step_on_every_rank(pools) -> None:
    results = pools(2).run(run_fp16, 1)
    for res in results:
        assert res["warned"], "fp16 on a CPU must warn"
        assert [r["skipped"] for r in res["rows"]] == [False, False, True, False, False, False]
        assert [r["scale"] for r in res["rows"]] == [
            1024.0,
            1024.0,
            512.0,
            512.0,
            512.0,
            1024.0,
        ]  # back off, regrow after 3
        assert res["skipped"] == 1
        rows = res["rows"]
        assert torch.equal(rows[2]["weights"], rows[1]["weights"])  # the skipped step changed nothing
        assert not torch.equal(rows[3]["weights"], rows[2]["weights"])
    for a, b in zip(results[0]["rows"], results[1]["rows"]):
        assert torch.equal(a["weights"], b["weights"])  # replicas never diverge


def test_bf16_tracks_fp32(pools) -> None:
    """bf16 autocast keeps fp32 master weights: the loss curve stays within bf16 rounding of fp32."""
    fp32 = pools(2).run(run_fit)[0]["losses"]
    bf16 = pools(2).run(run_bf16)[0]["losses"]
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=3e-2, atol=1e-2)
    assert bf16 != fp32  # autocast really ran in bf16
