"""Elastic jobs without processes: re-planning for a changed world (``resolve.replan``), the
settings and launch variables that switch it on, and the lines the log prints."""

from __future__ import annotations

import pytest

from shardwise.errors import ConfigError, LaunchError
from shardwise.launch.options import RunOptions, parse_rdzv_conf, resolve
from shardwise.layout import Plan
from shardwise.resolve import replan, resolve_plan
from shardwise.runtime.settings import read_settings
from shardwise.train.elastic import Node, WorldRecord, describe_change, nodes_of, read_record, write_record


@pytest.mark.parametrize(
    ("plan", "world", "expected"),
    [
        ("dp=2,tp=2", 2, "dp=1,tp=2"),  # the example: keep tp, fill dp
        ("dp=2,tp=2", 8, "dp=4,tp=2"),  # regrown beyond the start
        ("dp=4", 3, "dp=3"),
        ("zero=3,shard=4", 2, "dp=1,shard=2,zero=3"),  # ZeRO-3 shards re-split over the survivors
        ("zero=3,dp=2,shard=2", 2, "dp=1,shard=2,zero=3"),  # HSDP keeps its shard group while it divides
        ("zero=3,dp=2,shard=2", 6, "dp=3,shard=2,zero=3"),
        ("zero=3,dp=2,shard=4", 6, "dp=1,shard=6,zero=3"),  # ...else everything is sharded
        ("tp=4,sp", 2, "dp=1,tp=2,sequence_parallel"),  # the part of tp that still divides (gcd)
        ("tp=2,sp", 3, "dp=3"),  # no tp left: no sequence parallel
        ("pp=2,dp=2,microbatches=4", 2, "dp=1,pp=2,microbatches=4"),
        ("pp=2,dp=2,microbatches=4", 3, "dp=3"),  # no pipeline left: one microbatch
        ("dp=2,tp=2,precision=bf16,recompute=full", 2, "dp=1,tp=2,recompute=full,precision=bf16"),
    ],
)
def test_replan_keeps_what_divides_and_fills_data_parallel(plan: str, world: int, expected: str) -> None:
    new = replan(Plan.parse(plan), world)
    assert new.world_size == world and str(new) == expected
    assert replan(new, world) is new  # a plan that fits is kept as it is


def test_resolve_plan_re_plans_only_when_elastic() -> None:
    with pytest.raises(ConfigError, match="uses 4 processes"):
        resolve_plan("dp=2,tp=2", 2)
    assert str(resolve_plan("dp=2,tp=2", 2, elastic=True)) == "dp=1,tp=2"
    assert str(resolve_plan("zero=3,shard=4", 2, elastic=True)) == "dp=1,shard=2,zero=3"
    assert str(resolve_plan(Plan(dp=2, tp=2), 1, elastic=True)) == "dp=1"
    assert resolve_plan("tp=2", 4, elastic=True) == Plan(dp=2, tp=2)  # unnamed degrees fill in as always
    with pytest.raises(ConfigError, match="cannot re-plan"):
        replan(Plan(), 0)


def test_elastic_setting_and_launch_variables(tmp_path) -> None:
    assert read_settings({}).elastic is None
    assert read_settings({"SHARDWISE_ELASTIC": "1:4"}).elastic == (1, 4)
    with pytest.raises(ConfigError, match="SHARDWISE_ELASTIC='4:1' is not MIN:MAX"):
        read_settings({"SHARDWISE_ELASTIC": "4:1"})
    script = tmp_path / "t.py"
    script.write_text("")
    elastic = resolve(RunOptions(script=str(script), nproc_per_node="1", nnodes="1:2", rdzv_endpoint="h:1", rdzv_id="j",
                                 rdzv_conf="last_call_timeout=5,is_host=1"), environ={})
    assert (
        elastic.worker_env["SHARDWISE_ELASTIC"] == "1:2"
        and elastic.worker_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    )
    assert elastic.config.rdzv_configs["last_call_timeout"] == "5" and elastic.config.rdzv_configs["is_host"] == "1"
    single = resolve(RunOptions(script=str(script), nproc_per_node="1"), environ={})
    assert (
        "SHARDWISE_ELASTIC" not in single.worker_env and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in single.worker_env
    )
    with pytest.raises(LaunchError, match="not key=value"):
        parse_rdzv_conf("last_call_timeout")


