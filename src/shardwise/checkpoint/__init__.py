"""Sharded, atomic, resumable checkpoints (see docs/checkpointing.md)."""

from shardwise.checkpoint.commit import CheckpointInfo, Marker, latest_complete, list_checkpoints
from shardwise.checkpoint.faults import Fault
from shardwise.checkpoint.manager import CheckpointManager, CheckpointOptions, Loaded

__all__ = ["CheckpointInfo", "CheckpointManager", "CheckpointOptions", "Fault", "Loaded", "Marker",
           "latest_complete", "list_checkpoints"]
