"""Job set-up shared by :class:`~shardwise.train.Trainer` and :func:`~shardwise.train.prepare`:
which plan, and which seeds."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import ConfigError
from shardwise.plan.plan import Plan
from shardwise.runtime.env import RuntimeEnv


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


def auto_plan(model: nn.Module, env: RuntimeEnv, *, global_batch_size: int, precision: str | None, pipeline: bool) -> Plan:
    """``plan="auto"``: the planner's fastest plan for ``model`` on this world that the parallel
    layer accepts (:func:`shardwise.plan.planner.plan_for_trainer`).

    Rank 0 plans and broadcasts the result (one ``broadcast_object_list`` over the world), so every
    rank applies the same plan even if device names or free memory differ slightly between hosts.
    """
    chosen: list[Plan | str | None] = [None]
    if env.rank == 0:
        from shardwise.plan.planner import plan_for_trainer

        cuda = env.device.type == "cuda"
        try:
            chosen[0] = plan_for_trainer(
                model,
                world_size=env.world_size,
                global_batch=global_batch_size,
                precision=precision or "fp32",
                device_type=env.device.type,
                device_name=torch.cuda.get_device_name(env.device) if cuda else "",
                memory_bytes=float(torch.cuda.get_device_properties(env.device).total_memory) if cuda else None,
                pipeline=pipeline,
            ).plan
        except ConfigError as exc:  # sent to the other ranks too, so that none waits in the broadcast
            chosen[0] = str(exc)
    if dist.is_initialized() and env.world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    if not isinstance(chosen[0], Plan):
        raise ConfigError(f"plan='auto' found no plan: {chosen[0]}", hint="pass an explicit plan, e.g. plan='dp' or plan='zero=3,dp=N'")
    return chosen[0]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
