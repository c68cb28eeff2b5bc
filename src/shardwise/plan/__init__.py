"""Parallel layouts: the :class:`Plan` value object and the planner that picks one.

``auto_plan(model_or_spec, world_size=..., cluster=..., global_batch=...)`` searches the layouts
with the cost model (:mod:`shardwise.plan.cost`) and returns the fastest that fits; ``search``,
``estimate`` and ``ClusterSpec`` are the pieces (see docs/planner.md). None of them imports torch.
"""

from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.cost import Estimate, StatePolicy, bubble_fraction, estimate
from shardwise.plan.plan import MESH_DIMS, Plan
from shardwise.plan.planner import AutoPlan, auto_plan, stats_of
from shardwise.plan.search import SearchOptions, SearchResult, search
from shardwise.plan.stats import ModelStats, TransformerSpec

__all__ = [
    "MESH_DIMS", "AutoPlan", "ClusterSpec", "Estimate", "ModelStats", "Plan", "SearchOptions", "SearchResult", "StatePolicy",
    "TransformerSpec", "auto_plan", "bubble_fraction", "estimate", "search", "stats_of",
]
