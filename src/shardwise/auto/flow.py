"""``plan="auto"`` in one function, :func:`plan_for`: size, measure, choose, certify (package doc)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardwise.auto.certify import certify_plans
from shardwise.auto.choose import choose, chunkable_loss, plan_for_trainer
from shardwise.auto.machine import ClusterArg, cluster_spec, device_spec
from shardwise.auto.measure import model_stats
from shardwise.auto.sample import AutoData, first_inputs
from shardwise.checkpoint.hf_load import Pretrained
from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.optim.classify import factory_kind
from shardwise.parallel.reduction import IGNORE_INDEX
from shardwise.plan.planner import AutoChoice
from shardwise.runtime.detect import RuntimeEnv
from shardwise.runtime.logging import get_logger

log = get_logger("train")


def plan_for(model: Any, env: RuntimeEnv, *, global_batch_size: int, precision: str | None, pipelines_allowed: bool,
             cluster: ClusterArg = None, tokens_per_sample: int | None = None, data: AutoData | None = None,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, loss_parallel: bool = False,
             loss_reduction: str = "samples", ignore_index: int = IGNORE_INDEX,
             optimizer: Callable[[Any], torch.optim.Optimizer] | None = None) -> tuple[Plan, AutoChoice | None]:
    """The plan of ``model`` (an ``nn.Module`` or a Hugging Face ``Pretrained`` directory) on every
    rank and, on rank 0, the planner's choice with its predictions (logged). Check first, measure
    second: the model's statistics (from the first sample of ``data`` when given) and whether any
    plan fits this device's memory are settled before the machine is measured, so an impossible
    request fails in milliseconds. With ``data`` certifying (:class:`AutoData`), the ranked plans
    are certified by parity in order and the first that passes is the plan, trained with
    ``optimizer`` (the user's factory; None: SGD with momentum).

    Communication: one ``broadcast_object_list`` over the world (:func:`shardwise.auto.choose.choose`);
    measuring the machine and certifying are collective too.
    """
    try:  # before any measuring: a model the planner cannot read fails in milliseconds
        inputs = first_inputs(data) if data is not None else None
        stats = model_stats(model, tokens_per_sample=tokens_per_sample, inputs=inputs)
    except ConfigError as exc:
        raise ConfigError(
            f"plan='auto' found no plan: {exc.message}",
            hint=exc.hint
            or "pass LoggingOptions(tokens_per_sample=...) (the input length of one sample; 1 for non-sequence "
            "inputs), or an explicit plan, e.g. plan='dp'",
        ) from None
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
    plans, choice = choose(model, stats, cluster_spec(env, cluster), env, **options)
    plan = plans[0]
    if data is not None and loss_fn is not None and data.certifying:
        certificate = certify_plans(source, plans, data=data, env=env, loss_fn=loss_fn, loss_parallel=loss_parallel,
                                    loss_reduction=loss_reduction, ignore_index=ignore_index, optimizer=optimizer)
        if certificate.plan is None:
            raise ConfigError(
                f"plan='auto' found no plan: {certificate.summary()}",
                hint=f"pass an explicit plan, or ParallelOptions(certify=False) to train with {plans[0]} unchecked",
            )
        plan = next(p for p in plans if str(p) == certificate.plan)
        if choice is not None:
            choice = choice.certified(plan, certificate.to_dict())
        if env.is_main:
            log.info("plan=auto: %s", certificate.summary())
    if choice is not None:
        log.info("plan=auto chose %s", choice.summary())
    return plan, choice
