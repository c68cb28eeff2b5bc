"""Which layouts shardwise's parallel layer can run, whatever the model (torch-free).

The search (:mod:`shardwise.plan.search`) skips a layout with a conflict, and
:func:`shardwise.parallel.parallelize.validate` raises it, so the planner never offers what the
runtime refuses. The facts are about torch's engines, which is why they are not checks of the
:class:`~shardwise.layout.Plan` value itself:

- ZeRO-1 is torch's ``ZeroRedundancyOptimizer`` over DDP: it cannot wrap tensor-parallel
  DTensors;
- under pipelining the data-parallel wrapper is FSDP2's replicate, whose DTensor parameters
  ``ZeroRedundancyOptimizer`` cannot broadcast (torch has no DTensor rule for ``c10d.broadcast_``);
- ``params16`` without ZeRO-2/3 runs through FSDP2's ``replicate`` with a mixed-precision policy,
  whose parameters ``ZeroRedundancyOptimizer`` (ZeRO-1) cannot take either.
"""

from __future__ import annotations

import dataclasses

from shardwise.errors import ConfigError
from shardwise.layout import Plan


def runtime_conflict(plan: Plan) -> ConfigError | None:
    """Why the parallel layer cannot run ``plan`` (None if it can); see the module doc."""
    if plan.zero == 1 and plan.tp_enabled:
        return ConfigError(
            f"plan {plan}: zero=1 (ZeroRedundancyOptimizer over DDP) cannot wrap tensor-parallel DTensors",
            hint="use zero=2 or zero=3 with tp (FSDP composes with TP), or drop tp",
        )
    if plan.zero == 1 and plan.ep_enabled:
        return ConfigError(
            f"plan {plan}: zero=1 (ZeroRedundancyOptimizer) cannot shard the experts' DTensor weights",
            hint="use zero=2 or zero=3 with ep, or plain data parallelism with ep",
        )
    if plan.zero == 1 and plan.params16:
        return ConfigError(
            f"plan {plan}: zero=1 (ZeroRedundancyOptimizer) cannot take params16's 16-bit compute copies "
            "(FSDP2's replicate)",
            hint=f"use zero=2 or zero=3 with params16, e.g. {dataclasses.replace(plan, zero=2)}, or drop params16",
        )
    if plan.zero == 1 and plan.pp_enabled and plan.shard > 1:
        return ConfigError(
            f"plan {plan}: zero=1 (ZeroRedundancyOptimizer) cannot shard the optimizer state of pipeline stages",
            hint="use zero=2 or zero=3 with pp (FSDP composes with pipeline stages), "
            f"e.g. {dataclasses.replace(plan, zero=2)}, "
            f"or plain data parallelism: {dataclasses.replace(plan, zero=0, dp=plan.dp_size, shard=1)}",
        )
    return None
