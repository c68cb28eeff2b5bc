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

``plan="auto"`` is the planner's fastest plan that the parallel layer accepts (checked with
:func:`shardwise.parallel.parallelize.validate`, no communication), for the model's statistics
and a cluster: ``cluster=`` if given, else ``SHARDWISE_CLUSTER`` (read once into the runtime's
settings), else this machine, measured once in the job's own world and cached
(:mod:`shardwise.calibrate.machine`). Rank 0 plans and broadcasts the result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint.hf_load import Pretrained, load_parallel
from shardwise.runtime import env as runtime
from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.optim.classify import allows as optimizer_allows, factory_kind
from shardwise.optim.factory import build_optimizer
from shardwise.resolve import resolve_plan
from shardwise.parallel.chunked_loss import find_lm_head, loss_reduction
from shardwise.parallel.ddp import DDPOptions
from shardwise.parallel.fp8 import Fp8Options
from shardwise.parallel.fsdp import FSDPOptions
from shardwise.parallel.mesh import Meshes, build_mesh
from shardwise.parallel.parallelize import ParallelModel, parallelize, validate
from shardwise.parallel.pipeline import PipelineOptions
from shardwise.parallel.reduction import IGNORE_INDEX
from shardwise.parallel.tp import TPOptions
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.memory import StatePolicy
from shardwise.plan.muon import state_bytes_per_param
from shardwise.plan.planner import AutoChoice as AutoPlan, auto_plan, cluster_of
from shardwise.plan.options import RUNTIME_OPTIONS
from shardwise.plan.search import SearchOptions
from shardwise.plan.stats import ModelStats
from shardwise.runtime.detect import RuntimeEnv
from shardwise.runtime.logging import get_logger
from shardwise.train.auto import AutoData, certify_plans, device_spec, first_inputs

