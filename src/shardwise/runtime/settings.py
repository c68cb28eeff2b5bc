"""shardwise's own environment variables, read once into a typed value.

:func:`read_settings` runs when the launcher's variables are read (:func:`shardwise.runtime.detect.detect_process`,
so once per :func:`shardwise.init`); every later layer takes the value from
:attr:`RuntimeEnv.settings <shardwise.runtime.detect.RuntimeEnv.settings>` and never reads the
environment again. The variables:

- ``SHARDWISE_HANG_TIMEOUT``: seconds a collective may stall before the hang watchdog stops the job
  (default 300; ``0`` or ``off`` disables);
- ``SHARDWISE_CLUSTER``: a preset name or a ``shardwise calibrate`` spec file for ``plan="auto"``
  (default: this machine, measured once and cached);
- ``SHARDWISE_CACHE_DIR`` (else ``$XDG_CACHE_HOME/shardwise``, else ``~/.cache/shardwise``): where
  that measurement is cached;
- ``SHARDWISE_FAULT``: a fault to inject for recovery tests (:mod:`shardwise.checkpoint.faults`);
- ``SHARDWISE_ELASTIC``: ``MIN:MAX`` nodes when ``shardwise run --nnodes MIN:MAX`` started this
  worker (export it yourself under plain torchrun): the world may change between launch attempts,
  so the Trainer re-plans instead of refusing a plan written for another world size;
- torch's elastic agent's ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT`` and
  ``TORCHELASTIC_USE_AGENT_STORE``: which job and which launch attempt this is;
- ``SHARDWISE_LAUNCHER_PID``: the process id of the ``shardwise run`` launcher that started this
  worker (set by the launcher), so the worker can leave when the launcher is gone
  (:mod:`shardwise.runtime.parent`), within torch's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds
  (default 30: what the launcher itself gives its workers after a SIGTERM);
- ``SHARDWISE_LOG_LEVEL``: ``debug`` shows shardwise's debug lines and the dependencies' warnings
  and log lines that are otherwise kept off the terminal (:mod:`shardwise.runtime.quiet`; what
  ``shardwise --verbose`` sets); default ``info``.
- ``SHARDWISE_FT_*``: the fault-tolerant replica group of ``shardwise run --ft-replicas``
  (:mod:`shardwise.runtime.ft_env`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from shardwise.errors import ConfigError
from shardwise.runtime.ft_env import FtSettings, ft_settings

HANG_TIMEOUT_VAR = "SHARDWISE_HANG_TIMEOUT"
ELASTIC_VAR = "SHARDWISE_ELASTIC"
DEFAULT_HANG_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Settings:
    """The values of the variables in the module doc (defaults when unset)."""

    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    cluster: str | None = None
    cache_dir: str = ""
    fault: str = ""
    run_id: str = "local"
    restart_count: int = 0
    use_agent_store: bool = False
    elastic: tuple[int, int] | None = None  # (min, max) nodes of an elastic job, else None
    launcher_pid: int | None = None
    stop_grace_s: float = 30.0
    log_level: str = "info"
    ft: FtSettings | None = None  # this worker's fault-tolerant replica group (runtime/ft_env.py), else None

    @property
    def attempt_namespace(self) -> str:
        """A key prefix of this job's launch attempt (keys of a failed attempt must not leak into the next).

        On the agent's shared store that is the restart count. Without it (a multi-node
        ``shardwise run``: every rendezvous round gets a fresh store hosted by rank 0) the store
        itself is new, and the restart count must not be used: each node's agent counts its own
        restarts, and a node that joins or restarts for a membership change counts differently
        from the others, so their ranks would wait under different prefixes forever.
        """
        return f"{self.run_id}/{self.restart_count}" if self.use_agent_store else self.run_id


def hang_timeout(environ: Mapping[str, str], default: float = DEFAULT_HANG_TIMEOUT_S) -> float:
    """``SHARDWISE_HANG_TIMEOUT`` in seconds (``0`` or ``off``: 0, the watchdog disabled), else ``default``."""
    raw = environ.get(HANG_TIMEOUT_VAR, "").strip().lower()
    if not raw:
        return default
    if raw in ("off", "none", "false", "no"):
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{HANG_TIMEOUT_VAR}={raw!r} is not a number of seconds",
                          hint=f"e.g. {HANG_TIMEOUT_VAR}=300, or 0 to disable") from None
    if value < 0:
        raise ConfigError(f"{HANG_TIMEOUT_VAR}={raw} is negative", hint="use seconds > 0, or 0 to disable the watchdog")
    return value


def elastic_nodes(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """``SHARDWISE_ELASTIC=MIN:MAX`` as ``(min, max)``; None when unset (a fixed world)."""
    raw = environ.get(ELASTIC_VAR, "").strip()
    if not raw:
        return None
    low, _, high = raw.partition(":")
    if not (low.isdigit() and (high or low).isdigit()) or not 0 < int(low) <= int(high or low):
        raise ConfigError(f"{ELASTIC_VAR}={raw!r} is not MIN:MAX nodes", hint=f"e.g. {ELASTIC_VAR}=1:4, or unset it")
    return int(low), int(high or low)


def default_cache_dir(environ: Mapping[str, str]) -> str:
    explicit = environ.get("SHARDWISE_CACHE_DIR")
    if explicit:
        return explicit
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardwise")


def read_settings(environ: Mapping[str, str]) -> Settings:
    """The settings of ``environ`` (usually ``os.environ``); a bad value is one ConfigError line."""
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip() or "0"
    if not restart.isdigit():
        raise ConfigError(
            f"TORCHELASTIC_RESTART_COUNT={restart!r} is not a count", hint="unset it; the elastic agent sets it"
        )
    launcher = environ.get("SHARDWISE_LAUNCHER_PID", "").strip()
    grace = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "").strip()
    return Settings(
        hang_timeout_s=hang_timeout(environ),
        cluster=environ.get("SHARDWISE_CLUSTER") or None,
        cache_dir=default_cache_dir(environ),
        fault=environ.get("SHARDWISE_FAULT", "").strip(),
        run_id=environ.get("TORCHELASTIC_RUN_ID", "local") or "local",
        restart_count=int(restart),
        use_agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        elastic=elastic_nodes(environ),
        launcher_pid=int(launcher) if launcher.isdigit() else None,
        stop_grace_s=float(grace) if grace.isdigit() else 30.0,
        log_level=environ.get("SHARDWISE_LOG_LEVEL", "").strip().lower() or "info",
        ft=ft_settings(environ),
    )
