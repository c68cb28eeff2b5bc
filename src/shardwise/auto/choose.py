"""Choose: the planner's search for ``plan="auto"``, limited to the plans the Trainer runs.

The search itself is the torch-free planner (:func:`shardwise.plan.planner.auto_plan`); here it
sees only the plans that this model, loss and optimizer run exactly (:func:`plan_for_trainer`:
checked with :func:`shardwise.parallel.parallelize.validate`, no communication), and rank 0's
ranked plans reach every rank (:func:`choose`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.optim.classify import allows as optimizer_allows
from shardwise.parallel.chunked_loss import find_lm_head, loss_reduction
from shardwise.parallel.parallelize import validate
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.memory import StatePolicy
from shardwise.plan.muon import state_bytes_per_param
from shardwise.plan.options import RUNTIME_OPTIONS
from shardwise.plan.planner import AutoChoice, auto_plan
from shardwise.plan.search import SearchOptions
from shardwise.plan.stats import ModelStats
from shardwise.runtime.detect import RuntimeEnv


def chunkable_loss(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> bool:
    """Whether ``plan.chunked_loss`` can run ``model`` with ``loss_fn``: an LM head, and a loss that
    is the token cross-entropy of its logits (:mod:`shardwise.parallel.chunked_loss`'s checks,
    on a random batch; no loss function, as ``prepare()`` plans, cannot be chunked)."""
    if loss_fn is None:
        return False
    try:
        loss_reduction(loss_fn, find_lm_head(model)[1].out_features)
    except ConfigError:
        return False
    return True


def plan_for_trainer(model: nn.Module, stats: ModelStats, spec: ClusterSpec, *, world_size: int, global_batch: int,
                     precision: str = "fp32", pipelines_allowed: bool = False, chunkable: bool = True,
                     optimizer: str = "elementwise") -> AutoChoice:
    """The fastest plan for ``model`` on ``spec`` that the parallel layer accepts. The trainer
    accumulates gradients itself, so without pipelines a plan has one microbatch per step;
    ``chunkable``: whether a plan may have ``chunked_loss`` (:func:`chunkable_loss`); ``optimizer``:
    the optimizer's kind (:func:`shardwise.optim.factory_kind`): only plans it runs exactly are
    searched, and Muon's states are priced as Muon's (:mod:`shardwise.plan.muon`)."""

    def supported(plan: Plan) -> bool:
        if plan.pp > 1 and not pipelines_allowed:
            return False
        if not optimizer_allows(optimizer, plan):  # a whole-tensor optimizer on shards would run another algorithm
            return False
        if plan.pp == 1 and plan.microbatches > 1:
            return False
        try:  # refuses e.g. a TP degree that does not divide the heads
            validate(model, plan)
        except ConfigError:
            return False
        return True

    allowed = tuple(o for o in RUNTIME_OPTIONS if chunkable or o != "chunked_loss")
    policy = None
    if optimizer == "muon":  # one momentum on the matrices, AdamW's two moments on the rest
        policy = replace(StatePolicy.torch(precision, "muon"), optimizer=state_bytes_per_param(stats))
    options = SearchOptions(
        precision=precision, supported=supported, sequence_parallel=False, runtime_options=allowed, policy=policy
    )
    return auto_plan(stats, world_size=world_size, cluster=spec, global_batch=global_batch, options=options)


def choose(model: nn.Module, stats: ModelStats, spec: ClusterSpec, env: RuntimeEnv,
           **options: Any) -> tuple[list[Plan], AutoChoice | None]:
    """The ranked plans on every rank and, on rank 0, the planner's choice with its predictions
    (:func:`plan_for_trainer` with ``options``, on rank 0 alone).

    Communication: one ``broadcast_object_list`` over the world (rank 0's ranked plans or its
    error, so no rank waits for a plan that never comes)."""
    chosen: list[list[Plan] | str | None] = [None]
    choice = None
    if env.rank == 0:
        try:
            choice = plan_for_trainer(model, stats, spec, **options)
            chosen[0] = [e.plan for e in choice.result.plans]
        except ConfigError as exc:
            chosen[0] = str(exc)
    if dist.is_initialized() and env.world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    if not isinstance(chosen[0], list):
        raise ConfigError(
            f"plan='auto' found no plan: {chosen[0]}",
            hint="pass an explicit plan, e.g. plan='dp' or plan='zero=3,dp=N'",
        )
    return chosen[0], choice