log = get_logger("train")

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The Trainer's optimizer when the user names none: AdamW at lr 1e-3. (Certification then
    runs SGD with momentum, whose update is linear in the gradient: :mod:`shardwise.verify.certify`.)"""
    return torch.optim.AdamW(params, lr=1e-3)
ClusterArg = ClusterSpec | str | None


@dataclass(frozen=True)
class Built:
    """What :func:`build` made."""

    env: RuntimeEnv
    plan: Plan
    auto_choice: AutoPlan | None  # plan="auto": the planner's choice on rank 0 (None elsewhere)
    meshes: Meshes
    model: ParallelModel
    optimizer: torch.optim.Optimizer

    @property
    def dp_rank(self) -> int:
        return self.meshes.dp.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.meshes.dp.size()


def build(model: nn.Module | Pretrained, optimizer: OptimizerFactory, *, plan: Plan | str, global_batch_size: int, seed: int,
          precision: str | None = None, pipelines_allowed: bool = True, cluster: ClusterArg = None,
          tokens_per_sample: int | None = None, ddp: DDPOptions | None = None, tp: TPOptions | None = None,
          fsdp: FSDPOptions | None = None, pipeline: PipelineOptions | None = None,
          loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
          check: Callable[[Plan, str], None] | None = None, data: AutoData | None = None,
          loss_reduction: str = "samples", ignore_index: int = IGNORE_INDEX, fp8: Fp8Options | None = None) -> Built:
    """The steps of the module doc. ``global_batch_size`` is what ``plan="auto"`` plans for;
    ``pipelines_allowed=False`` keeps pipelines out of an automatic choice (a pipeline splits each
    micro-batch again, which gradient accumulation already does). ``check(plan, device_type)``
    runs on the resolved plan before any mesh is built (the caller's own checks: batch splits,
    precision on this device). ``data``: the training data that ``plan="auto"`` takes the sample
    shape from and certifies on (:mod:`shardwise.train.auto`), weighing micro-batches by
    ``loss_reduction`` as the training will (:mod:`shardwise.parallel.reduction`)."""
    env = runtime.init()
    choice = None
    if isinstance(plan, str) and plan.strip().lower() == "auto":
        plan, choice = choose_plan(model, env, global_batch_size=global_batch_size, precision=precision,
                                   pipelines_allowed=pipelines_allowed, cluster=cluster, tokens_per_sample=tokens_per_sample,
                                   data=data, loss_fn=loss_fn, loss_parallel=bool(tp and tp.loss_parallel),
                                   loss_reduction=loss_reduction, ignore_index=ignore_index,
                                   optimizer=None if optimizer is default_optimizer else optimizer)
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


def choose_plan(model: nn.Module | Pretrained, env: RuntimeEnv, *, global_batch_size: int, precision: str | None,
                pipelines_allowed: bool, cluster: ClusterArg = None, tokens_per_sample: int | None = None,
                data: AutoData | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                loss_parallel: bool = False, loss_reduction: str = "samples", ignore_index: int = IGNORE_INDEX,
                optimizer: OptimizerFactory | None = None) -> tuple[Plan, AutoPlan | None]:
    """``plan="auto"`` (see the module doc): the plan on every rank and, on rank 0, the planner's
    choice with its predictions (logged). Check first, measure second: the model's statistics (from
    the first sample of ``data`` when given) and whether any plan fits this device's memory are
    settled before the machine is measured, so an impossible request fails in milliseconds. With
    ``data`` certifying (:class:`~shardwise.train.auto.AutoData`), the ranked plans are certified
    by parity in order and the first that passes is the plan (:mod:`shardwise.verify.certify`),
    trained with ``optimizer`` (the user's factory; None: SGD with momentum).

    Communication: one ``broadcast_object_list`` over the world (rank 0's ranked plans or its
    error, so no rank waits for a plan that never comes); measuring the machine and certifying are
    collective too.
    """
    try:  # before any measuring: a model the planner cannot read fails in milliseconds
        inputs = first_inputs(data) if data is not None else None
        stats = model_stats(model, tokens_per_sample=tokens_per_sample, inputs=inputs)
    except ConfigError as exc:
        raise ConfigError(f"plan='auto' found no plan: {exc.message}",
                          hint=exc.hint or "pass tokens_per_sample= (the input length of one sample; 1 for non-sequence inputs), "
                                           "or an explicit plan, e.g. plan='dp'") from None
    source = model
    if isinstance(model, Pretrained):
        model = model.build_meta()  # validating plans against it costs no memory
    options = dict(world_size=env.world_size, global_batch=global_batch_size, precision=precision or "fp32",
                   pipelines_allowed=pipelines_allowed, chunkable=chunkable_loss(model, loss_fn),
                   optimizer=factory_kind(optimizer) if optimizer is not None else "elementwise")
    if cluster is None and env.settings.cluster is None:
        try:  # could any plan fit this device's memory at all? (fitting needs no measured speed)
            plan_for_trainer(model, stats, device_spec(env), **options)
        except ConfigError as exc:
            raise ConfigError(f"plan='auto' found no plan: {exc.message}", hint=exc.hint) from None
    spec = cluster_spec(env, cluster)
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
        raise ConfigError(f"plan='auto' found no plan: {chosen[0]}", hint="pass an explicit plan, e.g. plan='dp' or plan='zero=3,dp=N'")
    plans = chosen[0]
    if data is not None and loss_fn is not None and data.certifying:
        certificate = certify_plans(source, plans, data=data, env=env, loss_fn=loss_fn, loss_parallel=loss_parallel,
                                    loss_reduction=loss_reduction, ignore_index=ignore_index, optimizer=optimizer)
        if certificate.plan is None:
            raise ConfigError(f"plan='auto' found no plan: {certificate.summary()}",
                              hint=f"pass an explicit plan, or certify=False to train with {plans[0]} unchecked")
        plan = next(p for p in plans if str(p) == certificate.plan)
        if choice is not None:
            choice = choice.certified(plan, certificate.to_dict())
        if env.is_main:
            log.info("plan=auto: %s", certificate.summary())
    else:
        plan = plans[0]
    if choice is not None:
        log.info("plan=auto chose %s", choice.summary())
    return plan, choice


def model_stats(model: nn.Module | Pretrained, *, tokens_per_sample: int | None, inputs: Any = None) -> ModelStats:
    """The planner's statistics of ``model``: closed forms for a model carrying its shape as
    ``model.config`` (the built-in GPT, a Hugging Face model) or a Hugging Face directory (its
    ``config.json``), else measured on the meta device. ``inputs``: the first training sample (a
    batch of one), which sets the sequence length and is what the meta forward runs on;
    ``tokens_per_sample`` overrides the length."""
    from shardwise.models.measure import module_stats, sample_seq, sample_stats

    if isinstance(model, Pretrained):
        from shardwise.models.hf import read_config, stats_of_config

        seq = tokens_per_sample or (sample_seq(inputs) if inputs is not None else None)
        stats = stats_of_config(read_config(model.path), seq=seq)
        if model.lora is not None and hasattr(model.lora, "base"):  # a frozen (4-bit) base with adapters
            from shardwise.plan.adapters import with_lora

            stats = with_lora(stats, r=model.lora.r, base=model.lora.base)
        return stats
    if inputs is not None:
        return sample_stats(model, inputs, tokens_per_sample=tokens_per_sample)
    return module_stats(model, seq=tokens_per_sample)


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
                     optimizer: str = "elementwise") -> AutoPlan:
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
    options = SearchOptions(precision=precision, supported=supported, sequence_parallel=False, runtime_options=allowed, policy=policy)
    return auto_plan(stats, world_size=world_size, cluster=spec, global_batch=global_batch, options=options)


def cluster_spec(env: RuntimeEnv, cluster: ClusterArg) -> ClusterSpec:
    """``cluster`` (a spec, a preset name or a spec file), else ``SHARDWISE_CLUSTER``, else this
    machine's measured spec (see the module doc)."""
    chosen = cluster if cluster is not None else env.settings.cluster
    if chosen is not None:
        return cluster_of(chosen, world_size=env.world_size)
    return machine_spec(env)


def machine_spec(env: RuntimeEnv) -> ClusterSpec:
    """This world's measured cluster spec: the cached calibration of this job shape, or a new one
    measured now by every rank and cached by rank 0."""
    # Only plan="auto" without a cluster= measures the machine: imported on that path alone.
    from shardwise.calibrate.machine import cache_path, calibrate_world, load_cached, save_cached

    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else ""
    path = cache_path(env.settings.cache_dir, world_size=env.world_size, device_type=env.device.type,
                      threads=torch.get_num_threads(), device_name=name)
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
