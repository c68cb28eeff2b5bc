"""The fault-tolerant replica group this process belongs to, read once from the variables that
``shardwise run --ft-replicas R`` (or ``--ft-replica-id I --lighthouse HOST:PORT``) sets for every
worker of a replica group (:mod:`shardwise.launch.ft`):

- ``SHARDWISE_FT_REPLICA``: this group's index ``r`` in ``0..R-1`` (its data shard of every step);
- ``SHARDWISE_FT_REPLICAS``: ``R``, the replica groups the job was started with;
- ``SHARDWISE_FT_LIGHTHOUSE``: ``http://HOST:PORT`` of torchft's lighthouse (the quorum server);
- ``SHARDWISE_FT_MIN_REPLICAS``: fewest live groups that may commit a step (default 1);
- ``SHARDWISE_FT_TIMEOUT``: seconds a cross-replica collective, commit vote or heal may take (default 30);
- ``SHARDWISE_FT_QUORUM_TIMEOUT``: seconds to wait for a quorum before giving up (default 60);
- ``SHARDWISE_FT_DIR``: where group rank 0 appends its events (quorum changes, discarded steps, heals).

No variable set: not fault tolerant (``None``). Standard library only: the core never imports torchft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from shardwise.errors import ConfigError

REPLICA_VAR = "SHARDWISE_FT_REPLICA"
REPLICAS_VAR = "SHARDWISE_FT_REPLICAS"
LIGHTHOUSE_VAR = "SHARDWISE_FT_LIGHTHOUSE"
MIN_REPLICAS_VAR = "SHARDWISE_FT_MIN_REPLICAS"
TIMEOUT_VAR = "SHARDWISE_FT_TIMEOUT"
QUORUM_TIMEOUT_VAR = "SHARDWISE_FT_QUORUM_TIMEOUT"
DIR_VAR = "SHARDWISE_FT_DIR"


@dataclass(frozen=True)
class FtSettings:
    """This process's replica group and how it reaches the quorum (module doc)."""

    replica: int
    replicas: int
    lighthouse: str
    min_replicas: int = 1
    timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    events_dir: str = ""


def _count(environ: Mapping[str, str], name: str, default: int, low: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < low:
        raise ConfigError(
            f"{name}={raw!r} is not a whole number >= {low}", hint=f"unset it, or give e.g. {name}={max(low, default)}"
        )
    return int(raw)


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(
            f"{name}={raw!r} is not a positive number of seconds", hint=f"unset it, or give e.g. {name}={default:g}"
        )
    return value


def ft_settings(environ: Mapping[str, str]) -> FtSettings | None:
    """The replica group of ``environ``'s worker, or None when it is not fault tolerant."""
    lighthouse = environ.get(LIGHTHOUSE_VAR, "").strip()
    if not lighthouse:
        return None
    if "://" not in lighthouse:
        lighthouse = f"http://{lighthouse}"
    replicas = _count(environ, REPLICAS_VAR, 1, 1)
    replica = _count(environ, REPLICA_VAR, 0, 0)
    if replica >= replicas:
        raise ConfigError(
            f"{REPLICA_VAR}={replica} is outside 0..{replicas - 1}",
            hint=f"give each of the {replicas} groups an index from 0",
        )
    return FtSettings(
        replica=replica,
        replicas=replicas,
        lighthouse=lighthouse,
        min_replicas=_count(environ, MIN_REPLICAS_VAR, 1, 1),
        timeout_s=_seconds(environ, TIMEOUT_VAR, 30.0),
        quorum_timeout_s=_seconds(environ, QUORUM_TIMEOUT_VAR, 60.0),
        events_dir=environ.get(DIR_VAR, "").strip(),
    )
