"""Fault-tolerant replica groups without starting a process: the workers' variables, the launcher's
flag checks and the summary of the groups' events (the runs: tests/integration/test_ft.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.errors import ConfigError, LaunchError
from shardwise.launch.ft import FtOptions, summarize, worker_env
from shardwise.runtime.detect import RuntimeEnv
from shardwise.runtime.ft_env import ft_settings
from shardwise.runtime.settings import read_settings


def test_workers_read_what_the_launcher_sets() -> None:
    options = FtOptions(replicas=3, min_replicas=2, timeout_s=7, quorum_timeout_s=11)
    env = worker_env(options, 2, "127.0.0.1:29510", "/tmp/ft")
    ft = ft_settings(env)
    assert ft is not None and (ft.replica, ft.replicas, ft.min_replicas) == (2, 3, 2)
    assert (
        ft.lighthouse == "http://127.0.0.1:29510"
        and (ft.timeout_s, ft.quorum_timeout_s) == (7, 11)
        and ft.events_dir == "/tmp/ft"
    )
    runtime = RuntimeEnv("torchrun", 0, 1, 0, 1, 0, 1, settings=read_settings(env))
    assert (runtime.replica, runtime.replicas) == (2, 3)
    plain = RuntimeEnv("none", 0, 1, 0, 1, 0, 1, settings=read_settings({}))
    assert (plain.replica, plain.replicas, plain.settings.ft) == (0, 1, None)


@pytest.mark.parametrize("env, words", [
    ({"SHARDWISE_FT_LIGHTHOUSE": "h:1", "SHARDWISE_FT_REPLICA": "2", "SHARDWISE_FT_REPLICAS": "2"}, "outside 0..1"),
    ({"SHARDWISE_FT_LIGHTHOUSE": "h:1", "SHARDWISE_FT_REPLICAS": "two"}, "not a whole number"),
    ({"SHARDWISE_FT_LIGHTHOUSE": "h:1", "SHARDWISE_FT_TIMEOUT": "-3"}, "positive number of seconds"),
])
def test_bad_variables_are_one_line(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ft_settings(env)


@pytest.mark.parametrize("options, words", [
    (FtOptions(replicas=0), "at least 1"),
    (FtOptions(replicas=2, replica_id=2, lighthouse="h:1"), "outside 0..1"),
    (FtOptions(replicas=2, replica_id=1), "needs --lighthouse"),
    (FtOptions(replicas=2, min_replicas=3), "--ft-min-replicas 3"),
    (FtOptions(replicas=2, timeout_s=0), "--ft-timeout 0 must be positive"),
])
def test_bad_flags_are_refused(options: FtOptions, words: str) -> None:
    with pytest.raises(LaunchError, match=words):
        options.check()


def test_the_watchdog_must_outlast_torchfts_timeouts() -> None:
    options = FtOptions(replicas=2, timeout_s=30, quorum_timeout_s=60)
    options.check_hang_timeout(None)
    options.check_hang_timeout(120)
    with pytest.raises(LaunchError, match="shorter than torchft's quorum and collective timeouts"):
        options.check_hang_timeout(100)


def _events(path: Path, replica: int, rows: list[tuple[float, str, dict]]) -> None:
    with open(path / f"replica{replica}.jsonl", "w") as fh:
        for t, event, extra in rows:
            fh.write(
                json.dumps({"t": t, "event": event, "replica": replica, "pid": extra.pop("pid", 10 + replica), **extra})
                + "\n"
            )


def test_summary_counts_discards_heals_and_seconds_lost(tmp_path: Path) -> None:
    # group 0: commits every second, one discarded step between 3 and 9 s (6 s gap, median 1 s: 5 s lost)
    _events(tmp_path, 0, [(1.0, "commit", {"step": 1}), (2.0, "commit", {"step": 2}), (3.0, "commit", {"step": 3}),
                          (4.0, "discarded", {"step": 4}), (9.0, "commit", {"step": 4, "samples_skipped": 4}),
                          (10.0, "commit", {"step": 5, "samples_skipped": 4})])
    # group 1: synced at step 0 (not a heal), killed, back in a new process healed at step 4
    _events(
        tmp_path,
        1,
        [
            (0.5, "healed", {"step": 0}),
            (1.0, "commit", {"step": 1}),
            (9.5, "healed", {"step": 4, "pid": 99}),
            (10.0, "commit", {"step": 5, "pid": 99}),
        ],
    )
    summary = summarize(str(tmp_path), replicas=2, codes=[0, 0])
    assert summary["committed_steps"] == 5 and summary["discarded_steps"] == 1 and summary["healed_replicas"] == 1
    assert summary["seconds_lost"] == pytest.approx(5.0) and summary["samples_skipped"] == 8
    assert summary["groups"][1]["processes"] == 2 and summary["groups"][0]["processes"] == 1


def test_the_core_never_imports_torchft() -> None:
    import subprocess
    import sys

    code = (
        "import sys, shardwise.train.trainer, shardwise.launch.run, shardwise.cli; assert 'torchft' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0
