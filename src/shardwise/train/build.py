"""The one build step of :class:`~shardwise.train.Trainer` and :func:`~shardwise.train.prepare`.

What happens, in this order (each step needs the one before)::

    env   = shardwise.init()                       # process group, device, settings
    plan  = resolve_plan(plan) | choose "auto"    # a Plan that fits the world (rank 0 plans "auto";
                                                   # an elastic job re-plans for a changed world)
    mesh  = build_mesh(plan)                       # the named 4-D device mesh
    seed  = seed + dp_rank                         # same within a replica, different across replicas
    model = parallelize(model.to(device), plan)    # pipeline split -> TP -> recompute -> FSDP/DDP
    opt   = model.build_optimizer(factory)         # on the final (possibly sharded) parameters

``model`` may also be a :class:`~shardwise.checkpoint.hf_load.Pretrained` Hugging Face directory:
then it is built on meta, parallelized, and each rank reads only its own slices of the weights
(:func:`~shardwise.checkpoint.hf_load.load_parallel`); ``plan="auto"`` reads its shape from the
directory's ``config.json``.

``plan="auto"`` is :func:`shardwise.auto.flow.plan_for` (size, measure, choose, certify): the
planner's fastest plan that the parallel layer accepts, for the model's statistics and a cluster
(``cluster=``, else ``SHARDWISE_CLUSTER``, else this machine, measured once and cached). Rank 0
plans and broadcasts the result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np
import torch
from torch import nn

from shardwise.auto.flow import plan_for
from shardwise.auto.machine import ClusterArg
from shardwise.auto.sample import AutoData
from shardwise.checkpoint.hf_load import Pretrained, load_parallel
from shardwise.runtime import env as runtime
from shardwise.layout import Plan
from shardwise.optim.factory import build_optimizer
from shardwise.resolve import resolve_plan
from shardwise.parallel.ddp import DDPOptions
from shardwise.parallel.fp8 import Fp8Options
from shardwise.parallel.fsdp import FSDPOptions
from shardwise.parallel.mesh import Meshes, build_mesh
from shardwise.parallel.parallelize import ParallelModel, parallelize
from shardwise.parallel.pipeline import PipelineOptions
from shardwise.parallel.reduction import IGNORE_INDEX
from shardwise.parallel.tp import TPOptions
from shardwise.plan.planner import AutoChoice
from shardwise.runtime.detect import RuntimeEnv
from shardwise.runtime.logging import get_logger
from shardwise.train.checks import check_batch_split
from shardwise.train.precision import check_precision

if TYPE_CHECKING:
    from shardwise.train.options import LoggingOptions, ParallelOptions, PrecisionOptions, TrainOptions

log = get_logger("train")

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The Trainer's optimizer when the user names none: AdamW at lr 1e-3. (Certification then
    runs SGD with momentum, whose update is linear in the gradient: :mod:`shardwise.auto.certify`.)"""
    return torch.optim.AdamW(params, lr=1e-3)


@dataclass(frozen=True)
class Built:
    """What :func:`build` made."""

    env: RuntimeEnv
    plan: Plan
    auto_choice: AutoChoice | None  # plan="auto": the planner's choice on rank 0 (None elsewhere)
    meshes: Meshes
    model: ParallelModel
    optimizer: torch.optim.Optimizer

    @property
    def dp_rank(self) -> int:
        return self.meshes.dp.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.meshes.dp.size()


