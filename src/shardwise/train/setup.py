"""Job set-up shared by :class:`~shardwise.train.Trainer` and :func:`~shardwise.train.prepare`:
which plan, and which seeds."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import torch

from shardwise.errors import ConfigError
from shardwise.plan.plan import Plan


def resolve_plan(plan: Plan | str, world_size: int, *, precision: str | None = None) -> Plan:
    """``"dp"`` -> all processes data parallel; a string is parsed; the result must fit the world.

    ``precision`` (the Trainer's) is written into the plan, so FSDP's mixed-precision policy and the
    printed plan agree with the autocast the loop uses; it may not contradict a plan that sets one.
    """
    if isinstance(plan, str):
        plan = Plan(dp=world_size) if plan.strip().lower() in ("dp", "ddp") else Plan.parse(plan)
    if not isinstance(plan, Plan):
        raise ConfigError(f"plan must be a Plan or a string, got {type(plan).__name__}", hint='for example plan="dp" or plan="dp=2,tp=2"')
    if precision is not None and precision != plan.precision:
        if plan.precision != "fp32":
            raise ConfigError(
                f"precision={precision!r} contradicts the plan's precision={plan.precision}",
                hint="set the precision in one place (the plan or the Trainer)",
            )
        plan = replace(plan, precision=precision)  # validated by Plan.__post_init__
    return plan.check_world(world_size)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
