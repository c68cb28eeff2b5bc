"""The planner: the pure cost model, model statistics and the search (torch-free).

``auto_plan(model_or_spec, world_size=..., cluster=..., global_batch=...)`` searches the layouts
with the cost model (:mod:`shardwise.plan.cost`) and returns the fastest that fits; ``search``,
``estimate`` and ``ClusterSpec`` are the pieces (see docs/planner.md). Nothing here imports torch,
so ``shardwise plan`` starts fast; measuring a machine is :mod:`shardwise.calibrate`, measuring an
arbitrary ``nn.Module`` is :mod:`shardwise.auto.measure`.
"""

from shardwise.exports import renamed
from shardwise.layout import MESH_DIMS, Plan
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.cost import Estimate, StatePolicy, bubble_fraction, estimate
from shardwise.plan.policy import RunPolicy
from shardwise.plan.planner import AutoChoice, auto_plan, stats_of
from shardwise.plan.search import SearchOptions, SearchResult, search
from shardwise.plan.stats import ModelStats, TransformerShape, TransformerSpec, transformer_stats

__getattr__ = renamed(__name__, {"AutoPlan": "AutoChoice"})  # the old name, deprecated

__all__ = [
    "MESH_DIMS",
    "AutoChoice",
    "ClusterSpec",
    "Estimate",
    "ModelStats",
    "Plan",
    "RunPolicy",
    "SearchOptions",
    "SearchResult",
    "StatePolicy",
    "TransformerShape",
    "TransformerSpec",
    "auto_plan",
    "bubble_fraction",
    "estimate",
    "search",
    "stats_of",
    "transformer_stats",
]
