"""The fill-in rules where users meet them: `shardwise train` and `shardwise verify` resolve what a
plan leaves out for their world size, `shardwise plan --fixed` fixes only the keys it names and
searches the others, and a plan that no filling makes valid is one line naming the fix."""

from __future__ import annotations

import json

import pytest

from shardwise.cli import main
from shardwise.commands.train import job_plan
from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.layout import Plan, named_keys


@pytest.mark.parametrize(("text", "want"), [
    ("zero=3", Plan(shard=4, zero=3)),
    ("dp=2,pp=2", Plan(dp=2, pp=2, microbatches=2)),
    ("tp=2,pp=2", Plan(tp=2, pp=2, microbatches=2)),
    ("tp=2", Plan(dp=2, tp=2)),
])
def test_shardwise_train_resolves_what_a_plan_leaves_out_on_four_processes(text: str, want: Plan) -> None:
    config = load_config(values={"parallel.plan": text, "parallel.nproc": "4", "train.global_batch_size": 8})
    assert job_plan(config, 4) == want


def test_train_start_up_errors_name_the_fix() -> None:
    config = load_config(values={"parallel.plan": "zero=3,shard=3", "train.global_batch_size": 8})
    with pytest.raises(ConfigError, match=r"shard=3 does not divide the 4 data-parallel ranks.*leave shard out"):
        job_plan(config, 4)
    config = load_config(values={"parallel.plan": "tp=2", "train.global_batch_size": 9})
    with pytest.raises(ConfigError, match="9 does not split into 2 data-parallel ranks"):
        job_plan(config, 4)
    assert job_plan(load_config(values={"parallel.plan": "auto"}), 4) is None


def test_named_keys_are_what_the_user_wrote() -> None:
    assert named_keys("dp=24,tp=8,pp=8") == {"dp": 24, "tp": 8, "pp": 8}
    assert named_keys("zero=3,dp=4") == {"zero": 3, "shard": 4, "dp": 1}  # the plan strings' rule: shard over them
    assert named_keys("mb=8,ac=full,sp") == {"microbatches": 8, "recompute": "full", "sequence_parallel": True}
    with pytest.raises(ConfigError, match="unknown plan key 'tpp'"):
        named_keys("tpp=2")


def test_verify_fills_in_for_nproc_and_names_the_fix(capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--plan", "tp=3", "--nproc", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tp*pp=3 does not divide the world of 4" in err
    assert main(["verify", "--plan", "zero=3", "--nproc", "4", "--global-batch", "6"]) == 2
    err = capsys.readouterr().err
    assert "does not split into 4 data-parallel ranks" in err  # zero=3 became shard=4 before the batch check


def _plan_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_fixed_keeps_the_named_degrees_and_searches_the_rest(capsys: pytest.CaptureFixture) -> None:
    """`--fixed dp=24,tp=8,pp=8` on 1,536 GPUs (Megatron-LM's GPT-3 175B layout): the planner chooses
    the microbatches (never fewer than the stages), the schedule and recomputation; it used to fail
    with one microbatch per plan."""
    out = _plan_json(capsys, "--model", "gpt3-175b", "--devices", "1536", "--device-type", "a100-80gb",
                     "--global-batch", "2304", "--fixed", "dp=24,tp=8,pp=8")
    (plan,) = out["plans"]
    assert (plan["dp"], plan["tp"], plan["pp"]) == (24, 8, 8) and plan["fits"]
    assert plan["num_microbatches"] >= 8 and plan["num_microbatches"] * plan["micro_batch_size"] * 24 == 2304
    # naming more keys fixes them too
    out = _plan_json(capsys, "--model", "gpt3-175b", "--devices", "1536", "--device-type", "a100-80gb",
                     "--global-batch", "2304", "--fixed", "dp=24,tp=8,pp=8,recompute=full,zero=0,schedule=1f1b")
    (plan,) = out["plans"]
    assert (plan["recompute"], plan["zero_stage"], plan["schedule"], plan["virtual_stages"]) == ("full", 0, "1f1b", 1)


def test_plan_fixed_that_never_fits_is_shown_with_its_memory(capsys: pytest.CaptureFixture) -> None:
    out = _plan_json(
        capsys,
        "--model",
        "gpt3-175b",
        "--devices",
        "8",
        "--device-type",
        "a100-80gb",
        "--global-batch",
        "8",
        "--fixed",
        "dp=8",
    )
    assert out["plans"] and not out["plans"][0]["fits"] and "does NOT fit" in out["explanation"]
    assert main(["plan", "--model", "gpt", "--devices", "4", "--device-type", "cpu", "--fixed", "tp=3"]) == 2
    assert "names no valid plan" in capsys.readouterr().err


def test_plan_fixed_prices_layouts_the_runtime_refuses_and_says_so(capsys: pytest.CaptureFixture) -> None:
    """Megatron's distributed optimizer with TP and PP (ZeRO-1 x TP x PP) is priced, and flagged:
    shardwise's parallel layer would refuse it, so the free search never offers it."""
    out = _plan_json(
        capsys, "--model", "gpt3-13b", "--devices", "64", "--device-type", "a100-80gb", "--fixed", "zero=1,tp=2,pp=2"
    )
    (plan,) = out["plans"]
    assert (plan["zero_stage"], plan["tp"], plan["pp"]) == (1, 2, 2)
    assert "cannot run it" in out["explanation"] and "ZeroRedundancyOptimizer" in out["explanation"]


def test_ep_alone_fills_data_parallel_in_every_entry_point(capsys: pytest.CaptureFixture) -> None:
    """`ep=N` names no degree of its own: the experts are split over data-parallel ranks, which are
    filled in as for `tp` and `pp` alone (docs/planner.md: `ep=2` on 2 processes is `dp=2,ep=2`)."""
    assert Plan.parse("ep=2") == Plan(dp=2, ep=2)  # verify without --nproc, a plan file, Trainer(plan=Plan.parse(...))
    assert Plan.parse("ep=2", world_size=4) == Plan(dp=4, ep=2)
    assert Plan.parse("zero=3,ep=2") == Plan(shard=2, zero=3, ep=2)
    assert Plan.parse("tp=2,ep=2", world_size=4) == Plan(dp=2, tp=2, ep=2)
    from shardwise.resolve import resolve_plan

    assert resolve_plan("ep=2", 2) == Plan(dp=2, ep=2)  # the Trainer's build step
    config = load_config(values={"parallel.plan": "ep=2", "parallel.nproc": "4", "train.global_batch_size": 8})
    assert job_plan(config, 4) == Plan(dp=4, ep=2)  # shardwise train
    with pytest.raises(ConfigError, match="ep=4 does not divide dp=2"):
        Plan.parse("ep=4", world_size=2)
    assert main(["verify", "--plan", "ep=2", "--nproc", "3"]) == 2  # dp=3 is not a multiple of ep=2: one line
    assert "ep=2 does not divide dp=3" in capsys.readouterr().err
    moe = '{"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 64, "experts": 4, "top_k": 2}'
    out = _plan_json(
        capsys, "--model-spec", moe, "--devices", "4", "--device-type", "cpu", "--fixed", "ep=2"
    )  # shardwise plan
    assert out["plans"] and all((p["ep"], p["dp"] * max(1, p.get("shard", 1))) == (2, 4) for p in out["plans"])
