"""The planner's Muon terms (shardwise.plan.muon) against hand counts, and `shardwise plan --optimizer muon`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.plan.planner import cluster_of
from shardwise.plan.muon import block_matrices, muon_cost, state_bytes_per_param
from shardwise.plan.stats import transformer_stats
from shardwise.shape import TransformerShape

SHAPE = TransformerShape(layers=2, hidden=64, heads=4, vocab_size=100, seq_len=32)


def test_matrices_and_state() -> None:
    stats = transformer_stats(SHAPE)
    assert block_matrices(stats) == [(64, 64)] * 4 + [(64, 256)] * 2  # q, k, v, o; fc_in, fc_out (f = 4h)
    muon = 2 * (4 * 64 * 64 + 2 * 64 * 256)
    assert state_bytes_per_param(stats) == pytest.approx(
        (4 * muon + 8 * (stats.params_total - muon)) / stats.params_total
    )
    assert 4 < state_bytes_per_param(stats) < 8  # one momentum, not Adam's two, on most parameters


def test_costs_by_path() -> None:
    stats, cluster = transformer_stats(SHAPE), cluster_of("h100", world_size=4)
    values = 2 * (4 * 64 * 64 + 2 * 64 * 256)
    flops = 2 * (4 * 5 * 6 * 64 ** 3 + 2 * 5 * (4 * 64 * 64 * 256 + 2 * 64 ** 3))
    local = muon_cost(stats, Plan.parse("dp=4"), cluster)
    assert local.path == "local" and local.comm_bytes == 0 and local.ns_flops == flops
    owner = muon_cost(stats, Plan.parse("zero=3,shard=4"), cluster)
    assert owner.path == "owner" and owner.ns_flops == flops / 4
    assert owner.comm_bytes == pytest.approx(2 * 3 / 16 * values * 2)  # bf16, two all-to-alls
    gather = muon_cost(stats, Plan.parse("zero=3,shard=2,tp=2"), cluster, ns_bytes=4)
    assert (
        gather.path == "gather" and gather.comm_bytes == pytest.approx(3 / 4 * values * 4) and gather.ns_flops == flops
    )


def test_unknown_width_is_refused() -> None:
    stats = transformer_stats(SHAPE)
    from dataclasses import replace

    with pytest.raises(ConfigError, match="cannot price Muon"):
        block_matrices(replace(stats, hidden=0))


def test_cli_prices_muon() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardwise",
            "plan",
            "--model",
            "gpt2",
            "--devices",
            "8",
            "--optimizer",
            "muon",
            "--fixed",
            "zero=3,shard=8",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    data = json.loads(out)
    assert data["muon"][0]["path"] == "owner" and data["muon"][0]["comm_bytes"] > 0
    adamw = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "shardwise",
                "plan",
                "--model",
                "gpt2",
                "--devices",
                "8",
                "--fixed",
                "zero=3,shard=8",
                "--json",
                "--optimizer",
                "adamw",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert data["plans"][0]["memory_breakdown"]["optimizer"] < adamw["plans"][0]["memory_breakdown"]["optimizer"]
