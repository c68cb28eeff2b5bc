"""``shardwise train`` end to end through the command line: 2 processes, outputs, exit codes.

The end-to-end runs fork from one process that imported torch and shardwise once
(:func:`tests.forkrun.shardwise_command`: what the subprocess returns, without the command's
imports; its workers start as usual); the refused override runs ``python -m shardwise.cli`` as a
fresh interpreter (its one stderr line is the whole of what the real command prints)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from typing import Iterator

import pytest

from shardwise.plan import Plan
from tests.forkrun import Zygote, shardwise_command
from tests.worker_forkserver import python

TINY = [
    "--max-steps", "6",
    "--model.layers=1", "--model.hidden=32", "--model.heads=2", "--model.seq_len=32",
    "--data.max_chars=20000", "--train.global_batch_size=8", "--train.warmup_steps=2",
    "--train.eval_every=3", "--train.log_every=2", "--sample.chars=40",
]


def _shardwise(args: list[str], cwd: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        python("-m", "shardwise.cli", *args, env=env),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    server = Zygote()
    yield server
    server.close()


@pytest.mark.slow_allowed(
    seconds=180,
    why="three whole `shardwise train` runs (dp=2, one process, tp=2) whose losses are "
    "compared end to end; 128 s alone on a 2-core VM in December 2026",
)
def test_train_two_processes_end_to_end(tmp_path, zygote: Zygote) -> None:
    def forked(args: list[str], cwd: str) -> subprocess.CompletedProcess:
        return shardwise_command(
            zygote, args, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, cwd=cwd, timeout=240
        )

    two = forked(["train", "--nproc", "2", "--run.name=two", *TINY], str(tmp_path))
    assert two.returncode == 0, two.stdout + two.stderr
    run_dir = tmp_path / "runs" / "two"
    for name in ("metrics.csv", "curves.png", "config.toml", "summary.json", "sample.txt"):
        assert (run_dir / name).is_file(), name
    assert "plan (dp=2, 2 processes)" in two.stdout and "data parallel" in two.stdout
    assert "validation loss" in two.stdout and "unigram entropy" in two.stdout and "sample:" in two.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 2 and summary["plan"] == "dp=2"
    assert len(summary["sample"]) == len("def ") + 40
    with open(run_dir / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows if r.get("loss")] == [2, 4, 6]
    assert [int(r["step"]) for r in rows if r.get("val_loss")] == [3, 6]
    assert "max_steps = 6" in (run_dir / "config.toml").read_text()

    # The same job in one process (in-process path) gives the same losses: data parallelism
    # changes nothing in the math (same seed, same global batch).
    one = forked(["train", "--nproc", "1", "--run.name=one", *TINY], str(tmp_path))
    assert one.returncode == 0, one.stdout + one.stderr
    single = json.loads((tmp_path / "runs" / "one" / "summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    assert summary["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)

    # Tensor parallel over the same 2 processes: the model code is unchanged (the attention infers
    # its local heads), the vocabulary is padded for the split, and the sample is generated with
    # the sharded logits gathered. TP adds partial matmul results in another order than one
    # process, so the agreement is to float32 rounding (measured: ~5e-8 relative), not bitwise.
    tp = forked(["train", "--nproc", "2", "--plan", "tp=2", "--run.name=tp", *TINY], str(tmp_path))
    assert tp.returncode == 0, tp.stdout + tp.stderr
    assert "plan (dp=1,tp=2, 2 processes)" in tp.stdout
    tensor = json.loads((tmp_path / "runs" / "tp" / "summary.json").read_text())
    assert tensor["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    assert tensor["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)

    # The planner picks (with this machine's measured spec: cached by an earlier test's world of 2,
    # or measured now), prints the plan and saves its choice with the predictions; whatever it picks
    # trains like one process.
    auto = forked(["train", "--nproc", "2", "--plan", "auto", "--run.name=auto", *TINY], str(tmp_path))
    assert auto.returncode == 0, auto.stdout + auto.stderr
    assert "plan=auto chose" in auto.stdout + auto.stderr
    chosen = json.loads((tmp_path / "runs" / "auto" / "auto_plan.json").read_text())
    planned = json.loads((tmp_path / "runs" / "auto" / "summary.json").read_text())
    assert str(Plan.from_dict(chosen["plan"])) == planned["plan"] and chosen["prediction"]["step_time_s"] > 0
    assert planned["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    assert len(tensor["sample"]) == len("def ") + 40


def test_bad_override_through_the_real_command_is_one_line_and_exit_code_2(tmp_path) -> None:
    result = _shardwise(["train", "--train.lrr=1"], str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--train.lrr=1" in lines[0] and "error" in lines[0], result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "args, key",
    [
        (["--train.lr=fast"], "'train.lr'"),
        (["--model.layers", "0"], "'model.layers'"),
        (["--nproc", "3", "--train.global_batch_size=8"], "'train.global_batch_size'"),
        (["--nproc", "two"], "'parallel.nproc'"),
        (["--nproc", "2", "--plan", "dp=3"], "uses 3 processes"),
        (["--config", "missing.toml"], "missing.toml"),
    ],
)
def test_bad_values_are_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys, args: list[str], key: str) -> None:
    from shardwise.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and lines[0].startswith("shardwise train: error:"), lines
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_print_config_round_trips(tmp_path, monkeypatch, capsys) -> None:
    from shardwise.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--print-config", "--train.lr=0.01", "--max-steps", "3"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "run.toml").write_text(printed)
    assert main(["train", "--print-config", "--config", "run.toml"]) == 0
    again = capsys.readouterr().out
    assert again == printed and "lr = 0.01" in again and "max_steps = 3" in again
