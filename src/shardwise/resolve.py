"""A plan for a world: :func:`resolve_plan` turns what a user wrote (a :class:`~shardwise.layout.Plan`
or a string) into the plan a job of ``world_size`` processes runs, and :func:`replan` re-plans it
when an elastic job's world shrank or grew. Pure functions of a plan and a world size (no torch),
so the command line, the Trainer's build step and the tests call the same ones.
"""

from __future__ import annotations

import dataclasses
import math

from shardwise.errors import ConfigError
from shardwise.layout import Plan, named_keys


def resolve_plan(plan: Plan | str, world_size: int, *, precision: str | None = None, elastic: bool = False) -> Plan:
    """The plan a job runs: ``"dp"`` -> all processes data parallel, a string parsed with the
    degrees it leaves out filled in for ``world_size``; the result must use the whole world.

    ``precision`` (a trainer's) is written into the plan, so FSDP's mixed-precision policy and the
    printed plan agree with the autocast the loop uses; it may not contradict a plan that sets one.

    ``elastic``: the world may have shrunk or grown since the plan was written (a node lost or
    regained under ``--nnodes MIN:MAX``), so a plan that no longer fits is re-planned with
    :func:`replan` instead of refused.
    """
    if (
        isinstance(plan, str)
        and precision is not None
        and plan.strip().lower() not in ("dp", "ddp", "", "single", "none")
    ):
        if "precision" not in named_keys(
            plan
        ):  # before parsing: "zero=3,params16" needs the precision it is checked against
            plan = f"{plan},precision={precision}"
    if isinstance(plan, str):
        if plan.strip().lower() in ("dp", "ddp"):
            plan = Plan(dp=world_size)
        elif elastic:
            try:
                plan = Plan.parse(plan, world_size=world_size)
            except ConfigError:  # the named degrees no longer divide this world: re-plan them
                plan = Plan.parse(plan)
        else:
            plan = Plan.parse(plan, world_size=world_size)
    if elastic and isinstance(plan, Plan) and plan.world_size != world_size:
        plan = replan(plan, world_size)
    if not isinstance(plan, Plan):
        raise ConfigError(
            f"plan must be a Plan or a string, got {type(plan).__name__}",
            hint='for example plan="dp" or plan="dp=2,tp=2"',
        )
    if precision is not None and precision != plan.precision:
        if plan.precision != "fp32":
            raise ConfigError(
                f"precision={precision!r} contradicts the plan's precision={plan.precision}",
                hint="set the precision in one place (the plan or the Trainer)",
            )
        plan = dataclasses.replace(plan, precision=precision)  # validated by Plan.__post_init__
    return plan.check_world(world_size)


def replan(plan: Plan, world_size: int) -> Plan:
    """``plan`` for a world of ``world_size`` processes (an elastic job after it lost or regained
    a node): keep every degree that still divides the world, fill data parallelism with the rest.

    In this order (inner mesh dimensions first, since they carry the most traffic and the memory
    split the plan was chosen for):

    1. ``tp``: its largest part that divides the world (``gcd(tp, world)``; tp=4 on 2 processes
       keeps tp=2, which still divides the heads), sequence parallel only while tp > 1;
    2. ``cp``: likewise within what tp leaves (each sequence still fits in as few ranks);
    3. ``pp``: likewise within what tp and cp leave (no pipeline left: one microbatch, no virtual stages);
    4. the rest is data parallel: without ZeRO all of it is ``dp``; with ZeRO the shard group keeps
       its size if it divides the rest and ``dp`` replicas (HSDP) fill up, else everything is
       sharded (``shard`` = rest, so ZeRO-3 shards are re-split over the new world); ``ep`` keeps
       its largest part that divides the innermost data-parallel degree.

    ``dp=2,tp=2`` on 2 processes becomes ``tp=2``; ``zero=3,shard=4`` on 2 becomes ``zero=3,shard=2``;
    ``dp=2,tp=2`` regrown to 8 becomes ``dp=4,tp=2``. Precision, recompute and the rest are kept.
    Pure, so the Trainer's build step and the tests call the same function.
    """
    if world_size < 1:
        raise ConfigError(
            f"cannot re-plan {plan} for a world of {world_size} processes", hint="the world needs at least one process"
        )
    if plan.world_size == world_size:
        return plan
    tp = math.gcd(plan.tp, world_size)
    cp = math.gcd(plan.cp, world_size // tp)
    pp = math.gcd(plan.pp, world_size // (tp * cp))
    rest = world_size // (tp * cp * pp)
    if plan.zero == 0 or (plan.shard == 1 and plan.dp > 1):
        dp, shard = rest, 1
    elif plan.dp > 1 and rest % plan.shard == 0:
        dp, shard = rest // plan.shard, plan.shard
    else:
        dp, shard = 1, rest
    pipeline = {"microbatches": 1, "virtual_stages": 1, "schedule": "1f1b"} if plan.pp > 1 and pp == 1 else {}
    ep = math.gcd(plan.ep, shard if plan.zero > 0 else dp)
    return dataclasses.replace(plan, dp=dp, shard=shard, tp=tp, cp=cp, pp=pp, ep=ep,
                               sequence_parallel=plan.sequence_parallel and tp > 1, **pipeline).check_world(world_size)
