"""Single-process tests of the observability pieces: watchdog settings and diagnosis, the step
profiler's arithmetic, straggler detection, overlap arithmetic, and the PNG plots."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from shardwise.cli import build_parser
from shardwise.launch.options import hang_timeout_env
from shardwise.errors import ConfigError, LaunchError
from shardwise.observe.deep import _intersect, _union
from shardwise.runtime.hang_report import Heartbeat, InFlight, Stall, diagnose, verdict
from shardwise.observe.plots import (
    PipelineEvent,
    bubble_fraction,
    plot_bandwidth,
    plot_pipeline_schedule,
    plot_timeline,
)
from shardwise.observe.profiler import StepProfiler, StepTimes
from shardwise.observe.stragglers import RankSummary, find_stragglers, format_table, summarize
from shardwise.runtime.settings import DEFAULT_HANG_TIMEOUT_S, hang_timeout as hang_timeout_from_env
from shardwise.runtime.watchdog import enable_flight_recorder


# -- watchdog settings ------------------------------------------------------------------------
def test_hang_timeout_from_env() -> None:
    assert hang_timeout_from_env({}) == DEFAULT_HANG_TIMEOUT_S < 30 * 60
    assert hang_timeout_from_env({"SHARDWISE_HANG_TIMEOUT": "45"}) == 45.0
    assert hang_timeout_from_env({"SHARDWISE_HANG_TIMEOUT": "off"}) == 0.0
    with pytest.raises(ConfigError, match="not a number"):
        hang_timeout_from_env({"SHARDWISE_HANG_TIMEOUT": "soon"})
    with pytest.raises(ConfigError, match="negative"):
        hang_timeout_from_env({"SHARDWISE_HANG_TIMEOUT": "-1"})


def test_flight_recorder_variables() -> None:
    env: dict[str, str] = {}
    enable_flight_recorder(env, "gloo")
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000"}
    env = {"TORCH_NCCL_DESYNC_DEBUG": "0"}
    enable_flight_recorder(env, "nccl")
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DESYNC_DEBUG"] == "0"  # the user's choice is kept


def test_hang_timeout_flag_reaches_the_workers_env(tmp_path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    args = build_parser().parse_args(["run", "--hang-timeout", "20", str(script)])
    assert hang_timeout_env(args.hang_timeout) == {"SHARDWISE_HANG_TIMEOUT": "20"}
    assert hang_timeout_env(build_parser().parse_args(["run", str(script)]).hang_timeout) == {}
    with pytest.raises(LaunchError):
        hang_timeout_env(build_parser().parse_args(["run", "--hang-timeout", "-3", str(script)]).hang_timeout)


# -- hang diagnosis ---------------------------------------------------------------------------
AR = InFlight(pg="0", seq=7, op="all_reduce", sizes=((272,),), dtypes=("Float",), age_s=31.0)


def _beat(rank: int, *, t: float = 100.0, issued: int = 7, state: str = "running", flights=()) -> Heartbeat:
    return Heartbeat(
        rank=rank, host="h", pid=10 + rank, time=t, state=state, step=3, issued={"0": issued}, in_flight=tuple(flights)
    )


def test_heartbeat_json_round_trip() -> None:
    beat = _beat(2, flights=(AR,))
    assert Heartbeat.from_json(beat.to_json()) == beat


def test_diagnose_names_each_kind_of_culprit() -> None:
    stall = Stall(0, "collective", 31.0, AR)
    other = InFlight(pg="0", seq=7, op="broadcast", sizes=((4,),), age_s=30.0)
    beats = {
        0: _beat(0, flights=(AR,)),
        1: _beat(1, flights=(AR,)),  # arrived
        2: _beat(2, issued=6),  # behind
        3: _beat(3, t=60.0, issued=6),  # frozen (stale heartbeat)
        4: _beat(4, flights=(other,)),  # mismatch
        5: _beat(5, issued=6, state="finished"),
        6: None,
    }
    culprits = diagnose(stall, beats, now=101.0, stale_s=10.0, world_size=7)
    assert [(c.rank, c.reason) for c in culprits] == [
        (2, "behind"),
        (3, "frozen"),
        (4, "mismatch"),
        (5, "finished"),
        (6, "silent"),
    ]
    text = verdict(stall, culprits)
    assert "Stuck rank(s): 2, 3, 4, 5, 6." in text and "all_reduce #7 on group 0 (shapes [272] Float)" in text
    assert "has issued only 6 collectives" in text and "no heartbeat for 41 s" in text


def test_diagnose_everyone_arrived_and_subgroups() -> None:
    stall = Stall(0, "collective", 31.0, AR, group_ranks=(0, 2))
    beats = {0: _beat(0), 1: _beat(1, issued=0), 2: _beat(2, flights=(AR,))}
    assert diagnose(stall, beats, now=101.0, stale_s=10.0, world_size=3) == []  # rank 1 is not in the group
    assert "transport itself is stuck" in verdict(stall, [])


def test_step_stall_names_itself() -> None:
    stall = Stall(1, "step", 40.0, step=12)
    culprits = diagnose(stall, {0: _beat(0, flights=(AR,)), 1: _beat(1)}, now=101.0, stale_s=10.0, world_size=2)
    assert [(c.rank, c.reason) for c in culprits] == [(1, "self")]


# -- profiler ----------------------------------------------------------------------------------
def test_profiler_splits_a_step_into_phases() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    model[0].register_forward_pre_hook(lambda *_: time.sleep(0.03))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = StepProfiler().attach(model, opt)
    opt.register_step_pre_hook(lambda *_: time.sleep(0.02))  # after attach: inside the optimizer phase
    try:
        data = [torch.randn(4, 8) for _ in range(3)]
        for step, x in enumerate(prof.loader(_slow(data, 0.01)), 1):
            model(x).sum().backward()
            opt.step()
            time.sleep(0.015)  # loop overhead: idle
            prof.end_step(step)
    finally:
        prof.detach()
    assert len(prof.records) == 3
    for rec in prof.records:
        assert rec.data_s >= 0.009 and rec.forward_s >= 0.029 and rec.backward_s > 0 and rec.optimizer_s >= 0.019
        assert 0.014 <= rec.idle_s < 0.05 and rec.comm_s == {}
        parts = rec.data_s + rec.forward_s + rec.backward_s + rec.optimizer_s + rec.idle_s
        assert parts == pytest.approx(rec.total_s, rel=1e-6)
        assert {k for k, _, _ in rec.segments} >= {"data", "forward", "backward"}


def _slow(items, delay):
    for item in items:
        time.sleep(delay)
        yield item


def test_phase_names_are_checked() -> None:
    with pytest.raises(ValueError):
        with StepProfiler().phase("lunch"):
            pass


# -- stragglers --------------------------------------------------------------------------------
def _summary(rank: int, forward: float, comm: float) -> RankSummary:
    return RankSummary(rank, f"node{rank}", 10, step_s=0.1, data_s=0.01, forward_s=forward, backward_s=0.02,
                       optimizer_s=0.005, idle_s=0.1 - 0.035 - forward - comm, comm_s={"all_reduce": comm})


def test_find_stragglers_uses_busy_time_not_wall_time() -> None:
    summaries = [_summary(0, 0.02, 0.04), _summary(1, 0.06, 0.0), _summary(2, 0.02, 0.04), _summary(3, 0.021, 0.039)]
    found = find_stragglers(summaries, threshold=0.2)
    assert [(s.rank, s.host, s.slow_at) for s in found] == [(1, "node1", "forward")]
    assert "rank 1 on node1 is a straggler" in found[0].describe()
    assert find_stragglers([_summary(0, 0.02, 0.04)]) == []
    assert "all_reduce" in format_table(summaries)


def test_summarize_means() -> None:
    recs = [StepTimes(step=i, total_s=0.1 * i, forward_s=0.05, comm_s={"all_reduce": 0.01}) for i in (1, 2)]
    s = summarize(recs, rank=3, host="h")
    assert (s.step_s, s.forward_s, s.comm_s) == (
        pytest.approx(0.15),
        pytest.approx(0.05),
        {"all_reduce": pytest.approx(0.01)},
    )


# -- deep-profile arithmetic and plots ---------------------------------------------------------
def test_interval_union_and_intersection() -> None:
    assert _union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    assert _intersect([(0, 3), (5, 6)], [(2, 5.5)]) == pytest.approx(1.5)


def test_plots_write_pngs(tmp_path) -> None:
    rec = StepTimes(
        step=1,
        total_s=0.1,
        start=0.0,
        segments=(("forward", 0.0, 0.03), ("backward", 0.03, 0.08), ("comm", 0.08, 0.09)),
    )
    assert _is_png(plot_timeline({0: [rec], 1: [rec]}, tmp_path / "t.png"))
    events = [PipelineEvent(s, m, "F", s + m, s + m + 1) for s in range(2) for m in range(2)]
    assert bubble_fraction(events) == pytest.approx(1 - 4 / (2 * 3))
    assert _is_png(plot_pipeline_schedule(events, tmp_path / "p.png"))

    class Row:
        def __init__(self, op, size, bw):
            self.op, self.size_bytes, self.busbw_gbps = op, size, bw

    assert _is_png(plot_bandwidth([Row("all_reduce", 1024, 0.1), Row("all_reduce", 4096, 0.3)], tmp_path / "b.png"))


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_finished_rank_that_skipped_a_collective_blames_itself() -> None:
    stall = Stall(1, "finish", 9.0, step=6)
    beats = {0: _beat(0, flights=(AR,)), 1: _beat(1, issued=6, state="finished"), 2: _beat(2, flights=(AR,))}
    culprits = diagnose(stall, beats, now=101.0, stale_s=10.0, world_size=3)
    assert [(c.rank, c.reason) for c in culprits] == [(1, "finished")]
    assert "but other ranks wait in all_reduce #7" in culprits[0].detail
    # Peers still computing (no collective in flight) are the ones behind.
    culprits = diagnose(
        stall, {0: _beat(0), 1: _beat(1, issued=7, state="finished")}, now=101.0, stale_s=10.0, world_size=2
    )
    assert [(c.rank, c.reason) for c in culprits] == [(0, "behind")]
