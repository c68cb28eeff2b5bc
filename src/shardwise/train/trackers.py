"""Experiment trackers: MLflow and Weights & Biases loggers (optional extras ``shardwise[mlflow]``,
``shardwise[wandb]``), beside the CSV and TensorBoard loggers of :mod:`shardwise.train.loggers`.

Pass them as ``Trainer(..., logging=LoggingOptions(loggers=[MLflowLogger(...)]))``. Every rank may hold one; only global
rank 0 talks to the tracker (the metrics are already global), the others do nothing. The trainer
calls ``describe(info)`` once when ``fit`` starts (the plan, the world and batch layout, the
planner's predicted step time with ``plan="auto"``), then ``begin(step)``, ``log(metrics, step)``
per logging step and ``close()``. What is logged:

- **metrics**: every numeric metric at its step (``loss``, ``lr``, ``step_time_s``, ``val_*``...);
  with a prediction also ``step_time_predicted_s`` and ``step_time_ratio`` = measured / predicted;
- **config**: the ``config`` mapping given to the logger (the job's configuration) and ``describe``'s
  info (prefixed ``shardwise.``), as MLflow params or W&B config.

**Resuming.** A run resumed from a checkpoint at step ``S`` (``begin(S)`` with ``S > 0``) continues
the same tracker run: MLflow finds the newest run of the experiment tagged with this
``run_name``; W&B reads the id it kept in ``<dir>/wandb_run.json``. Steps the earlier attempt
logged after ``S`` (before it stopped) are redone by the resumed run with the same values (resume
is exact), so each is logged once only: a step at or below the newest step the run already holds
is skipped. MLflow's store is read for that; W&B's newest step is kept in the same JSON file.
``resume=True`` continues that run even when training starts at step 0: a restarted attempt that
found no checkpoint redoes the steps its predecessor logged, so they are skipped the same way.

Offline use (how the tests run): MLflow with a local store, MLflow 3's default ``sqlite:///mlflow.db``
or a file store named by ``tracking_uri="file:///path"`` (MLflow 3 opens a file store only with
``MLFLOW_ALLOW_FILE_STORE=true``; a logger given one by name sets that switch for this process, with
one log line, unless the variable is set already), W&B with ``WANDB_MODE=offline`` or
``mode="offline"`` (no account needed).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any, Mapping
from urllib.parse import urlparse

import torch.distributed as dist

from shardwise.errors import ConfigError
from shardwise.runtime.logging import get_logger

RUN_TAG = "shardwise.run"
FILE_STORE_SWITCH = "MLFLOW_ALLOW_FILE_STORE"
log = get_logger("train")


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[key] = float(value)
    return out


class _Tracker:
    """What both trackers share: rank 0 only, the run description, predicted-vs-measured time."""

    def __init__(self, *, run_name: str | None, config: Mapping[str, Any] | None, resume: bool) -> None:
        self.run_name = run_name
        self.resume = resume  # continue the run of this name even from step 0
        self.config = dict(config or {})
        self.info: dict[str, Any] = {}
        self.active = _is_rank0()
        self.predicted_step_time_s: float | None = None
        self.last_step: int | None = None  # newest step the tracker run holds
        self._begun = False

    def describe(self, info: Mapping[str, Any]) -> None:
        """The run's layout (called by the Trainer before ``begin``)."""
        self.info = dict(info)
        predicted = info.get("predicted_step_time_s")
        self.predicted_step_time_s = float(predicted) if predicted else None
        if self.run_name is None and info.get("run_name"):
            self.run_name = str(info["run_name"])

    def params(self) -> dict[str, Any]:
        return {**self.config, **{f"shardwise.{k}": v for k, v in self.info.items() if v is not None}}

    def row(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        values = _numeric(metrics)
        if self.predicted_step_time_s and "step_time_s" in values:
            values["step_time_predicted_s"] = self.predicted_step_time_s
            values["step_time_ratio"] = values["step_time_s"] / self.predicted_step_time_s
        return values

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.active:
            return
        if not self._begun:
            self.begin(0)
        if self.last_step is not None and step <= self.last_step and step not in self._steps_now:
            return  # logged by the attempt before a resume: the redone step has the same values
        values = self.row(metrics)
        if values:
            self._write(values, step)
            self._steps_now.add(step)  # a training row and an evaluation row may share a step
            self._logged(step)

    def begin(self, step: int = 0) -> None:
        if not self.active or self._begun:
            return
        self._steps_now: set[int] = set()
        self._open(resume=step > 0 or self.resume)
        self._begun = True

    # per tracker
    def _open(self, *, resume: bool) -> None: ...
    def _write(self, values: dict[str, float], step: int) -> None: ...
    def _logged(self, step: int) -> None: ...


def _allow_named_file_store(uri: str | None) -> None:
    """A file store given by name is what the user asked for: switch MLflow 3's opt-in on (module doc)."""
    if not uri or urlparse(uri).scheme not in ("", "file") or FILE_STORE_SWITCH in os.environ:
        return
    os.environ[FILE_STORE_SWITCH] = "true"
    log.info("MLflow: %s is a file store, so %s=true is set for this run (MLflow 3 keeps file stores off by default)",
             uri, FILE_STORE_SWITCH)


class MLflowLogger(_Tracker):
    """``MLflowLogger(tracking_uri=None, experiment="shardwise", run_name=None, config=None, resume=False)``.

    ``tracking_uri``: where runs are stored (``file:///abs/mlruns``, ``sqlite:///mlflow.db``, a server;
    default: MLflow's own, ``MLFLOW_TRACKING_URI``). ``run_name`` (default: the Trainer's run
    directory name) also identifies the run to continue on a resume.
    """

    def __init__(self, tracking_uri: str | None = None, *, experiment: str = "shardwise", run_name: str | None = None,
                 config: Mapping[str, Any] | None = None, resume: bool = False) -> None:
        super().__init__(run_name=run_name, config=config, resume=resume)
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.run_id: str | None = None
        self._client: Any = None

    def _open(self, *, resume: bool) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError("MLflowLogger needs the mlflow package", hint="pip install 'shardwise[mlflow]'") from None
        _allow_named_file_store(self.tracking_uri)
        client = self._client = MlflowClient(tracking_uri=self.tracking_uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        name = self.run_name or "shardwise"
        previous = None
        if resume:
            runs = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{name}'",
                                      order_by=["attribute.start_time DESC"], max_results=1)
            previous = runs[0] if runs else None
        if previous is not None:
            self.run_id = previous.info.run_id
            client.update_run(self.run_id, status="RUNNING")
            steps = [m.step for key in previous.data.metrics for m in client.get_metric_history(self.run_id, key)]
            self.last_step = max(steps) if steps else None
            held = previous.data.params
        else:
            self.run_id = client.create_run(experiment_id, run_name=name, tags={RUN_TAG: name}).info.run_id
            held = {}
        from mlflow.entities import Param

        # params are write-once in MLflow: a resumed run adds only those it does not hold yet
        new = [Param(k, str(v)[:6000]) for k, v in self.params().items() if k not in held]
        for i in range(0, len(new), 100):
            client.log_batch(self.run_id, params=new[i:i + 100])

    def _write(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def _logged(self, step: int) -> None:
        pass

    def close(self) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id, status="FINISHED")


class WandbLogger(_Tracker):
    """``WandbLogger(project="shardwise", run_name=None, dir=None, mode=None, config=None, resume=False)``.

    ``dir``: where W&B writes (and where ``wandb_run.json`` keeps the run id for a resume); default:
    the Trainer's run directory. ``mode``: ``"online"``, ``"offline"`` (default: ``WANDB_MODE``).
    """

    STATE = "wandb_run.json"

    def __init__(self, project: str = "shardwise", *, run_name: str | None = None, dir: str | os.PathLike | None = None,
                 mode: str | None = None, config: Mapping[str, Any] | None = None, resume: bool = False) -> None:
        super().__init__(run_name=run_name, config=config, resume=resume)
        self.project, self.mode = project, mode
        self.dir = os.fspath(dir) if dir is not None else None
        self.run_id: str | None = None
        self._run: Any = None

    def describe(self, info: Mapping[str, Any]) -> None:
        super().describe(info)
        if self.dir is None and info.get("run_dir"):
            self.dir = str(info["run_dir"])

    def _state_path(self) -> str:
        if self.dir is None:
            raise ConfigError("WandbLogger needs a directory", hint="pass dir=..., or give the Trainer a run_dir")
        return os.path.join(self.dir, self.STATE)

    def _open(self, *, resume: bool) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("WandbLogger needs the wandb package", hint="pip install 'shardwise[wandb]'") from None
        path = self._state_path()
        os.makedirs(self.dir, exist_ok=True)  # type: ignore[arg-type]
        state = {}
        if resume and os.path.exists(path):
            with open(path) as fh:
                state = json.load(fh)
        self.run_id = state.get("id") or secrets.token_hex(4)  # W&B ids: lowercase letters and digits
        self.last_step = state.get("last_step")
        self._run = wandb.init(project=self.project, name=self.run_name, id=self.run_id, resume="allow", dir=self.dir,
                               mode=self.mode, config=self.params(), reinit="create_new")
        self._save_state()

    def _save_state(self) -> None:
        tmp = self._state_path() + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"id": self.run_id, "last_step": self.last_step}, fh)
        os.replace(tmp, self._state_path())

    def _write(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def _logged(self, step: int) -> None:
        if self.last_step is None or step > self.last_step:
            self.last_step = step
            self._save_state()

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
