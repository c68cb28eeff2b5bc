"""Reshard on load: save on 4 processes, load on 2 under other plans and on 1 process.

Checks, for each pair of layouts: every parameter and optimizer state (Adam moments, step) and the
learning rate are equal after gathering to full tensors; the data position carries over so the
samples read after the resume are exactly the next ones of the epoch's order (none repeated,
none skipped) under the new data-parallel size; and training continues.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.data.sampler import ShardedSampler
from tests.distributed.test_checkpoint_workload import GLOBAL_BATCH, N_SAMPLES, Job

SAVED_AT = 5


def save_job(layout: str, directory: str) -> dict:
    job = Job(layout, seed=0)
    job.train_to(SAVED_AT)
    job.manager(directory).save(job.components(), step=SAVED_AT)
    return {"state": job.full_state(), "epoch": job.sampler.epoch, "consumed": job.sampler.consumed}


def load_job(layout: str, directory: str, more_steps: int) -> dict:
    job = Job(layout, seed=1)
    loaded = job.manager(directory).load(job.components())
    state = job.full_state()
    losses = job.train_to(SAVED_AT + more_steps)
    return {"state": state, "resharded": loaded.resharded, "step": loaded.step, "seen": job.seen, "losses": losses,
            "dp_size": job.dp_size}


def _check(saved: dict, loads: list[dict], more_steps: int) -> None:
    perm = ShardedSampler(N_SAMPLES, num_replicas=1, rank=0, seed=5).permutation(saved["epoch"])
    expected_next = perm[saved["consumed"] : saved["consumed"] + more_steps * GLOBAL_BATCH]
    seen_after = []
    for result in loads:
        assert result["step"] == SAVED_AT and result["resharded"]
        assert result["state"].keys() == saved["state"].keys()
        for key, value in saved["state"].items():
            assert torch.equal(result["state"][key], value), key
        assert all(math.isfinite(loss) for loss in result["losses"]) and len(result["losses"]) == more_steps
        seen_after.extend(result["seen"])
    dp_size = loads[0]["dp_size"]
    replicas = len(loads) // dp_size  # TP ranks read the same samples
    assert sorted(seen_after) == sorted(expected_next * replicas)


@pytest.mark.parametrize(
    "saved_layout,loaded_layout",
    [("zero3", "tp2"), ("zero3", "dp2"), ("dp4", "zero3"), ("zero1", "dp2"), ("dp4", "zero1")],
)
def test_save_on_4_load_on_2(dist4, dist2, tmp_path, saved_layout, loaded_layout):
    saved = dist4.run(save_job, saved_layout, str(tmp_path))[0]
    _check(saved, dist2.run(load_job, loaded_layout, str(tmp_path), 3), 3)


def test_save_on_4_load_on_1(dist4, tmp_path):
    saved = dist4.run(save_job, "zero3", str(tmp_path))[0]
    _check(saved, [load_job("single", str(tmp_path), 3)], 3)
