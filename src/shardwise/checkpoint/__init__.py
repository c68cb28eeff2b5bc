"""Sharded, atomic, resumable checkpoints (see docs/checkpointing.md).

The names are imported on first use (PEP 562): ``shardwise.checkpoint.commit`` (markers, the
newest complete step) needs no torch, so the command line checks a run directory without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CheckpointInfo": "shardwise.checkpoint.commit", "Marker": "shardwise.checkpoint.commit",
    "latest_complete": "shardwise.checkpoint.commit", "list_checkpoints": "shardwise.checkpoint.commit",
    "Fault": "shardwise.checkpoint.faults",
    "CheckpointManager": "shardwise.checkpoint.manager", "CheckpointOptions": "shardwise.checkpoint.manager",
    "Loaded": "shardwise.checkpoint.manager",
}

if TYPE_CHECKING:
    from shardwise.checkpoint.commit import CheckpointInfo, Marker, latest_complete, list_checkpoints
    from shardwise.checkpoint.faults import Fault
    from shardwise.checkpoint.manager import CheckpointManager, CheckpointOptions, Loaded

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardwise.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
