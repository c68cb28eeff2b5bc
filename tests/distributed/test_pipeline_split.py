"""Pipeline stage splitting and the pipeline's bad-input checks (one process, no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.pipeline import check_microbatches, local_stage_indices
from shardwise.parallel.pipeline.split import (
    PipelineStages,
    TrunkStage,
    balanced_cuts,
    check_ties,
    find_trunk,
    split_model,
    stage_summary,
    stage_ties,
)


def small_gpt(layers: int = 4) -> GPT:
    return GPT(GPTConfig(vocab_size=32, seq_len=8, layers=layers, hidden=16, heads=2), seed=0)


def run_stages(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    inputs = x
    for i, stage in enumerate(stages):
        # a trunk stage after the first gets the batch's inputs too (the schedule passes them)
        x = stage(x, stage_inputs=inputs) if i and isinstance(stage, TrunkStage) else stage(x)
    return x


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_gpt_stages_compose_to_the_model(num_stages: int) -> None:
    model = small_gpt()
    ids = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(0))
    stages = split_model(model, num_stages)
    assert len(stages) == num_stages
    torch.testing.assert_close(run_stages(stages, ids), model(ids), rtol=0, atol=0)
    # parameter names are kept, and every parameter is on exactly one stage
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert isinstance(stages[0], TrunkStage) and {"tok_emb", "pos_emb", "drop"} <= set(dict(stages[0].named_children()))
    assert {"ln_f", "lm_head"} <= set(dict(stages[-1].named_children()))


def test_trunk_is_found_between_input_and_output_sections() -> None:
    trunk = find_trunk(small_gpt())
    assert trunk.name == "blocks" and len(trunk.units) == 4
    assert trunk.inputs == ("tok_emb", "pos_emb", "drop") and trunk.outputs == ("ln_f", "lm_head")


def test_param_balance_puts_fewer_blocks_next_to_heavy_sections() -> None:
    # a large vocabulary makes the embedding and the head heavy: the end stages get fewer blocks
    model = GPT(GPTConfig(vocab_size=2048, seq_len=8, layers=8, hidden=16, heads=2), seed=0)
    stages = split_model(model, 4)
    blocks = [len(s.blocks) for s in stages]
    assert sum(blocks) == 8 and blocks[0] < blocks[1] and blocks[-1] < blocks[2], blocks


def test_balanced_cuts_minimise_the_largest_stage() -> None:
    assert balanced_cuts([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_cuts([4, 1, 1, 1, 1], 2) == [0, 1]
    assert balanced_cuts([1, 1, 1, 1, 1], 3, first_extra=2) == [0, 1, 3]
    assert balanced_cuts([1, 2, 3], 3) == [0, 1, 2]


def test_flop_balance_uses_the_measured_costs() -> None:
    # the embedding holds most parameters but does no multiply-adds: the two balances disagree
    model = nn.Sequential(nn.Embedding(1000, 8), *[nn.Linear(8, 8) for _ in range(4)])
    x = torch.randint(0, 1000, (4,))
    by_params = split_model(model, 2)
    by_flops = split_model(model, 2, balance="flops", example_inputs=(x,))
    assert list(dict(by_params[0].named_children())) == ["0"]
    assert list(dict(by_flops[0].named_children())) == ["0", "1", "2"]
    torch.testing.assert_close(run_stages(by_flops, x), model(x))
    with pytest.raises(ConfigError, match="example batch"):
        split_model(model, 2, balance="flops")


def test_sequential_and_explicit_split_points() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    stages = split_model(model, 3, split_points=(1, 5))
    assert [list(dict(s.named_children())) for s in stages] == [["0"], ["1", "2", "3", "4"], ["5"]]
    x = torch.randn(2, 4)
    torch.testing.assert_close(run_stages(stages, x), model(x))
    gpt_stages = split_model(small_gpt(), 2, split_points=("blocks.3",))
    assert list(gpt_stages[0].blocks._modules) == ["0", "1", "2"] and list(gpt_stages[1].blocks._modules) == ["3"]


def test_user_stages_as_in_the_reference_guide() -> None:
    stage1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
    stage2 = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU())
    net = PipelineStages(stage1, stage2)
    stages = split_model(net, 2)
    x = torch.randn(3, 8)
    torch.testing.assert_close(run_stages(stages, x), net(x))
    assert sorted(n for s in stages for n, _ in s.named_parameters()) == sorted(n for n, _ in net.named_parameters())
    assert stage_summary(stages)[0].startswith("stage 0: 0 (")
    with pytest.raises(ConfigError, match="holds 2 stages but the plan needs 4"):
        split_model(net, 4)


# -- bad input: one line that names the value and a valid alternative ------------------------------
def test_more_stages_than_blocks() -> None:
    with pytest.raises(ConfigError, match=r"5 pipeline stages .* only 4 blocks.*pp<=4"):
        split_model(small_gpt(), 5)


def test_batch_not_divisible_into_microbatches() -> None:
    check_microbatches(8, 4)
    with pytest.raises(ConfigError, match=r"batch of 6 samples .* 4 equal microbatches.*multiple of 4 \(e.g. 4 or 8\)"):
        check_microbatches(6, 4)
    with pytest.raises(ConfigError, match="batch of 2"):
        check_microbatches(2, 4)


def test_tied_weights_across_stages_are_listed() -> None:
    model = small_gpt()
    model.lm_head.weight = model.tok_emb.weight
    stages = split_model(model, 2)
    assert [t.holders for t in stage_ties(stages)] == [((0, "tok_emb.weight"), (1, "lm_head.weight"))]
    check_ties(stage_ties(stages), pp=2)
    # interleaved with pp=1 x 2 virtual stages would put both holders on one rank
    with pytest.raises(ConfigError, match="both stages run on pipeline rank 0"):
        check_ties(stage_ties(split_model(model, 2)), pp=1)


def test_model_without_trunk() -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    with pytest.raises(ConfigError, match="cannot find a sequential trunk.*PipelineStages"):
        split_model(Flat(), 2)


def test_bad_split_points() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    with pytest.raises(ConfigError, match="make 2 stages but the plan needs 3"):
        split_model(model, 3, split_points=(2,))
    with pytest.raises(ConfigError, match="increasing"):
        split_model(model, 3, split_points=(2, 2))
    with pytest.raises(ConfigError, match="not a unit of the trunk"):
        split_model(small_gpt(), 2, split_points=("layers.2",))


def test_looped_stage_layout() -> None:
    assert local_stage_indices(0, 2, 2) == [0, 2] and local_stage_indices(1, 2, 2) == [1, 3]
    assert local_stage_indices(3, 4, 1) == [3]
