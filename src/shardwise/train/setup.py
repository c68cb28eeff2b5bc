"""Job set-up shared by :class:`~shardwise.train.Trainer` and :func:`~shardwise.train.prepare`:
which plan, and which seeds."""

from __future__ import annotations

import os
import random
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import ConfigError
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.plan import Plan
from shardwise.runtime.env import RuntimeEnv
from shardwise.runtime.logging import get_logger

if TYPE_CHECKING:
    from shardwise.plan.planner import AutoPlan

log = get_logger(__name__)


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


def auto_plan(model: nn.Module, env: RuntimeEnv, *, global_batch_size: int, precision: str | None,
              pipeline: bool) -> tuple[Plan, AutoPlan | None]:
    """``plan="auto"``: the planner's fastest plan for ``model`` on this world that the parallel
    layer accepts (:func:`shardwise.plan.planner.plan_for_trainer`), with this machine's measured
    spec (:func:`machine_spec`) unless ``SHARDWISE_CLUSTER`` names a preset or spec file.

    Rank 0 plans and broadcasts the result (one ``broadcast_object_list`` over the world), so every
    rank applies the same plan even if device names or free memory differ slightly between hosts.
    Returns the plan and, on rank 0, the planner's choice with its predictions (None elsewhere).
    """
    cluster = os.environ.get("SHARDWISE_CLUSTER") or machine_spec(env)
    chosen: list[Plan | str | None] = [None]
    choice = None
    if env.rank == 0:
        from shardwise.plan.planner import plan_for_trainer

        cuda = env.device.type == "cuda"
        try:
            choice = plan_for_trainer(
                model,
                world_size=env.world_size,
                global_batch=global_batch_size,
                precision=precision or "fp32",
                device_type=env.device.type,
                device_name=torch.cuda.get_device_name(env.device) if cuda else "",
                memory_bytes=float(torch.cuda.get_device_properties(env.device).total_memory) if cuda else None,
                cluster=cluster,
                pipeline=pipeline,
            )
            chosen[0] = choice.plan
        except ConfigError as exc:  # sent to the other ranks too, so that none waits in the broadcast
            chosen[0] = str(exc)
    if dist.is_initialized() and env.world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    if not isinstance(chosen[0], Plan):
        raise ConfigError(f"plan='auto' found no plan: {chosen[0]}", hint="pass an explicit plan, e.g. plan='dp' or plan='zero=3,dp=N'")
    return chosen[0], choice


def choose_plan(plan: Plan | str, model: nn.Module, env: RuntimeEnv, *, global_batch_size: int, precision: str | None,
                grad_accum_steps: int) -> tuple[Plan | str, AutoPlan | None]:
    """``plan`` unchanged, or for ``"auto"`` the planner's plan (logged with its prediction on rank 0)
    and the planner's choice. Pipelines split each micro-batch again into microbatches, so they are
    considered only without gradient accumulation."""
    if not (isinstance(plan, str) and plan.strip().lower() == "auto"):
        return plan, None
    chosen, choice = auto_plan(model, env, global_batch_size=global_batch_size, precision=precision, pipeline=grad_accum_steps == 1)
    if choice is not None:
        log.info("plan=auto chose %s", choice.summary())
    return chosen, choice


def machine_spec(env: RuntimeEnv) -> ClusterSpec:
    """This world's measured cluster spec: the cached calibration of this job shape, or a new one
    measured now by every rank and cached by rank 0 (:mod:`shardwise.plan.machine`)."""
    from shardwise.plan.machine import cache_path, calibrate_world, load_cached, save_cached

    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else ""
    path = cache_path(world_size=env.world_size, device_type=env.device.type, threads=torch.get_num_threads(), device_name=name)
    found: list[ClusterSpec | None] = [load_cached(path) if env.rank == 0 else None]
    if dist.is_initialized() and env.world_size > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        if env.is_main:
            log.info("plan=auto: using this machine's calibration %s", path)
        return found[0]
    if env.is_main:
        log.info("plan=auto: measuring this machine once (%d processes, about a minute on a small CPU host); it is cached in %s",
                 env.world_size, path)
    spec = calibrate_world(local_world_size=env.local_world_size)
    if env.rank == 0:
        save_cached(spec, path)
    return spec


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
