"""``shardwise doctor`` additions: version mismatches across ranks and the bandwidth plot flag."""

from __future__ import annotations

import torch

from shardwise.cli import build_parser
from shardwise.observe.doctor import RankVersions, gather_versions, local_versions, version_mismatches


def _row(rank: int, host: str, torch_v: str = "2.13.0", sw: str = "0.1.0") -> RankVersions:
    return RankVersions(rank, host, "3.11.7", torch_v, sw, "-", "-")


def test_mismatched_torch_and_shardwise_are_named_with_ranks_and_hosts() -> None:
    rows = [_row(0, "a"), _row(1, "a"), _row(2, "b", torch_v="2.12.1"), _row(3, "b", torch_v="2.12.1", sw="0.0.9")]
    lines = version_mismatches(rows)
    assert lines == [
        "torch differs across ranks: 2.12.1 on rank(s) 2,3 (b); 2.13.0 on rank(s) 0,1 (a)",
        "shardwise differs across ranks: 0.0.9 on rank(s) 3 (b); 0.1.0 on rank(s) 0,1,2 (a, b)",
    ]
    assert version_mismatches(rows[:2]) == []


def test_local_versions_and_single_process_gather() -> None:
    mine = local_versions(0)
    assert mine.torch == torch.__version__
    assert gather_versions() == [mine]


def test_doctor_has_a_plot_flag() -> None:
    args = build_parser().parse_args(["doctor", "--nproc", "0", "--plot", "bw.png"])
    assert args.plot == "bw.png"


def test_environment_report_warns_about_a_bad_hang_timeout() -> None:
    from shardwise.observe.environment import collect

    report = collect({"SHARDWISE_HANG_TIMEOUT": "soon"})
    assert any("SHARDWISE_HANG_TIMEOUT=soon" in w for w in report.warnings)
    assert ("SHARDWISE_HANG_TIMEOUT", "soon") in report.env
    assert not any("SHARDWISE_HANG_TIMEOUT" in w for w in collect({"SHARDWISE_HANG_TIMEOUT": "60"}).warnings)
