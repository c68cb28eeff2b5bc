"""Plan values the parallel layers rely on: parsing of the ZeRO/HSDP/TP spellings, validation
errors as one line with an alternative, and the JSON round trip (MindSpore's strategy file)."""

from __future__ import annotations

import pytest

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.resolve import resolve_plan


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("zero=3,dp=4", Plan(shard=4, zero=3)),  # dp with a ZeRO stage means: shard over them
        ("zero=3,dp=2,shard=2", Plan(dp=2, shard=2, zero=3)),  # HSDP
        ("zero=1,fsdp=2", Plan(shard=2, zero=1)),
        ("dp=2,tp=2", Plan(dp=2, tp=2)),
        ("tp=2,sp", Plan(tp=2, sequence_parallel=True)),
        (
            "zero=2,shard=2,tp=2,recompute=selective,precision=bf16",
            Plan(shard=2, tp=2, zero=2, recompute="selective", precision="bf16"),
        ),
    ],
)
def test_parse(text, expected):
    assert Plan.parse(text) == expected


def test_flags():
    hsdp = Plan.parse("zero=3,dp=2,shard=2")
    assert hsdp.hsdp_enabled and hsdp.fsdp_enabled and hsdp.dp_size == 4 and hsdp.world_size == 4
    assert hsdp.mesh_shape == (1, 2, 2, 1, 1)
    fsdp_tp = Plan.parse("zero=3,shard=2,tp=2")
    assert not fsdp_tp.hsdp_enabled and fsdp_tp.tp_enabled and fsdp_tp.dp_size == 2


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("shard=2", "plan shard=2 needs a ZeRO stage; add zero=3 (or 1, 2), or use dp=2"),
        ("zero=4", "plan zero=4 is not a ZeRO stage; use 0 (off), 1, 2 or 3"),
        ("sp", "plan sequence_parallel needs tp > 1; add tp=2 (or more), or drop sequence_parallel"),
        ("tp=two", "plan tp='two' is not an integer; for example tp=2"),
        ("recompute=some", "plan recompute='some' is unknown; use one of none, selective, full"),
    ],
)
def test_bad_values_name_the_value_and_an_alternative(text, fragment):
    with pytest.raises(ConfigError) as err:
        Plan.parse(text)
    assert str(err.value) == fragment


def test_world_size_mismatch_suggests_valid_plans():
    with pytest.raises(ConfigError, match=r"uses 6 processes .* but the world has 4; try dp=4 or dp=2,tp=2"):
        Plan.parse("dp=3,tp=2").check_world(4)


def test_json_round_trip(tmp_path):
    plan = Plan.parse("zero=3,dp=2,shard=2,tp=2,sp,recompute=full,precision=bf16,cpu_offload")
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert Plan.load(str(path)) == plan
    assert "HSDP" in plan.describe() and "sequence parallel" in plan.describe()


# -- the fill-in rules: a plan says what the user cares about, the rest follows from the world ------
@pytest.mark.parametrize(
    ("text", "world", "expected"),
    [
        ("zero=3", 4, Plan(shard=4, zero=3)),  # ZeRO without shard: over all data-parallel ranks
        ("zero=3,tp=2", 4, Plan(shard=2, tp=2, zero=3)),
        ("zero=3,shard=2", 4, Plan(dp=2, shard=2, zero=3)),  # shard named: dp replicas (HSDP) fill the rest
        ("zero=3,dp=4", 4, Plan(shard=4, zero=3)),  # the old spelling keeps its meaning
        ("tp=2", 4, Plan(dp=2, tp=2)),  # the unnamed dp takes the rest
        ("dp=2,pp=2", 4, Plan(dp=2, pp=2, microbatches=2)),  # a pipeline gets one microbatch per stage
        ("tp=2,pp=2", 4, Plan(tp=2, pp=2, microbatches=2)),
        (
            "pp=2,schedule=interleaved_1f1b,virtual_stages=2",
            2,
            Plan(pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=4),
        ),
        ("pp=4,microbatches=8", 8, Plan(dp=2, pp=4, microbatches=8)),  # named keys are kept
        ("", 3, Plan(dp=3)),
    ],
)
def test_fill_in_rules(text, world, expected):
    assert Plan.parse(text, world_size=world) == expected
    assert resolve_plan(text or "dp", world) == expected


def test_fill_in_failures_name_the_fix():
    with pytest.raises(ConfigError, match="tp\\*pp=3 does not divide the world of 4"):
        Plan.parse("tp=3", world_size=4)
    with pytest.raises(ConfigError, match="shard=3 does not divide the 4 data-parallel ranks"):
        Plan.parse("zero=3,shard=3", world_size=4)
    with pytest.raises(ConfigError, match="uses 2 processes .* but the world has 4"):
        resolve_plan("dp=2", 4)  # an explicit degree is never changed


def test_default_microbatches_need_not_be_spelled_and_print_round_trips():
    assert Plan(pp=2).microbatches == 2 and Plan().microbatches == 1
    assert str(Plan(dp=2, pp=2)) == "dp=2,pp=2" and Plan.parse(str(Plan(dp=2, pp=2))) == Plan(dp=2, pp=2)
    assert Plan.from_json(Plan(pp=2, microbatches=6).to_json()) == Plan(pp=2, microbatches=6)
    with pytest.raises(ConfigError, match="fewer than pp=4"):
        Plan(pp=4, microbatches=2)


def test_precision_goes_into_the_plan_once():
    assert resolve_plan("dp", 2, precision="bf16") == Plan(dp=2, precision="bf16")
    with pytest.raises(ConfigError, match="contradicts the plan's precision=bf16"):
        resolve_plan("dp=2,precision=bf16", 2, precision="fp16")
