"""shardwise.init / barrier / main_process_first / rank-aware logging on real processes."""

from __future__ import annotations

import logging
import os
import time

import torch.distributed as dist

import shardwise
from shardwise.runtime.logging import setup_logging
from shardwise.testing import WorkerPool


def _init_is_idempotent() -> tuple:
    env = shardwise.init()
    again = shardwise.init()
    return env.rank, env.world_size, env.backend, str(env.device), env.launcher, env == again, env.is_main


def test_init_in_a_formed_world(dist2: WorkerPool) -> None:
    assert dist2.run(_init_is_idempotent) == [
        (0, 2, "gloo", "cpu", "torchrun", True, True),
        (1, 2, "gloo", "cpu", "torchrun", True, False),
    ]


def _main_first(path: str) -> float:
    env = shardwise.init()
    with shardwise.main_process_first(env):
        if env.is_main:
            time.sleep(0.5)
            with open(path, "w") as fh:
                fh.write("prepared")
        seen = open(path).read() if os.path.exists(path) else ""
        done = time.time()
    shardwise.barrier()
    return seen, done


def test_main_process_first_runs_rank_zero_first(dist2: WorkerPool, tmp_path) -> None:
    (seen0, t0), (seen1, t1) = dist2.run(_main_first, str(tmp_path / "cache.txt"))
    assert seen0 == seen1 == "prepared"  # rank 1 only entered after rank 0 had written the file
    assert t1 >= t0


def _log_lines(tmp: str) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    logger = setup_logging(rank, world)
    handler = logging.FileHandler(f"{tmp}/log{rank}.txt")
    for f in logger.handlers[0].filters:
        handler.addFilter(f)
    handler.setFormatter(logging.Formatter("%(rank_prefix)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    shardwise.get_logger("test").info("hello from %d", rank)
    shardwise.get_logger("test").warning("careful on %d", rank)
    handler.close()
    logger.removeHandler(handler)
    return open(f"{tmp}/log{rank}.txt").read().splitlines()


def test_info_from_rank_zero_warnings_from_all(dist2: WorkerPool, tmp_path) -> None:
    rank0, rank1 = dist2.run(_log_lines, str(tmp_path))
    assert rank0 == ["[rank 0/2] INFO hello from 0", "[rank 0/2] WARNING careful on 0"]
    assert rank1 == ["[rank 1/2] WARNING careful on 1"]
