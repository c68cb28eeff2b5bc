"""The Trainer job of the node-loss test: a small MLP, a fixed global batch, checkpoints every few
steps, one ``LOSS`` line per step from rank 0 (and a ``WORKER pid=N`` line from every rank), and
optional holds where a test can kill or add a node mid-step. Run under ``shardwise run --nnodes 1:2
...`` or as one plain process."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import shardwise
from shardwise.checkpoint import CheckpointManager
from shardwise.models.mlp import SimpleNet
from shardwise.train import Callback, LoggingOptions, TrainOptions, Trainer


class PrintLoss(Callback):
    """Rank 0 prints each step's loss. ``holds``: (steps done, world size) pairs at which every rank
    waits inside the next step, after its backward: in a loop that asks all ranks whether a SIGTERM
    arrived (the elastic agent stopping them because a node joined), so the ranks leave together,
    finish the step and save at its end; or until a collective of the loop fails (a node was
    killed). Tests act on the ``HOLD`` line instead of racing a running job."""

    def __init__(self, holds: list[tuple[int, int]], step_sleep_s: float = 0.0) -> None:
        self.holds, self.step_sleep_s = holds, step_sleep_s

    def on_step_end(self, trainer, metrics) -> None:
        if trainer.env.is_main:
            print(
                f"LOSS step={metrics['step']} world={trainer.env.world_size} plan={trainer.plan} "
                f"loss={metrics['loss']:.9e}",
                flush=True,
            )
        time.sleep(self.step_sleep_s)  # a longer job, for trials that strike at random moments

    def on_after_backward(self, trainer) -> None:
        if (trainer.step, trainer.env.world_size) not in self.holds:
            return
        if trainer.env.is_main:
            print(f"HOLD step={trainer.step} world={trainer.env.world_size}", flush=True)
        deadline = time.monotonic() + 120
        while not trainer.checkpoint.manager.agree(trainer.checkpoint.signal.requested) and time.monotonic() < deadline:
            time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", default="dp=2,tp=2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--hold-at", action="append", default=[], metavar="STEP:WORLD",
                   help="after STEP steps in a world of WORLD processes, wait (see PrintLoss)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds every rank sleeps after each step")
    p.add_argument("--dir", required=True)
    args = p.parse_args()
    shardwise.init()  # before the CheckpointManager, which takes its rank from the process group
    print(f"WORKER pid={os.getpid()}", flush=True)  # a forked worker is not below its agent: the test tracks it
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    trainer = Trainer(SimpleNet(16, 32, 4, dropout=0.0, seed=1), loss_fn=F.cross_entropy,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2), plan=args.plan, global_batch_size=8,
                      train=TrainOptions(max_steps=args.steps, seed=3),
                      logging=LoggingOptions(log_every=1, progress_bar=False),
                      callbacks=[PrintLoss([tuple(map(int, h.split(":"))) for h in args.hold_at], args.step_sleep)],
                      checkpoint=CheckpointManager(args.dir, every_n_steps=args.save_every, keep_last_n=3))
    trainer.fit(TensorDataset(x, y))
    shardwise.shutdown()


if __name__ == "__main__":
    main()
