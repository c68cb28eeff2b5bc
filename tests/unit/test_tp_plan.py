"""TP styles as data: derivation for standard blocks, annotations, and bad input that must fail
as one ConfigError before any process-group work (no process group exists in these tests)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.annotate import annotated_styles, shard
from shardwise.parallel.parallelize import parallelize, validate
from shardwise.parallel.tp import TPStyles, derive_tp_styles, to_torch_styles, validate_tp
from shardwise.layout import Plan


def _gpt(**kw) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**{"vocab_size": 64, "seq_len": 16, "layers": 2, "hidden": 32, "heads": 4, **kw}))


def test_gpt_plan_is_derived_as_patterns():
    assert derive_tp_styles(_gpt(), tp=2).as_dict() == {
        "blocks.*.attn.q_proj": "colwise", "blocks.*.attn.k_proj": "colwise", "blocks.*.attn.v_proj": "colwise",
        "blocks.*.attn.o_proj": "rowwise", "blocks.*.attn": "attention_input",
        "blocks.*.mlp.fc_in": "colwise", "blocks.*.mlp.fc_out": "rowwise", "blocks.*.mlp": "attention_input",
        "lm_head": "lm_head", "tok_emb": "vocab_embedding", "pos_emb": "pos_embedding",
        "blocks.*.ln1": "sequence_parallel", "blocks.*.ln2": "sequence_parallel", "ln_f": "sequence_parallel",
    }


def test_sequence_parallel_styles_only_with_sp():
    styles = derive_tp_styles(_gpt(), tp=2)
    without, with_sp = (
        to_torch_styles(styles, sequence_parallel=False, loss_parallel=False),
        to_torch_styles(styles, sequence_parallel=True, loss_parallel=False),
    )
    assert "ln_f" not in without and "pos_emb" not in without and "ln_f" in with_sp and "pos_emb" in with_sp


class _Attention(nn.Module):
    def __init__(self, hidden: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(hidden, hidden) for _ in range(4))


class _Model(nn.Module):
    def __init__(self, hidden: int = 48, n_heads: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(_Attention(hidden, n_heads) for _ in range(2))


def test_heads_not_divisible_names_value_and_alternatives():
    model = _Model(hidden=48, n_heads=6)
    with pytest.raises(ConfigError) as err:
        validate_tp(model, derive_tp_styles(model, tp=4), tp=4)
    assert str(err.value) == "tp=4 does not divide layers.0.n_heads=6; use tp=2 or tp=3 or tp=6"


def test_hidden_not_divisible_fails_in_parallelize_before_meshes_are_used():
    # meshes=None: the check must fire before parallelize touches any process group or mesh.
    with pytest.raises(ConfigError, match=r"tp=3 does not divide .*=64; use tp=2 or tp=4"):
        parallelize(_gpt(), Plan(tp=3), None)  # type: ignore[arg-type]


def test_gpt_heads_implied_by_head_dim():
    with pytest.raises(ConfigError, match=r"tp=8 does not divide blocks.0.attn.heads=4; use tp=2 or tp=4"):
        validate(_gpt(vocab_size=64), Plan(tp=8))


def test_layer_type_tp_cannot_shard():
    model = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2), nn.Linear(8, 8))
    with pytest.raises(ConfigError) as err:
        validate(model, Plan(tp=2))
    msg = str(err.value)
    assert "tp=2 cannot shard 1 (torch.nn.modules.activation.MultiheadAttention" in msg and "separate nn.Linear" in msg
    assert "\n" not in msg


def test_model_without_linear_pairs():
    with pytest.raises(ConfigError, match="found no colwise/rowwise Linear pair in Conv2d"):
        validate(nn.Conv2d(3, 8, 3), Plan(tp=2))


def test_zero1_with_tp_is_refused_with_alternative():
    with pytest.raises(ConfigError, match="use zero=2 or zero=3 with tp"):
        validate(_gpt(), Plan(shard=2, zero=1, tp=2))


def test_sequential_mlp_pair_found_by_shape():
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    assert derive_tp_styles(model, tp=2).as_dict() == {"0": "colwise", "2": "rowwise"}


def test_unknown_style_and_wrong_layer_type():
    with pytest.raises(ConfigError, match="style 'diagonal'"):
        TPStyles.of({"fc": "diagonal"})
    model = nn.Sequential(nn.LayerNorm(8))
    with pytest.raises(ConfigError, match="needs an nn.Linear, not LayerNorm"):
        validate_tp(model, TPStyles.of({"0": "colwise"}), tp=2)


# -- annotations -------------------------------------------------------------------------------
class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.out = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 4)


def test_partner_inferred_when_unambiguous():
    model = _Pair()
    shard(model.up, "colwise")
    assert annotated_styles(model, tp=2).as_dict() == {"up": "colwise", "down": "rowwise"}


def test_partner_not_inferred_when_ambiguous():
    model = nn.Module()
    model.a, model.b, model.c = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(16, 8)
    shard(model.a, "colwise")
    assert annotated_styles(model, tp=2).as_dict() == {"a": "colwise_rep"}  # gathers its own output


def test_rowwise_annotation_pulls_in_its_producer():
    model = _Pair()
    shard(model.down, ((1, 2), (2, 1)))
    assert annotated_styles(model, tp=2).as_dict() == {"up": "colwise", "down": "rowwise"}


def test_strategy_for_other_tp_is_one_line_with_the_fix():
    model = _Pair()
    shard(model.up, ((1, 1), (1, 8)))
    with pytest.raises(ConfigError) as err:
        annotated_styles(model, tp=2)
    assert (
        str(err.value)
        == "strategy ((1, 1), (1, 8)) on up splits 8 ways but the plan has tp=2; write ((1, 1), (1, 2)), or use tp=8"
    )


def test_shard_refuses_layers_tp_cannot_split():
    with pytest.raises(
        ConfigError, match=r"shard\(Conv2d, 'colwise'\): tensor parallel styles apply to nn.Linear and nn.Embedding"
    ):
        shard(nn.Conv2d(3, 8, 3), "colwise")
    with pytest.raises(ConfigError, match="2-D"):
        annotated_styles(shard(nn.Linear(4, 4), ((1, 2), (2, 2))), tp=2)
    with pytest.raises(ConfigError, match="is unknown"):
        shard(nn.Linear(4, 4), "diagonal")


def test_embedding_strategies():
    emb = nn.Embedding(16, 8)
    assert annotated_styles(shard(emb, ((2, 1), (1, 1))), tp=2).as_dict() == {"": "vocab_embedding"}
    assert annotated_styles(shard(emb, ((1, 2), (1, 1))), tp=2).as_dict() == {"": "embedding_colwise"}


def test_sequence_parallel_with_annotations_only_is_refused():
    model = _Pair()
    shard(model.up, "colwise")
    with pytest.raises(ConfigError, match="sequence parallel needs norm"):
        validate(model, Plan(tp=2, sequence_parallel=True))
