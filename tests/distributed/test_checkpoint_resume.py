"""Exact resume: 40 steps straight == 20 steps, save, lose everything, load, 20 more (bitwise).

The interrupted half throws its objects away and the resumed half starts from a different model
init and different RNG seeds, so every bit of the final state must come from the checkpoint.
(The real SIGKILL variant, through ``shardwise run``, is tests/integration/test_recovery_run.py.)
"""

from __future__ import annotations

import pytest
import torch

from shardwise.errors import ConfigError
from tests.distributed.test_checkpoint_workload import Job

TOTAL, CUT = 40, 20


def straight_vs_resumed(layout: str, directory: str, async_save: bool) -> tuple[dict, dict, list[int], list[int]]:
    straight = Job(layout, seed=0)
    straight.train_to(TOTAL)

    first = Job(layout, seed=0)
    manager = first.manager(directory, async_save=async_save, every_n_steps=10)
    first.train_to(CUT + 3, manager=manager, save_every=10)  # the 3 steps after the save are "lost"
    manager.wait()
    del first

    resumed = Job(layout, seed=1)
    loaded = resumed.manager(directory).load(resumed.components())
    assert loaded is not None and loaded.step == CUT and not loaded.resharded
    resumed.train_to(TOTAL)
    return straight.full_state(), resumed.full_state(), straight.seen, resumed.seen


def _assert_bitwise(results: list) -> None:
    for straight, resumed, seen_straight, seen_resumed in results:
        assert straight.keys() == resumed.keys()
        for key in straight:
            assert torch.equal(straight[key], resumed[key]), key
        # the resumed rank read exactly the tail of what the straight rank read
        assert seen_straight[-len(seen_resumed):] == seen_resumed


@pytest.mark.parametrize("layout,async_save", [("dp2", True), ("zero1", False), ("zero3", False), ("tp2", True)])
def test_resume_bitwise(dist2, tmp_path_factory, layout, async_save):
    directory = str(tmp_path_factory.mktemp(f"resume-{layout}"))
    _assert_bitwise(dist2.run(straight_vs_resumed, layout, directory, async_save))


def test_resume_bitwise_single_process(tmp_path):
    _assert_bitwise([straight_vs_resumed("single", str(tmp_path), True)])


def save_dp2(directory: str) -> None:
    job = Job("dp2", seed=0)
    job.train_to(2)
    job.manager(directory).save(job.components(), step=2)


def load_dp2_error(directory: str) -> str:
    job = Job("dp2", seed=1)
    try:
        job.manager(directory).load(job.components())
    except ConfigError as err:
        return str(err)
    return "loaded"


def test_replaced_shard_of_another_rank_is_one_line_on_every_rank(dist2, tmp_path):
    """DCP wraps a rank's read error into a CheckpointException on every rank (its text is each
    rank's traceback); the user sees the refused file's one-line error instead."""
    from tests.unit.test_checkpoint_safety import replace_with_pickle_bomb

    dist2.run(save_dp2, str(tmp_path / "ckpt"))
    step_dir = str(tmp_path / "ckpt" / "step_00000002")
    replace_with_pickle_bomb(step_dir, "__1_0.distcp", str(tmp_path / "pwned"))
    messages = dist2.run(load_dp2_error, str(tmp_path / "ckpt"))
    for message in messages:
        assert message.startswith(f"checkpoint file {step_dir}/__1_0.distcp ") and "\n" not in message, message
    assert not (tmp_path / "pwned").exists()
