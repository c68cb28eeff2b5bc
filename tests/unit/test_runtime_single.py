"""Backend choice (the world-of-one init path is covered end to end in tests/integration/test_run_cli.py)."""

from __future__ import annotations

import pytest

from shardwise.errors import ShardwiseError
from shardwise.runtime.env import choose_backend


def test_backend_choice() -> None:
    assert choose_backend(None) == "gloo"  # no CUDA here
    assert choose_backend("GLOO") == "gloo"
    with pytest.raises(ShardwiseError, match="needs CUDA"):
        choose_backend("nccl")
    with pytest.raises(ShardwiseError, match="unknown backend"):
        choose_backend("carrier-pigeon")
