"""The Trainer job of the node-loss test: a small MLP, a fixed global batch, checkpoints every few
steps, one ``LOSS`` line per step from rank 0 (and an optional pause per step, so that a test can
kill a node mid-run). Run under ``shardwise run --nnodes 1:2 ...`` or as one plain process."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import shardwise
from shardwise.checkpoint import CheckpointManager
from shardwise.models.mlp import SimpleNet
from shardwise.train import Callback, Trainer


class PrintLoss(Callback):
    """Rank 0 prints each step's loss; every rank pauses ``delay_s`` per step. With ``hold``
    (step, world size), the ranks of a world of that size wait at that step until the elastic agent
    stops them with SIGTERM (a node joined) or 120 s pass, so a regrow test does not race the end."""

    def __init__(self, delay_s: float, hold: tuple[int, int] | None) -> None:
        self.delay_s, self.hold = delay_s, hold

    def on_step_end(self, trainer, metrics) -> None:
        if trainer.env.is_main:
            print(f"LOSS step={metrics['step']} world={trainer.env.world_size} plan={trainer.plan} loss={metrics['loss']:.9e}",
                  flush=True)
        time.sleep(self.delay_s)
        if self.hold == (trainer.step, trainer.env.world_size):
            if trainer.env.is_main:
                print(f"HOLD step={trainer.step} world={trainer.env.world_size}", flush=True)
            deadline = time.monotonic() + 120
            while not trainer.checkpoint.signal.requested and time.monotonic() < deadline:
                time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", default="dp=2,tp=2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--hold-at", default=None, metavar="STEP:WORLD", help="wait at STEP in a world of WORLD processes for SIGTERM")
    p.add_argument("--dir", required=True)
    args = p.parse_args()
    shardwise.init()  # before the CheckpointManager, which takes its rank from the process group
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    trainer = Trainer(
        SimpleNet(16, 32, 4, dropout=0.0, seed=1),
        loss_fn=F.cross_entropy,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        plan=args.plan,
        global_batch_size=8,
        max_steps=args.steps,
        log_every=1,
        seed=3,
        progress_bar=False,
        callbacks=[PrintLoss(args.step_delay, tuple(map(int, args.hold_at.split(":"))) if args.hold_at else None)],
        checkpoint=CheckpointManager(args.dir, every_n_steps=args.save_every, keep_last_n=3),
    )
    trainer.fit(TensorDataset(x, y))
    shardwise.shutdown()


if __name__ == "__main__":
    main()
