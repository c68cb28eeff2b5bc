"""Slurm host-list expansion without scontrol."""

from __future__ import annotations

import pytest

from shardwise.errors import ShardwiseError
from shardwise.runtime.slurm import expand_nodelist, first_host


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("a1,b2", ["a1", "b2"]),
        ("node[01-04,7]", ["node01", "node02", "node03", "node04", "node7"]),
        ("gpu-[01-02,05]", ["gpu-01", "gpu-02", "gpu-05"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("a[1-2],b[3],c", ["a1", "a2", "b3", "c"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("node[1-2].cluster", ["node1.cluster", "node2.cluster"]),
    ],
)
def test_expand(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("bad", ["", "node[01-04", "node01-04]", "node[a-b]", "node[5-1]", "a,,b", "n[[1]]"])
def test_malformed(bad: str) -> None:
    with pytest.raises(ShardwiseError, match="malformed Slurm node list"):
        expand_nodelist(bad)
