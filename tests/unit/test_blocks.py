"""One block finder (:mod:`shardwise.models.blocks`): the planner prices the blocks that FSDP wraps,
the pipeline splits between and certification drops, on every built-in and Hugging Face family."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.models import hf
from shardwise.models.blocks import find_blocks
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.mlp import SimpleNet
from shardwise.models.resnet import resnet_small
from shardwise.parallel import fsdp
from shardwise.parallel.pipeline.split import find_trunk
from shardwise.auto.measure import model_stats
from shardwise.auto.certify import repeated_blocks


class Wrapped(nn.Module):
    """A user's module around a Hugging Face model: no ``config`` on top, so the planner measures it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return hf.logits_of(self.inner(ids))


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _models():
    yield "gpt", GPT(GPTConfig(vocab_size=32, seq_len=8, layers=3, hidden=16, heads=2))
    yield "gpt-moe", GPT(GPTConfig(vocab_size=32, seq_len=8, layers=2, hidden=16, heads=2, experts=4, top_k=2))
    yield "resnet", resnet_small()
    for family in hf.FAMILIES:
        with torch.device("meta"):
            model = hf.build_causal_lm(hf.tiny_config(family))
        yield family, model
        yield f"wrapped-{family}", Wrapped(model)


@pytest.mark.parametrize(("name", "model"), list(_models()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_planner_prices_the_blocks_fsdp_wraps_and_the_pipeline_splits(name, model):
    blocks = fsdp.block_modules(model)  # what apply_fsdp wraps one by one
    assert len(blocks) >= 2, name
    sample = torch.zeros(1, 1, 16, 16) if name == "resnet" else torch.zeros(1, 8, dtype=torch.long)  # a batch of one
    stats = model_stats(model, tokens_per_sample=None if name == "resnet" else 8, inputs=sample)
    assert stats.blocks == len(blocks), name
    # closed forms (the GPT, a Hugging Face config) count a block's parameters by formula: within 2%
    assert stats.params_per_block == pytest.approx(max(_numel(b) for b in blocks), rel=0.02), name
    assert [m for _, m in find_trunk(model).units] == blocks, name
    found = repeated_blocks(model)  # what certification drops, when the blocks are alike
    if name == "resnet":  # its stages widen (16, 32, 64 channels): none can be dropped, the copy keeps them all
        assert found is None
    else:
        assert found is not None and list(found[1].children()) == blocks, name


def test_the_rule_largest_then_shallowest_and_lists_inside_a_block_are_not_the_trunk():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.ModuleList([nn.Linear(2, 2) for _ in range(8)])  # longer, but small
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)) for _ in range(3)])

    net = Net()
    assert find_blocks(net).name == "layers" and len(find_blocks(net).modules) == 3
    # a Sequential of the same blocks, one level down, holding as many parameters: the shallower wins
    outer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert find_blocks(outer).name == "" and find_blocks(SimpleNet()) is None
    assert fsdp.block_modules(SimpleNet()) == []  # no trunk: the whole model is one unit