def test_attempt_namespace_ignores_per_node_restart_counts() -> None:
    """On a fresh per-round store (multi-node) two nodes whose agents counted restarts
    differently must still meet under the same prefix."""
    a = read_settings(
        {"TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    )
    b = read_settings(
        {"TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    )
    assert a.attempt_namespace == b.attempt_namespace == "j"
    shared = read_settings(
        {"TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    )
    assert shared.attempt_namespace == "j/2"


def _record(step: int, plan: str, nodes: tuple[Node, ...], dp: int) -> WorldRecord:
    return WorldRecord(
        run_id="j", world_size=sum(len(n.ranks) for n in nodes), plan=plan, dp_size=dp, step=step, nodes=nodes
    )


def test_the_log_says_who_was_lost_the_plans_and_the_steps_redone() -> None:
    a, b = Node("gpu-a", 100, (0, 1)), Node("gpu-b", 200, (2, 3))
    before = _record(14, "dp=2,tp=2", (a, b), dp=2)
    now = _record(0, "dp=1,tp=2", (a,), dp=1)
    assert describe_change(before, now, requested_plan="dp=2,tp=2", resumed_step=10, global_batch=8) == [
        "elastic: lost 1 node after step 14: gpu-b (ranks 2-3); 2 processes remain on 1 node",
        "elastic: plan dp=2,tp=2 (4 processes) -> dp=1,tp=2 (2 processes); global batch 8 kept (4 -> 8 samples per "
        "data-parallel rank)",
        "elastic: resumed from the checkpoint of step 10; steps 11-14 are redone",
    ]
    back = _record(0, "dp=2,tp=2", (a, Node("gpu-b", 300, (2, 3))), dp=2)
    lines = describe_change(
        _record(20, "dp=1,tp=2", (a,), dp=1), back, requested_plan="dp=2,tp=2", resumed_step=20, global_batch=8
    )
    assert lines[0] == "elastic: 1 node joined after step 20: gpu-b (ranks 2-3); 4 processes on 2 nodes"
    assert lines[-1] == "elastic: resumed from the checkpoint of step 20; no steps are redone"
    first = describe_change(None, now, requested_plan="dp=2,tp=2", resumed_step=None, global_batch=8)
    assert first == ["elastic: 2 processes on 1 node [gpu-a (ranks 0-1)], plan dp=1,tp=2 (re-planned from dp=2,tp=2)"]
    filled = describe_change(
        None, _record(0, "dp=1,shard=2,zero=3", (a,), dp=2), requested_plan="zero=3", resumed_step=None, global_batch=8
    )
    assert filled == [
        "elastic: 2 processes on 1 node [gpu-a (ranks 0-1)], plan dp=1,shard=2,zero=3"
    ]  # filled in, not re-planned
    lost_early = describe_change(_record(3, "dp=4", (a, b), dp=4), _record(0, "dp=2", (a,), dp=2), requested_plan="dp",
                                 resumed_step=None, global_batch=8)
    assert lost_early[-1] == "elastic: no checkpoint to resume: starting again from step 0; steps 1-3 are redone"


def test_nodes_of_groups_ranks_and_shared_hosts_show_the_agent() -> None:
    nodes = nodes_of([("h", 7), ("h", 7), ("h", 9), ("h", 9)])
    assert nodes == (Node("h", 7, (0, 1)), Node("h", 9, (2, 3)))
    before = _record(5, "dp=4", nodes, dp=4)
    line = describe_change(
        before, _record(0, "dp=2", nodes[:1], dp=2), requested_plan="dp", resumed_step=4, global_batch=8
    )[0]
    assert line == "elastic: lost 1 node after step 5: h (agent pid 9, ranks 2-3); 2 processes remain on 1 node"


def test_record_round_trip_and_other_runs_ignored(tmp_path) -> None:
    record = _record(7, "dp=2", (Node("h", 1, (0, 1)),), dp=2)
    write_record(str(tmp_path), record)
    assert read_record(str(tmp_path), "j") == record
    assert read_record(str(tmp_path), "another-run") is None
    assert read_record(str(tmp_path / "missing"), "j") is None
