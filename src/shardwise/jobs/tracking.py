"""The experiment tracker of ``shardwise train`` (the ``[log]`` table): the checks the command runs
before any process starts, and the logger the job hands its Trainer
(:mod:`shardwise.train.trackers`).

``log.tracker = "mlflow"`` logs to ``log.tracking_uri`` under the experiment ``log.experiment``;
``"wandb"`` to the W&B project ``log.experiment`` in ``log.wandb_mode``. Either records the job's
whole resolved configuration (``{"train.lr": ..., "parallel.plan": ...}``) beside the Trainer's
description of the run (``shardwise.plan``, ``shardwise.predicted_step_time_s``, ...), under the
run's name, so a resumed or restarted run continues the same tracker run.

The checks (:func:`check_tracker`) turn what would otherwise fail inside a worker, after the
processes started, into one line: an option the chosen tracker does not read, a package that is
not installed, a tracking URI MLflow cannot use (an unknown scheme, a file store switched off with
``MLFLOW_ALLOW_FILE_STORE=false``, a directory that cannot be written, a server that does not
answer), W&B online without a login.

A file store the user names (``log.tracking_uri`` or ``MLFLOW_TRACKING_URI`` set to ``file:///...``
or a directory) is what they asked for: MLflow 3 opens one only with ``MLFLOW_ALLOW_FILE_STORE=true``,
so :func:`check_tracker` returns that switch for the run (the command sets it for itself and its
workers and says so in one line) unless the variable is set already.
"""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import fields
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

from shardwise.config import LogSection, TrainJobConfig, check_output_dir, flatten
from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from shardwise.train.loggers import Logger

# the [log] keys each tracker reads; any other must keep its default
USES = {"none": (), "mlflow": ("experiment", "tracking_uri"), "wandb": ("experiment", "wandb_mode")}
CONNECT_TIMEOUT_S = 5.0
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's SQLAlchemy stores
PROFILES = ("databricks", "databricks-uc", "uc")  # whole URIs MLflow reads as a scheme
FILE_STORE_SWITCH = "MLFLOW_ALLOW_FILE_STORE"  # MLflow 3 opens a file store only when this is true


def tracker_loggers(config: TrainJobConfig, *, resume: bool) -> list[Logger]:
    """The loggers ``config.log`` asks for (none, or one tracker), named after ``config.run.name``
    and holding the flattened configuration; ``resume``: continue that run's tracker run even when
    training starts at step 0 (a restarted attempt, ``--resume auto``)."""
    from shardwise.train.trackers import MLflowLogger, WandbLogger

    log, params, name = config.log, flatten(config), config.run.name or None
    if log.tracker == "mlflow":
        return [
            MLflowLogger(
                log.tracking_uri or None, experiment=log.experiment, run_name=name, config=params, resume=resume
            )
        ]
    if log.tracker == "wandb":
        mode = None if log.wandb_mode == "auto" else log.wandb_mode
        return [WandbLogger(log.experiment, run_name=name, mode=mode, config=params, resume=resume)]
    return []


def check_tracker(log: LogSection) -> dict[str, str]:
    """One :class:`ConfigError` line when the ``[log]`` table cannot work (module doc). Nothing is
    written, except by MLflow when it opens a database store (it creates the tables).

    Returns the environment the run needs on top of this process's: ``MLFLOW_ALLOW_FILE_STORE=true``
    for a file store the user named (module doc), else nothing."""
    defaults, tracker_keys = LogSection(), {key for keys in USES.values() for key in keys}
    for f in fields(log):
        if (
            f.name in tracker_keys
            and f.name not in USES[log.tracker]
            and getattr(log, f.name) != getattr(defaults, f.name)
        ):
            readers = " or ".join(t for t, keys in USES.items() if f.name in keys)
            raise ConfigError(f"config key 'log.{f.name}' is set, but log.tracker is {log.tracker!r}",
                              hint=f"log.{f.name} is read with log.tracker {readers}: choose one, or drop log.{f.name}")
    if log.tracker == "none":
        return {}
    if not log.experiment.strip():
        raise ConfigError(
            "config key 'log.experiment' is empty",
            hint="name the experiment (W&B: the project), e.g. --log.experiment gpt",
        )
    _require(log.tracker)
    if log.tracker == "mlflow":
        return _check_mlflow_uri(log.tracking_uri)
    _check_wandb_login(log.wandb_mode)
    return {}


