"""MLflow and W&B loggers through the Trainer on 2 processes, offline (a local MLflow file store,
W&B offline mode), with a restart: the first attempt trains 7 steps with a checkpoint every 3 and
stops without a final save (as a crash would, after step 7 was logged); the second resumes from
step 6 and trains to step 10. The MLflow store then holds one run (rank 0 only logs) that holds
every step 1..10 exactly once, the redone step 7 with the value the first attempt logged, the plan
and the planner's predicted step time with the measured/predicted ratio; W&B continued the same
run id."""

from __future__ import annotations

import glob
import json
import os

import torch

from tests.distributed.test_trainer_clip import Record


def fit_tracked(run_dir: str, store: str, max_steps: int) -> list[float]:
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 keeps the file store behind this switch
    os.environ["WANDB_MODE"], os.environ["WANDB_SILENT"] = "offline", "true"
    from torch.utils.data import TensorDataset

    from shardwise.checkpoint import CheckpointManager
    from shardwise.checkpoint.callback import CheckpointCallback
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.train import LoggingOptions, ParallelOptions, TrainOptions, Trainer
    from shardwise.train.trackers import MLflowLogger, WandbLogger

    tokens = torch.randint(0, 16, (64, 9), generator=torch.Generator().manual_seed(0))
    rec = Record()
    trainer = Trainer(
        GPT(GPTConfig(vocab_size=16, seq_len=8, layers=2, hidden=16, heads=2), seed=0),
        loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        plan="auto",
        global_batch_size=8,
        train=TrainOptions(max_steps=max_steps, seed=7),
        parallel=ParallelOptions(cluster="cpu"),
        logging=LoggingOptions(
            log_every=1,
            progress_bar=False,
            run_dir=run_dir,
            loggers=[MLflowLogger(store, experiment="tracked", config={"lr": 0.1}), WandbLogger(project="tracked")],
        ),
        callbacks=[rec],
        checkpoint=CheckpointCallback(
            CheckpointManager(os.path.join(run_dir, "ckpt"), every_n_steps=3), save_on_fit_end=False
        ),
    )
    trainer.fit(TensorDataset(tokens[:, :-1], tokens[:, 1:]), resume="auto")
    return rec.losses


def test_mlflow_holds_every_step_once_after_a_restart(dist2, tmp_path) -> None:
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient

    run_dir, store = str(tmp_path / "run-a"), (tmp_path / "mlruns").as_uri()
    first = dist2.run(fit_tracked, run_dir, store, 7)[0]
    second = dist2.run(fit_tracked, run_dir, store, 10)[0]
    assert len(first) == 7 and len(second) == 4  # steps 7..10 after the resume from step 6

    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("tracked")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # rank 0 only, and the restart continued it
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 11))
    by_step = {m.step: m.value for m in history}
    assert [by_step[s] for s in range(1, 8)] == first and [by_step[s] for s in range(8, 11)] == second[1:]
    assert by_step[7] == second[0]  # the redone step: the resume is exact, so nothing was lost by skipping it
    params = run.data.params
    assert params["lr"] == "0.1" and params["shardwise.world_size"] == "2" and params["shardwise.plan"]
    predicted = float(params["shardwise.predicted_step_time_s"])
    ratios = client.get_metric_history(run.info.run_id, "step_time_ratio")
    measured = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "step_time_s")}
    assert len(ratios) == 10 and all(abs(r.value - measured[r.step] / predicted) < 1e-6 * r.value for r in ratios)

    # W&B (offline): both attempts wrote the same run id; the id file holds the newest step
    state = json.loads((tmp_path / "run-a" / "wandb_run.json").read_text())
    offline = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*")))
    assert len(offline) == 2 and all(d.endswith(state["id"]) for d in offline) and state["last_step"] == 10
