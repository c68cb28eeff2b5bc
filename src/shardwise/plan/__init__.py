"""Parallel layouts: the :class:`Plan` value object (and, later, the planner that picks one)."""

from shardwise.plan.plan import MESH_DIMS, Plan

__all__ = ["MESH_DIMS", "Plan"]
