"""``shardwise verify``: bad input is one line before any process starts; a real run passes."""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from shardwise.cli import main
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.verify.parity import GPTWorkload, ParityReport, Run, Training, parity_worker
from shardwise.layout import Plan
from tests.worker_forkserver import python


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ("tp=3", "shardwise verify: error: tp=3 does not divide tok_emb.num_embeddings=64; use tp=2 or tp=4\n"),
        ("tp=8", "shardwise verify: error: tp=8 does not divide blocks.0.attn.heads=4; use tp=2 or tp=4\n"),
        (
            "dp=3",
            "shardwise verify: error: --global-batch 8 does not split into 3 data-parallel ranks x 1 micro-steps; "
            "use a multiple of 3, e.g. 6\n",
        ),
        ("zero=1,shard=2,tp=2", None),
        (
            "pp=2,microbatches=3,schedule=gpipe",
            "shardwise verify: error: --global-batch 8 does not split into 1 data-parallel ranks x "
            "1 micro-steps x 3 pipeline microbatches; use a multiple of 3, e.g. 6\n",
        ),
        # ZeroRedundancyOptimizer cannot take the pipeline stages' DTensor parameters: refused up front.
        (
            "zero=1,shard=2,pp=2,microbatches=2",
            "shardwise verify: error: plan dp=1,shard=2,pp=2,zero=1: zero=1 "
            "(ZeroRedundancyOptimizer) cannot shard the optimizer state of pipeline stages; use zero=2 or zero=3 with "
            "pp (FSDP composes with pipeline stages), e.g. dp=1,shard=2,pp=2,zero=2, or plain data parallelism: "
            "dp=2,pp=2\n",
        ),
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
    proc = subprocess.run(
        python("-m", "shardwise", "verify", "--plan", "tp=2", "--steps", "5", "--script", str(script)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict    PASS at rtol 1e-05" in proc.stdout
    for row in ("loss       max rel diff", "grad norm  max rel diff", "weights    max rel diff"):
        assert row in proc.stdout


# -- pipeline plans: the engine behind `shardwise verify --plan ...pp=2...` on the shared pools ------
PIPE_GPT = GPTWorkload(GPTConfig(vocab_size=32, seq_len=8, layers=2, hidden=16, heads=2))


def _check_pipeline_reports(per_rank, plans):
    names = {n for n, _ in GPT(GPTConfig(vocab_size=32, seq_len=8, layers=2, hidden=16, heads=2)).named_parameters()}
    for rank, reports in enumerate(per_rank):
        assert [r.plan for r in reports] == plans
        for r in reports:
            # every stage's parameters came back under their original names: none missing (inf)
            assert set(r.weight_diffs) == names, (rank, r.plan)
            assert r.passed(1e-5), (rank, r.format(1e-5))
            assert r.losses[-1] < r.losses[0]  # it trained
            # the pipeline's loss and norm are the whole model's, not one stage's
            assert r.grad_norms == per_rank[0][reports.index(r)].grad_norms


@pytest.mark.timeout(240)
def test_verify_engine_pipeline_on_2(dist2):
    plans = ["pp=2,microbatches=2"]
    per_rank = dist2.run(parity_worker, PIPE_GPT, plans, Training(steps=3, global_batch=4))
    _check_pipeline_reports(per_rank, [str(Plan.parse(p)) for p in plans])


@pytest.mark.timeout(300)
def test_verify_engine_pipeline_combinations_on_4(dist4):
    """DPxPP, TPxPP (also with the LM head's loss kept vocabulary-parallel) and ZeRO-2xPP (the
    alternative the zero=1 error suggests) in one reference run."""
    runs = [
        Run("dp=2,pp=2,microbatches=2"),
        Run("tp=2,pp=2,microbatches=2"),
        Run("tp=2,pp=2,microbatches=2", loss_parallel=True),
        Run("zero=2,shard=2,pp=2,microbatches=2"),
    ]
    per_rank = dist4.run(parity_worker, PIPE_GPT, runs, Training(steps=3, global_batch=4))
    _check_pipeline_reports(per_rank, [r.label for r in runs])


def test_verify_reports_a_missing_stage_parameter_as_inf():
    """The weight comparison cannot pass if a parameter was not compared (e.g. lost by a split)."""
    report = ParityReport(plan="pp=2", losses=(1.0,), ref_losses=(1.0,), grad_norms=(1.0,), ref_grad_norms=(1.0,),
                          weight_diffs={"a": 0.0, "b": float("inf")})
    assert not report.passed(1e-5) and report.weight_diff == ("b", float("inf"))


@pytest.mark.parametrize("plan_text", ["zero=1,shard=2,pp=2,microbatches=2", "zero=1,dp=2,shard=2,pp=2,schedule=gpipe"])
def test_validate_refuses_zero1_with_pipeline_and_its_alternatives_are_accepted(plan_text):
    """zero=1 + pp failed deep inside torch (no DTensor rule for c10d.broadcast_); now one ConfigError
    up front, whose suggested plans validate (zero=2 x pp runs in the 4-process test above)."""
    from shardwise.errors import ConfigError
    from shardwise.parallel.parallelize import validate

    model = GPT(GPTConfig(vocab_size=32, seq_len=8, layers=2, hidden=16, heads=2))
    with pytest.raises(ConfigError) as info:
        validate(model, Plan.parse(plan_text))
    message = str(info.value)
    assert "zero=1" in message and "pipeline" in message
    suggested = [
        part.split(", or ")[0].strip() for part in (message.split("e.g. ")[1], message.split("data parallelism: ")[1])
    ]
    for alternative in suggested:
        plan = Plan.parse(alternative)
        assert plan.world_size == Plan.parse(plan_text).world_size and plan.pp == 2
        validate(model, plan)
    # zero=1 over one shard shards nothing: no ZeroRedundancyOptimizer, so it stays allowed
    validate(model, Plan(dp=2, zero=1, pp=2, microbatches=2))
