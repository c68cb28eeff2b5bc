"""Parallel techniques, one per file, each ``apply_x(model, mesh, *, options) -> model``;
:func:`parallelize` composes them in a fixed order."""

from shardwise.parallel.mesh import Meshes, build_mesh
from shardwise.parallel.parallelize import ParallelModel, parallelize

__all__ = ["Meshes", "ParallelModel", "build_mesh", "parallelize"]
