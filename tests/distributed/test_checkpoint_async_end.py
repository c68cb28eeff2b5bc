"""The async-save hang at the end of training (issue: 4 of 7 runs hung when the last step was also a
scheduled async save).

Cause: at the end of ``fit`` each rank asked its manager whether the last save had committed, and
the writer thread sets that value at a different moment on each rank; a rank that saw "not yet"
saved again and waited in a broadcast the others never joined. Now the decision uses
``last_saved``, which the training thread sets on every rank once all ranks entered the save.

The test makes the race certain instead of likely: one rank's writer thread commits late (sleeps
before it seals the step), on rank 0, on rank 1 and on neither, several times over, in one pool of
2 real Gloo processes. With the old decision the slow rank enters a save alone: it waits in a
collective the other rank never joins (or, if the other rank's next collective happens to pair
with it, they exchange the wrong messages), so the test counts each rank's saves as well as the
outcome: every rank enters exactly the saves of steps 3 and 6, every fit ends, the last step is
committed when ``fit`` returns and ``last_saved`` is the same on both ranks. The issue's own
configuration through ``shardwise train``, many runs in a row: bench/async_end_stress.py.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.checkpoint import CheckpointManager
from shardwise.checkpoint import commit as cm
from shardwise.train import LoggingOptions, TrainOptions, Trainer
from tests.helpers import make_data, sgd

STEPS, EVERY = 6, 3  # the last step is a scheduled save
ROUNDS = 3


def fit_ending_on_an_async_save(directory: str, slow_rank: int | None, delay_s: float) -> dict:
    manager = CheckpointManager(directory, every_n_steps=EVERY, async_save=True, keep_last_n=2)
    if dist.get_rank() == slow_rank:
        commit = manager._commit

        def late_commit(path: str, info: dict) -> None:  # this rank's writer thread finishes last
            time.sleep(delay_s)
            commit(path, info)

        manager._commit = late_commit  # type: ignore[method-assign]
    saves: list[int] = []
    save = manager.save

    def counted_save(components, *, step, **kwargs):  # every rank must enter the same saves
        saves.append(step)
        return save(components, step=step, **kwargs)

    manager.save = counted_save  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    trainer = Trainer(model, loss_fn=F.cross_entropy, optimizer=sgd, plan="dp=2", global_batch_size=16,
                      train=TrainOptions(max_steps=STEPS, seed=3),
                      logging=LoggingOptions(log_every=1, progress_bar=False), checkpoint=manager)
    trainer.fit(make_data(64))
    newest = cm.latest_complete(directory)
    return {
        "step": trainer.step,
        "saves": saves,
        "last_saved": manager.last_saved,
        "last_committed": manager.last_committed,
        "newest": newest.step if newest else None,
        "in_flight": manager.in_flight(),
    }


@pytest.mark.timeout(300)
def test_async_save_on_the_last_step_never_hangs(dist2, tmp_path_factory):
    fits = 0
    for round_ in range(ROUNDS):
        for slow_rank in (0, 1, None):
            directory = str(tmp_path_factory.mktemp(f"r{round_}-slow{slow_rank}"))
            # 0.25 s late: the training thread checks within milliseconds of handing over the last save,
            # and the old decision fails with it (one extra save on the slow rank, or a hang)
            results = dist2.run(fit_ending_on_an_async_save, directory, slow_rank, 0.25, timeout_s=60)
            for r in results:
                assert r == {
                    "step": STEPS,
                    "saves": [EVERY, STEPS],
                    "last_saved": STEPS,
                    "last_committed": STEPS,
                    "newest": STEPS,
                    "in_flight": False,
                }, r
            fits += 1
    assert fits == 3 * ROUNDS
