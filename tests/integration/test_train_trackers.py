"""``shardwise train --log.tracker mlflow|wandb`` end to end through the command line, offline.

MLflow (a local file store): the first invocation has a restart (``--max-restarts 1``; an injected
fault fails the worker at step 3, before its first checkpoint, after it logged steps 1 and 2), so
the restarted attempt starts again at step 0 and must continue the same tracker run without
logging steps 1 and 2 twice; it trains to step 5 (checkpoints at 3 and 5). The second invocation
resumes (``--resume auto``) from step 5 to step 8. The store then holds one run with every step
1..8 exactly once, at the values the run's own metrics.csv holds, and the job's whole resolved
configuration and the plan as params.

W&B (offline mode): the offline run directory is created under the run directory, and its
records hold the job's configuration, the plan and the logged steps.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shardwise.config import TrainJobConfig, flatten
from tests.forkrun import run_phases

TINY = [
    "--nproc",
    "1",
    "--model.layers=1",
    "--model.hidden=32",
    "--model.heads=2",
    "--model.seq_len=16",
    "--data.max_chars=20000",
    "--train.global_batch_size=4",
    "--train.warmup_steps=2",
    "--train.eval_every=0",
    "--train.eval_windows=4",
    "--sample.chars=0",
    "--train.log_every=1",
    "--checkpoint.every_n_steps=3",
]


ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_SILENT": "true"}


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str


def _job(cwd: Path, name: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "id": name,
        "kind": "shardwise",
        "argv": ["train", *TINY, *args],
        "cwd": str(cwd),
        "env": {**ENV, **(env or {})},
        "stdout": str(cwd / f"{name}.out"),
        "stderr": str(cwd / f"{name}.err"),
        "timeout_s": 240,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The three invocations, as `python -m shardwise train` runs them but forked from one process
    that imported torch and shardwise once (tests.forkrun): the MLflow run's first invocation (with
    its restart) beside the W&B run, then the MLflow run's resume."""
    mlflow_dir, wandb_dir = tmp_path_factory.mktemp("mlflow"), tmp_path_factory.mktemp("wandb")
    store = (mlflow_dir / "mlruns").as_uri()
    mlflow = ["--run.name=tracked", "--log.tracker", "mlflow", "--log.tracking_uri", store, "--log.experiment", "cli"]
    phases = [
        [
            _job(
                mlflow_dir,
                "first",
                *mlflow,
                "--max-steps",
                "5",
                "--max-restarts",
                "1",
                env={"SHARDWISE_FAULT": "rank=0,step=3,how=raise"},
            ),
            _job(
                wandb_dir,
                "wandb",
                "--run.name=wb",
                "--max-steps",
                "2",
                "--log.tracker",
                "wandb",
                "--log.wandb_mode",
                "offline",
                "--log.experiment",
                "cli",
                env={"WANDB_MODE": "online"},
            ),
        ],  # the option wins over the environment
        [_job(mlflow_dir, "second", *mlflow, "--max-steps", "8", "--resume", "auto")],
    ]
    results = run_phases(phases, env={"SHARDWISE_FAULT": None}, preload=("mlflow.tracking", "wandb"), timeout_s=600)
    done = {}
    for name, cwd in (("first", mlflow_dir), ("wandb", wandb_dir), ("second", mlflow_dir)):
        rc = results[name]["rc"]
        done[name] = Done(
            rc if isinstance(rc, int) else -9, (cwd / f"{name}.out").read_text(), (cwd / f"{name}.err").read_text()
        )
    return {"store": store, "mlflow_dir": mlflow_dir, "wandb_dir": wandb_dir, **done}


def _csv_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv") as fh:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(fh) if row.get("loss")}


@pytest.mark.timeout(600)
def test_mlflow_run_survives_a_restart_and_a_resume(runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    from mlflow.tracking import MlflowClient

    store, tmp_path, first, second = runs["store"], runs["mlflow_dir"], runs["first"], runs["second"]
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "injected fault" in first.stdout + first.stderr  # the restart happened
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "checkpoint: resumed from step 5" in second.stdout

    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("cli").experiment_id])
    assert len(runs) == 1, [(r.info.run_name, r.info.status) for r in runs]  # the restart and the resume continued it
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 9))  # every step once: 1, 2 not again after the restart
    # steps 1 and 2 are the first attempt's values, the rest the restarted attempt's and the resumed
    # run's; metrics.csv holds the restarted attempt's 1..5: the restart is exact, so they agree
    assert {m.step: m.value for m in history} == pytest.approx(_csv_losses(tmp_path / "runs" / "tracked"), rel=1e-6)

    params = run.data.params
    config = flatten(TrainJobConfig())
    assert set(config) <= set(params)  # the whole resolved configuration
    assert (
        params["parallel.plan"] == "dp=1" and params["shardwise.plan"] == "dp=1"
    )  # the plan the command resolved, and the run's
    assert params["log.tracker"] == "mlflow" and params["run.name"] == "tracked" and params["model.hidden"] == "32"
    assert params["train.max_steps"] == "5"  # params are write-once: the resumed run added none it held


def _wandb_records(path: str) -> list[Any]:
    """The records of an offline W&B run file (``run-ID.wandb``): a LevelDB-style log (32 KiB
    blocks of chunks with a 7-byte header: crc, length, type full/first/middle/last) after a 7-byte
    file header, each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block = Path(path).read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or the last chunk of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.timeout(300)
def test_wandb_offline_run_holds_the_configuration(runs: dict[str, Any]) -> None:
    tmp_path, done = runs["wandb_dir"], runs["wandb"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "wb"
    state = json.loads((run_dir / "wandb_run.json").read_text())
    offline = glob.glob(str(run_dir / "wandb" / f"offline-run-*-{state['id']}" / f"run-{state['id']}.wandb"))
    assert len(offline) == 1 and state["last_step"] == 2, (state, os.listdir(run_dir / "wandb"))
    records = _wandb_records(offline[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "cli" and run.display_name == "wb" and run.run_id == state["id"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert set(flatten(TrainJobConfig())) <= set(config)  # the whole resolved configuration
    assert (
        config["parallel.plan"] == "dp=1"
        and config["shardwise.plan"] == "dp=1"
        and config["log.wandb_mode"] == "offline"
    )
    assert config["model.hidden"] == 32 and config["train.max_steps"] == 2 and config["run.name"] == "wb"
    steps = [
        int(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "history"
        for item in r.history.item
        if list(item.nested_key) == ["_step"]
    ]
    assert steps == [1, 2]
