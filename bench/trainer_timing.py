"""Time ``shardwise.Trainer`` itself on the built-in GPT (``plan`` may be ``"auto"``), for
bench/planner_validation.py: the planner's predicted step time against the Trainer's own loop.
(It lived in ``shardwise.calibrate.measure``; it is a benchmark's helper, and the calibration sits
below the Trainer.)"""

from __future__ import annotations

import statistics
import warnings
from typing import Any

from shardwise.errors import ShardwiseError


def measure_trainer_worker(plan_text: str, config: dict[str, Any], *, global_batch: int, steps: int = 3,
                           warmup: int = 2, lr: float = 1e-3, cluster: str | None = None) -> dict[str, Any]:
    """Train the built-in GPT with :class:`shardwise.Trainer` itself (``plan_text`` may be ``"auto"``)
    and return the step times of its own loop, as the Trainer logs them.

    Unlike :func:`measure_plan_worker` this goes through everything a user's run does: the
    planner call of ``plan="auto"`` (rank 0 plans, then broadcasts), the Trainer's data loader,
    its micro-step loop, its loss all-reduce each logging step (``log_every=1``, which also
    synchronizes the ranks so a logged step time is the slowest rank's) and Adam. ``cluster`` is a
    preset name or spec file for the planner (``Trainer(parallel=ParallelOptions(cluster=...))``); None: this
    machine, measured. Returns the chosen plan, the median of the timed steps (slowest rank) and all of them.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.train.trainer import Trainer
    from shardwise.train.options import DataOptions, LoggingOptions, ParallelOptions, TrainOptions

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    cfg = GPTConfig(**config)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))

    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, cfg.vocab_size, ((warmup + steps) * global_batch, cfg.seq_len + 1), generator=gen)
    data = TensorDataset(ids[:, :-1], ids[:, 1:])
    try:
        trainer = Trainer(GPT(cfg, seed=0), loss_fn=loss_fn, global_batch_size=global_batch, plan=plan_text,
                          optimizer=lambda params: torch.optim.Adam(params, lr=lr),
                          train=TrainOptions(max_steps=warmup + steps), data=DataOptions(shuffle=False),
                          parallel=ParallelOptions(cluster=cluster),
                          logging=LoggingOptions(log_every=1, progress_bar=False))
        result = trainer.fit(data)
    except (ShardwiseError, NotImplementedError, RuntimeError, ValueError) as exc:
        return {"plan": plan_text, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    times = [row["step_time_s"] for row in result.history if "step_time_s" in row][warmup:]
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"plan": plan_text, "chosen": str(trainer.plan), "step_time_s": float(t.item()), "times": times}