def build(
    model: nn.Module | Pretrained,
    optimizer: OptimizerFactory,
    *,
    plan: Plan | str,
    global_batch_size: int,
    seed: int,
    precision: str | None = None,
    pipelines_allowed: bool = True,
    cluster: ClusterArg = None,
    tokens_per_sample: int | None = None,
    ddp: DDPOptions | None = None,
    tp: TPOptions | None = None,
    fsdp: FSDPOptions | None = None,
    pipeline: PipelineOptions | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    check: Callable[[Plan, str], None] | None = None,
    data: AutoData | None = None,
    loss_reduction: str = "samples",
    ignore_index: int = IGNORE_INDEX,
    fp8: Fp8Options | None = None,
) -> Built:
    """The steps of the module doc. ``global_batch_size`` is what ``plan="auto"`` plans for;
    ``pipelines_allowed=False`` keeps pipelines out of an automatic choice (a pipeline splits each
    micro-batch again, which gradient accumulation already does). ``check(plan, device_type)``
    runs on the resolved plan before any mesh is built (the caller's own checks: batch splits,
    precision on this device). ``data``: the training data that ``plan="auto"`` takes the sample
    shape from and certifies on (:mod:`shardwise.auto`), weighing micro-batches by
    ``loss_reduction`` as the training will (:mod:`shardwise.parallel.reduction`)."""
    env = runtime.init()
    choice = None
    if isinstance(plan, str) and plan.strip().lower() == "auto":
        plan, choice = plan_for(
            model,
            env,
            global_batch_size=global_batch_size,
            precision=precision,
            pipelines_allowed=pipelines_allowed,
            cluster=cluster,
            tokens_per_sample=tokens_per_sample,
            data=data,
            loss_fn=loss_fn,
            loss_parallel=bool(tp and tp.loss_parallel),
            loss_reduction=loss_reduction,
            ignore_index=ignore_index,
            optimizer=None if optimizer is default_optimizer else optimizer,
        )
    # An elastic job (--nnodes MIN:MAX) may come back on fewer or more processes than the plan
    # was written for: re-plan it (resolve.replan) instead of refusing it.
    resolved = resolve_plan(plan, env.world_size, precision=precision, elastic=env.settings.elastic is not None)
    if check is not None:
        check(resolved, env.device.type)
    meshes = build_mesh(resolved, env.device.type)
    # Same seed within one replica (TP/PP ranks hold parts of one model), different across
    # replicas (dropout masks differ per batch).
    seed_everything(seed + meshes.dp.get_local_rank())
    options = dict(ddp=ddp, tp=tp, fsdp=fsdp, loss_fn=loss_fn, pipeline=pipeline, fp8=fp8)
    if isinstance(model, Pretrained):
        pm = load_parallel(model, resolved, meshes, device=env.device, **options)
    else:
        pm = parallelize(model.to(env.device), resolved, meshes, **options)
    opt = build_optimizer(pm, optimizer)
    return Built(env=env, plan=resolved, auto_choice=choice, meshes=meshes, model=pm, optimizer=opt)


def bind_build(
    model: nn.Module | Pretrained,
    optimizer: OptimizerFactory,
    *,
    plan: Plan | str,
    global_batch_size: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    precision: PrecisionOptions,
    train: TrainOptions,
    parallel: ParallelOptions,
    logging: LoggingOptions,
    replicas: Callable[[], int],
) -> Callable[..., Built]:
    """:func:`build` with a Trainer's arguments and option sections bound (``data=`` is left for
    ``plan="auto"``); ``replicas()`` is the number of replica groups once the environment is known."""

    def check(plan: Plan, device_type: str) -> None:  # before any mesh or wrapping
        check_batch_split(global_batch_size, plan.dp_size * replicas(), train.grad_accum_steps)  # replicas: train/ft.py
        check_precision(plan.precision, device_type)

    # Pipelines split each micro-batch again, so an automatic choice considers them only without
    # gradient accumulation.
    return partial(
        build,
        model,
        optimizer,
        plan=plan,
        global_batch_size=global_batch_size,
        seed=train.seed,
        precision=precision.compute,
        pipelines_allowed=train.grad_accum_steps == 1,
        cluster=parallel.cluster,
        tokens_per_sample=logging.tokens_per_sample,
        ddp=parallel.ddp,
        tp=parallel.tp,
        fsdp=parallel.fsdp,
        pipeline=parallel.pipeline,
        loss_fn=loss_fn,
        check=check,
        loss_reduction=train.loss_reduction,
        ignore_index=train.ignore_index,
        fp8=precision.fp8,
    )


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
