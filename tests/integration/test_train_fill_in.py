"""`shardwise train --plan tp=2,pp=2 --nproc 4` end to end: the plan names two degrees, the command
fills in the rest (dp=1, one microbatch per stage) and trains on 4 Gloo processes, matching one
process. The other short spellings (`zero=3`, `dp=2,pp=2`, `tp=2`) resolve the same way
(tests/unit/test_plan_fill_in.py); one real run keeps the suite's time small."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from tests.worker_forkserver import python

TINY = [
    "--max-steps", "4",
    "--model.layers=2", "--model.hidden=32", "--model.heads=2", "--model.seq_len=32",
    "--data.max_chars=20000", "--train.global_batch_size=8", "--train.warmup_steps=2",
    "--train.eval_every=4", "--train.log_every=2", "--sample.chars=20",
]


def _shardwise(args: list[str], cwd: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        python("-m", "shardwise.cli", *args, env=env),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(600)
def test_tp_and_pp_named_alone_train_on_four_processes(tmp_path) -> None:
    four = _shardwise(["train", "--nproc", "4", "--plan", "tp=2,pp=2", "--run.name=tp2pp2", *TINY], str(tmp_path))
    assert four.returncode == 0, four.stdout[-3000:] + four.stderr[-3000:]
    assert "plan (dp=1,tp=2,pp=2, 4 processes)" in four.stdout and "2, 1f1b, 2 microbatches" in four.stdout
    summary = json.loads((tmp_path / "runs" / "tp2pp2" / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == 4 and summary["plan"] == "dp=1,tp=2,pp=2"
    one = _shardwise(["train", "--nproc", "1", "--run.name=one", *TINY], str(tmp_path))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    single = json.loads((tmp_path / "runs" / "one" / "summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    assert summary["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
