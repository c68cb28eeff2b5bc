"""A small Trainer run for the fault-tolerance tests and bench/ft_trials.py: an MLP on fixed random
data with ragged token masks (loss_reduction="tokens"), the plan from argv. Group rank 0 of each
replica group (plain run: rank 0) writes the final full weights, step and data position to
OUT/replica<r>.pt, and every committed step's line "STEP <replica> <step> <pid>" goes to stdout.
Each rank waits SLEEP_S seconds after its backward, before the step's gradient reduction, so that a
kill at a random moment most often finds the other groups waiting in their all-reduce. With
KILL=r:s, the first launch attempt of group r SIGKILLs its rank 0 mid-step, in the first step from
step s on whose quorum holds every group. With FT_FAST_WHEN_WHOLE=1 the steps stop waiting once
the groups are whole again after a loss (the kill is behind them; the rest of the run only has to
finish).

argv: OUT PLAN STEPS [SLEEP_S [KILL]]; FT_GLOBAL_BATCH (default 8), FT_CHECKPOINT (a checkpoint directory),
FT_FAST_WHEN_WHOLE.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

import shardwise
from shardwise.callback import Callback

VOCAB, SEQ, WIDTH = 11, 6, 16


class TokenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(x))))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)


class Report(Callback):
    def __init__(self, sleep_s: float, kill: str) -> None:
        self.sleep_s, self.kill = sleep_s, kill
        self.fast_when_whole = os.environ.get("FT_FAST_WHEN_WHOLE") == "1"

    def on_after_backward(self, trainer) -> None:  # type: ignore[no-untyped-def]
        env = trainer.env
        if not (self.fast_when_whole and whole_again(env)):
            time.sleep(self.sleep_s)
        replica, _, step = self.kill.partition(":")
        if (
            replica == str(env.replica)
            and trainer.state.step + 1 >= int(step)
            and env.rank == 0
            and env.settings.restart_count == 0
            and every_group_live(env)
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, trainer, metrics=None) -> None:  # type: ignore[no-untyped-def]
        if trainer.env.rank == 0:
            print(f"STEP {trainer.env.replica} {trainer.state.step} {os.getpid()}", flush=True)


def quorums(env) -> list[dict]:  # type: ignore[no-untyped-def]
    """This group's quorums so far (its events file)."""
    path = os.path.join(env.settings.ft.events_dir, f"replica{env.replica}.jsonl")
    return [json.loads(line) for line in open(path) if '"quorum"' in line] if os.path.exists(path) else []


def every_group_live(env) -> bool:  # type: ignore[no-untyped-def]
    """Whether this group's last quorum held every group: then the others are in this step too,
    waiting in its gradient all-reduce."""
    seen = quorums(env)
    return bool(seen) and len(seen[-1]["members"]) == env.replicas


def whole_again(env) -> bool:  # type: ignore[no-untyped-def]
    """Whether every group is back after a loss: this group's last quorum holds every group, and
    this group was restarted or one of its quorums lost a group."""
    seen = quorums(env)
    return (
        bool(seen)
        and len(seen[-1]["members"]) == env.replicas
        and (env.settings.restart_count > 0 or any(q.get("left") for q in seen))
    )


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (256, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (256, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (256,), generator=g)  # ragged: a padded tail at -100
    y[torch.arange(SEQ)[None, :] >= lengths[:, None]] = -100
    return TensorDataset(x, y)


def main() -> None:
    out, plan, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sleep_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    kill = sys.argv[5] if len(sys.argv) > 5 else ""
    torch.manual_seed(0)
    model = TokenMLP()
    trainer = shardwise.Trainer(
        model,
        loss_fn=loss_fn,
        global_batch_size=int(os.environ.get("FT_GLOBAL_BATCH", "8")),
        plan=plan,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        train=shardwise.TrainOptions(
            max_steps=steps,
            seed=0,
            loss_reduction="tokens",
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        ),
        logging=shardwise.LoggingOptions(log_every=1, progress_bar=False),
        callbacks=[Report(sleep_s, kill)],
        checkpoint=os.environ.get("FT_CHECKPOINT") or None,
    )
    result = trainer.fit(data())
    weights = get_model_state_dict(
        trainer.model.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if trainer.env.rank == 0:
        os.makedirs(out, exist_ok=True)
        torch.save(
            {
                "weights": weights,
                "step": trainer.state.step,
                "position": trainer.state.sampler.state_dict(),
                "lr": trainer.optimizer.param_groups[0]["lr"],
                "losses": [row["loss"] for row in result.history if "loss" in row],
                "optimizer": {k: v for k, v in trainer.optimizer.state_dict()["state"].items()}
                if plan == "dp"
                else None,
            },
            os.path.join(out, f"replica{trainer.env.replica}.pt"),
        )


if __name__ == "__main__":
    main()
