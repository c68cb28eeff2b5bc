"""``shardwise verify``: bad input is one line before any process starts; a real run passes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from shardwise.cli import main


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ("tp=3", "shardwise verify: error: tp=3 does not divide tok_emb.num_embeddings=64; use tp=2 or tp=4\n"),
        ("tp=8", "shardwise verify: error: tp=8 does not divide blocks.0.attn.heads=4; use tp=2 or tp=4\n"),
        ("dp=3", "shardwise verify: error: --global-batch 8 does not split into 3 data-parallel ranks x 1 micro-steps; "
                 "use a multiple of 3, e.g. 6\n"),
        ("zero=1,shard=2,tp=2", None),
    ],
)
def test_bad_plans_fail_as_one_line(plan, message, capsys):
    assert main(["verify", "--plan", plan]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardwise verify: error: ")
    if message:
        assert err == message


SCRIPT = """
import torch
from torch import nn

def build_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))

def make_batch(step, size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g)
"""


def test_verify_user_script_under_tp(tmp_path):
    script = tmp_path / "model.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run([sys.executable, "-m", "shardwise", "verify", "--plan", "tp=2", "--steps", "5", "--script", str(script)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict    PASS at rtol 1e-05" in proc.stdout
    for row in ("loss       max rel diff", "grad norm  max rel diff", "weights    max rel diff"):
        assert row in proc.stdout
