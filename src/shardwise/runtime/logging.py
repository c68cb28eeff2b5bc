"""Rank-aware logging.

Lines carry a ``[rank r/w]`` prefix. By default info and debug lines come from rank 0 only, so a
job of 64 ranks prints one readable log; warnings and errors come from every rank, because the
rank that has the problem is the one that knows it.
"""

from __future__ import annotations

import logging
import sys

ROOT = "shardwise"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, world_size: int, all_ranks: bool) -> None:
        super().__init__()
        self.rank, self.world_size, self.all_ranks = rank, world_size, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = f"[rank {self.rank}/{self.world_size}]"
        return self.all_ranks or self.rank == 0 or record.levelno >= logging.WARNING


def setup_logging(rank: int, world_size: int, *, all_ranks: bool = False, level: int = logging.INFO) -> logging.Logger:
    """Install the rank-aware handler on the ``shardwise`` logger (idempotent) and return it."""
    logger = logging.getLogger(ROOT)
    for handler in list(logger.handlers):
        if getattr(handler, "_shardwise", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._shardwise = True  # type: ignore[attr-defined]
    handler.addFilter(_RankFilter(rank, world_size, all_ranks))
    handler.setFormatter(logging.Formatter("%(rank_prefix)s %(levelname).1s %(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def get_logger(name: str | None = None) -> logging.Logger:
    """A child of the ``shardwise`` logger: ``get_logger("train")`` logs as ``shardwise.train``, and a
    module's ``__name__`` (``"shardwise.train.build"``) keeps its one ``shardwise`` prefix."""
    if not name or name == ROOT:
        return logging.getLogger(ROOT)
    return logging.getLogger(name if name.startswith(ROOT + ".") else f"{ROOT}.{name}")