def _require(package: str) -> None:
    try:
        importlib.import_module(package)
    except ImportError as err:
        raise ConfigError(f"log.tracker {package!r} needs the {package} package, which cannot be imported ({err})",
                          hint=f"pip install 'shardwise[{package}]'") from None


def _check_mlflow_uri(tracking_uri: str) -> dict[str, str]:
    """The store behind ``tracking_uri`` (empty: MLflow's default) can be opened and written; the
    file-store switch when the user named a file store (module doc)."""
    import mlflow

    uri = tracking_uri or mlflow.get_tracking_uri()
    what = (
        f"log.tracking_uri {uri!r}"
        if tracking_uri
        else f"MLflow's default tracking URI {uri!r} (log.tracking_uri is empty)"
    )
    named = bool(tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
    try:
        scheme = uri if uri in PROFILES else urlparse(uri).scheme
        if scheme in ("http", "https"):
            urlparse(uri).port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as err:
        raise ConfigError(
            f"{what} is not a URI ({err})", hint="for example file:///abs/mlruns or http://host:5000"
        ) from None
    if scheme in ("", "file"):
        return _check_file_store(uri, what, named=named)
    if scheme in ("http", "https"):
        _check_reachable(uri, what)
    else:
        _check_store(uri, what, database=scheme.split("+")[0] in DATABASE_SCHEMES)
    return {}


def _check_file_store(uri: str, what: str, *, named: bool) -> dict[str, str]:
    from mlflow import environment_variables

    switch = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)  # MLflow 3: off by default
    env = {}
    if (
        switch is not None and named and FILE_STORE_SWITCH not in os.environ
    ):  # asked for by name: switch it on for this run
        env = {FILE_STORE_SWITCH: "true"}
    try:
        allowed = switch is None or bool(env) or switch.get()
    except ValueError as err:
        raise ConfigError(f"{what}: {err}", hint="set MLFLOW_ALLOW_FILE_STORE=true") from None
    if not allowed:
        raise ConfigError(f"{what} is a file store, which MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE=true",
                          hint="export MLFLOW_ALLOW_FILE_STORE=true, or use a sqlite:/// or http:// tracking URI")
    parsed = urlparse(uri)
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise ConfigError(f"{what} names the host {parsed.netloc!r}", hint="a file store is a local directory: file:///abs/path")
    path = url2pathname(unquote(parsed.path)) if parsed.scheme == "file" else uri
    check_output_dir(path, what=f"{what}: directory", hint="choose a directory this user can write, e.g. file:///tmp/mlruns")
    return env


def _check_reachable(uri: str, what: str) -> None:
    parsed = urlparse(uri)
    host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    if not host:
        raise ConfigError(f"{what} names no host", hint="write http://host:port")
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise ConfigError(f"{what}: no tracking server answers at {host}:{port} ({err.strerror or err})",
                          hint="start it (mlflow server --port PORT) or fix the URI") from None


def _check_store(uri: str, what: str, *, database: bool) -> None:
    """Any other scheme: MLflow opens the store (a database store creates its tables)."""
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri)
    except Exception as err:  # noqa: BLE001 - MLflow raises its own and its drivers' errors; each becomes one line
        schemes = getattr(err, "supported_uri_schemes", None)
        if schemes is not None:
            extra = " (database stores need SQLAlchemy: pip install mlflow, not mlflow-skinny)" if database else ""
            raise ConfigError(f"{what}: MLflow has no tracking store for this scheme{extra}",
                              hint=f"schemes it can use here: {', '.join(s for s in schemes if s) or 'none'}") from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{what} cannot be opened: {first}", hint="check the URI") from None


def _check_wandb_login(mode: str) -> None:
    """Online W&B needs a login (``wandb login`` or ``WANDB_API_KEY``); offline needs nothing."""
    resolved = mode if mode != "auto" else os.environ.get("WANDB_MODE", "online")
    if resolved in ("offline", "disabled", "dryrun"):
        return
    import wandb

    try:
        wandb.login(verify=False)
    except Exception as err:  # noqa: BLE001 - wandb raises UsageError (and others) without a key
        raise ConfigError(
            f"log.tracker 'wandb' in online mode needs a W&B login ({str(err).strip() or type(err).__name__})",
            hint="run 'wandb login' or set WANDB_API_KEY, or pass --log.wandb_mode offline",
        ) from None
