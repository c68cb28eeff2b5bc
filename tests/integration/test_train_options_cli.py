"""``shardwise train`` with the runtime options of a plan (issue 24): the plan string and the
``[parallel]`` keys reach the workers, and the options the planner chooses cannot be forced on
``auto`` (one line, exit 2, before any process starts)."""

from __future__ import annotations

import json

from tests.integration.test_train_cli import TINY, _shardwise


def test_train_with_the_runtime_options_on_2(tmp_path) -> None:
    # why over 30 s: one real 2-process job (the CLI, the launcher, 4 steps, evaluation, a sample)
    args = [
        "train",
        "--nproc",
        "2",
        "--run.name=lean",
        "--plan",
        "zero=3,chunked_loss",
        "--parallel.sharded_accumulation=true",
        "--parallel.params16=true",
        "--train.precision=bf16",
        "--train.grad_accum_steps=2",
        *TINY,
        "--max-steps",
        "4",
    ]
    done = _shardwise(args, str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "16-bit for compute, fp32 sharded masters" in done.stdout and "chunked over tokens" in done.stdout
    summary = json.loads((tmp_path / "runs" / "lean" / "summary.json").read_text())
    assert summary["plan"] == "dp=1,shard=2,zero=3,precision=bf16,params16,chunked_loss,sharded_accumulation"
    assert summary["steps"] == 4 and summary["val_loss"] < 5.0 and len(summary["sample"]) == len("def ") + 40


def test_runtime_options_are_not_forced_on_auto(tmp_path) -> None:
    done = _shardwise(["train", "--plan", "auto", "--parallel.chunked_loss=true", *TINY], str(tmp_path), timeout=60)
    assert done.returncode == 2
    assert "'parallel.chunked_loss' cannot be set with parallel.plan = 'auto'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()
    done = _shardwise(["train", "--nproc", "2", "--plan", "zero=3,params16", *TINY], str(tmp_path), timeout=60)
    assert done.returncode == 2 and "params16 needs a 16-bit precision" in done.stderr, done.stderr
