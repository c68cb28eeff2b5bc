"""What the search (:mod:`shardwise.plan.search`, whose module doc gives the order and the pruning)
enumerates: :class:`SearchOptions`, and the degrees, layouts and schedules a world size allows
(the private helpers are the search's own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from shardwise.layout import Plan
from shardwise.plan.memory import StatePolicy
from shardwise.plan.options import RUNTIME_OPTIONS
from shardwise.plan.policy import RunPolicy
from shardwise.plan.stats import ModelStats

SEARCH_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
VIRTUAL_STAGES = (2, 3, 4)


@dataclass(frozen=True)
class SearchOptions:
    """What to search over. ``supported`` filters plans the runtime can apply (None: all)."""

    precision: str = "bf16"
    headroom: float = 0.1
    top: int = 5
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = SEARCH_SCHEDULES
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: bool = True
    hsdp: bool = True
    max_microbatches: int | None = None  # None: every divisor of the per-replica batch
    policy: StatePolicy | None = None
    supported: Callable[[Plan], bool] | None = None
    run: RunPolicy | None = None  # how the step runs (precision policy, selective mode); None: shardwise's Trainer
    fixed: dict[str, Any] = field(default_factory=dict)  # keys a user fixed (layout.named_keys); the rest is searched
    context_parallel: bool = False  # also search cp > 1 (search() does when nothing fits without it)
    runtime_options: tuple[str, ...] = RUNTIME_OPTIONS  # the runtime options the search may turn on
    options_for_memory: bool = False  # turn a runtime option on only where the plan does not fit without it
    precisions: tuple[str, ...] = ()  # search each of these compute precisions (empty: just ``precision``)
    envelope: dict[str, float] | None = None  # chip -> best measured MFU bounding the plans (None: the published one)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _matches(plan: Plan, fixed: dict[str, Any]) -> bool:
    for key, value in fixed.items():
        if key == "dp":
            got = plan.dp if ("zero" in fixed or "shard" in fixed) else plan.dp_size
        else:
            got = getattr(plan, key)
        if got != value:
            return False
    return True


def _cp_choices(stats: ModelStats, ranks: int) -> list[int]:
    """Context-parallel degrees worth trying: powers of two up to ``ranks`` whose ``2 cp`` zig-zag
    chunks divide the sequence."""
    out, cp = [], 2
    while cp <= ranks:
        if stats.seq % (2 * cp) == 0:
            out.append(cp)
        cp *= 2
    return out


def _with_experts(
    stats: ModelStats, layouts: list[tuple[int, int, int]], fixed: dict[str, Any]
) -> list[tuple[int, int, int, int]]:
    """Each (zero, dp, shard) layout with every expert-parallel degree an MoE model allows: ep
    divides the experts and the innermost data-parallel degree (``shard`` with ZeRO, else ``dp``)."""
    out = []
    for zero, dp, shard in layouts:
        inner = shard if zero > 0 else dp
        eps = [1] + ([e for e in divisors(inner) if e > 1 and stats.experts % e == 0] if stats.experts else [])
        out += [(zero, dp, shard, ep) for ep in eps if "ep" not in fixed or ep == fixed["ep"]]
    return out


def _layouts(dp_total: int, tp: int, pp: int, per_node: int, options: SearchOptions) -> list[tuple[int, int, int]]:
    """(zero, dp_replicate, dp_shard) choices for ``dp_total`` data-parallel ranks (a fixed
    ``shard`` or ``dp`` adds its own HSDP split; a fixed plan may name layouts the runtime refuses,
    which the cost model still prices)."""
    out = []
    fixed = options.fixed
    if 0 in options.zero_stages:
        out.append((0, dp_total, 1))
    if dp_total == 1:
        return out or [(options.zero_stages[0] if fixed.get("zero") else 0, 1, 1)]
    node_shard = max(1, per_node // tp)
    shards = {dp_total}
    if options.hsdp and 1 < node_shard < dp_total and dp_total % node_shard == 0:
        shards.add(node_shard)
    if "shard" in fixed and isinstance(fixed["shard"], int) and dp_total % fixed["shard"] == 0:
        shards.add(fixed["shard"])
    for zero in options.zero_stages:
        if zero == 0 or (
            zero == 1 and (tp > 1 or pp > 1) and "zero" not in fixed
        ):  # runtime_conflict: ZeRO-1 is DDP-only
            continue
        out += [(zero, dp_total // shard, shard) for shard in sorted(shards, reverse=True)]
    return out


def _schedules(stats: ModelStats, pp: int, m: int, options: SearchOptions) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    fixed_v = options.fixed.get("virtual_stages")
    for schedule in options.schedules:
        if schedule == "interleaved_1f1b":
            for v in (fixed_v,) if fixed_v else VIRTUAL_STAGES:
                if v * pp <= stats.blocks and m % pp == 0:  # uneven chunks: the runtime's balanced cuts
                    out.append((schedule, v))
        elif schedule in ("1f1b", "gpipe") and (schedule == "gpipe" or m >= pp) and not (fixed_v and fixed_v > 1):
            out.append((schedule, 1))
    return out


__all__ = ["SEARCH_SCHEDULES", "VIRTUAL_STAGES", "SearchOptions", "divisors"]
