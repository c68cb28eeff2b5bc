"""``shardwise train --resume auto``: a second invocation continues the first run's checkpoints."""

from __future__ import annotations

import os
import subprocess

import pytest

from shardwise.checkpoint import commit as cm
from tests.checkout import checkout_env
from tests.worker_forkserver import python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--nproc", "1", "--run.name=resumable", "--model.layers=1", "--model.hidden=32", "--model.heads=2",
         "--model.seq_len=16", "--data.max_chars=20000", "--train.global_batch_size=8", "--train.eval_every=0",
         "--train.eval_windows=8", "--sample.chars=0", "--checkpoint.every_n_steps=3", "--checkpoint.keep_last_n=5"]


def _train(runs: str, *extra: str) -> subprocess.CompletedProcess:
    env = checkout_env()
    return subprocess.run(python("-m", "shardwise", "train", f"--run.runs_dir={runs}", *SMALL, *extra, env=env),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.timeout(900)
def test_train_resume_auto_continues_from_the_newest_checkpoint(tmp_path):
    runs = str(tmp_path)
    first = _train(runs, "--max-steps", "4")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "nothing to resume" not in first.stdout  # resume is off by default
    ckpts = os.path.join(runs, "resumable", "checkpoints")
    assert [c.step for c in cm.list_checkpoints(ckpts) if c.complete] == [3, 4]  # every 3 steps + the end of fit
    second = _train(runs, "--max-steps", "7", "--resume", "auto")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "checkpoint: resumed from step 4" in second.stdout
    assert cm.latest_complete(ckpts).step == 7
