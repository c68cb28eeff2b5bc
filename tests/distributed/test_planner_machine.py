"""plan="auto" measures the machine once per job shape, in the job's own world, and caches it."""

from __future__ import annotations

import json
import os
import time

import pytest

from shardwise.plan.cluster import ClusterSpec
from shardwise.auto.machine import cache_path, load_cached, save_cached


def machine_spec_twice(cache_dir: str) -> dict:
    """``machine_spec`` twice with an empty cache ``cache_dir`` (its own: the suite's cache may hold
    a spec of this job shape already, from another test's calibration)."""
    import dataclasses

    import torch

    from shardwise.runtime.env import init
    from shardwise.auto.machine import machine_spec

    env = init()
    env = dataclasses.replace(env, settings=dataclasses.replace(env.settings, cache_dir=cache_dir))
    assert not os.listdir(cache_dir)
    start = time.perf_counter()
    first = machine_spec(env)
    middle = time.perf_counter()
    second = machine_spec(env)
    end = time.perf_counter()
    path = cache_path(
        env.settings.cache_dir, world_size=env.world_size, device_type="cpu", threads=torch.get_num_threads()
    )
    return {"first": first.to_dict(), "second": second.to_dict(), "first_s": middle - start, "second_s": end - middle,
            "path": path, "exists": os.path.exists(path)}


@pytest.mark.slow_allowed(
    seconds=150, why="plan='auto' measures the whole machine once (about 45 s on two idle cores), then reads the cache"
)
@pytest.mark.timeout(480)
def test_machine_spec_is_measured_in_the_world_and_then_read_from_the_cache(dist2, tmp_path) -> None:
    results = dist2.run(machine_spec_twice, str(tmp_path), timeout_s=420)  # a whole calibration, then the cache
    for got in results:
        assert got["exists"] and got["first"] == got["second"]  # every rank plans with rank 0's file
        assert got["second_s"] < 2.0 < got["first_s"]  # measured once, then read, not measured again
    spec = ClusterSpec.from_dict(results[0]["first"])
    assert spec.devices == 2 and spec.device_type == "cpu" and spec.optimizer_param_s > 0
    assert spec.block_flops("fp32", 200.0) and spec.oversubscription >= 1.0
    assert load_cached(results[0]["path"]) == spec


def test_cache_files_are_written_atomically_and_bad_ones_are_ignored(tmp_path) -> None:
    from shardwise.plan.cluster import resolve

    path = cache_path(str(tmp_path), world_size=4, device_type="cpu", threads=1)
    assert path.startswith(str(tmp_path)) and "4xcpu-1t" in path
    assert load_cached(path) is None
    spec = resolve("cpu", devices=4)
    save_cached(spec, path)
    assert load_cached(path) == spec and os.listdir(tmp_path) == [os.path.basename(path)]
    with open(path, "w") as fh:
        json.dump({"shardwise_cluster": 1, "old_key": 1}, fh)
    assert load_cached(path) is None  # an unreadable or older format is measured again
