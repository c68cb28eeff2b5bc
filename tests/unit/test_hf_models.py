"""Hugging Face models in one process: the trunk and stages found in each family, the derived TP
plans (Conv1D, fused q|k|v, experts), the layers named when they cannot be sharded, the planner's
shape read from a config, and text packing."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from shardwise.errors import ConfigError  # noqa: E402
from shardwise.models import hf  # noqa: E402
from shardwise.parallel.pipeline.split import find_trunk, split_model, stage_ties  # noqa: E402
from shardwise.parallel.pipeline.stage import TrunkStage  # noqa: E402
from shardwise.parallel.tp.styles import derive_tp_styles, tp_share, validate_tp  # noqa: E402


def _run(stages: list[nn.Module], ids: torch.Tensor) -> torch.Tensor:
    x = stages[0](ids)
    for stage in stages[1:]:
        x = stage(x, stage_inputs=ids)
    return x


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_stages_of_every_family_compose_to_the_model(family: str) -> None:
    model = hf.build_causal_lm(hf.tiny_config(family), seed=0).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    want = model(ids).logits
    trunk = find_trunk(model)
    assert trunk.name in ("model.layers", "transformer.h") and len(trunk.units) == 4
    for n in (2, 3):
        stages = split_model(model, n)
        assert all(isinstance(s, TrunkStage) for s in stages)
        torch.testing.assert_close(_run(stages, ids), want, rtol=0, atol=0)
        names = {name for s in stages for name, _ in s.named_parameters(remove_duplicate=False)}
        assert names == {name for name, _ in model.named_parameters(remove_duplicate=False)}
    ties = [t.holders for t in stage_ties(split_model(model, 2))]
    assert ties == ([((0, "transformer.wte.weight"), (1, "lm_head.weight"))] if family == "gpt2" else
                    [((0, "model.embed_tokens.weight"), (1, "lm_head.weight"))] if family == "gemma" else [])


def test_gpt2_plan_covers_conv1d_fused_qkv_and_tied_embeddings() -> None:
    with torch.device("meta"):
        model = hf.build_causal_lm(hf.tiny_config("gpt2"))
    styles = derive_tp_styles(model, tp=2).as_dict()
    assert (
        styles["transformer.h.*.attn.c_attn"] == "colwise_fused3" and styles["transformer.h.*.attn.c_proj"] == "rowwise"
    )
    assert (
        styles["transformer.h.*.mlp.c_fc"] == "colwise"
        and styles["lm_head"] == "lm_head"
        and styles["transformer.wte"] == "vocab_embedding"
    )
    share, replicated = tp_share(model, derive_tp_styles(model, tp=2), tp=2)
    assert 0.5 < share < 0.53 and replicated == []
    with pytest.raises(ConfigError, match=r"tp=3 does not divide .*; use tp=2 or tp=4"):
        validate_tp(model, derive_tp_styles(model, tp=3), tp=3)


def test_mixtral_experts_are_split_like_an_mlp() -> None:
    with torch.device("meta"):
        model = hf.build_causal_lm(hf.tiny_config("mixtral"))
    styles = derive_tp_styles(model, tp=2)
    assert styles.as_dict()["model.layers.*.mlp.experts"] == "experts"
    share, replicated = tp_share(model, styles, tp=2)
    assert share < 0.52, share  # was 218k of 238k (92%) on every rank when experts were replicated
    # what stays whole on every rank is named: the routers (experts x hidden), 128 parameters each
    assert replicated == [(f"model.layers.{i}.mlp.gate", 128) for i in range(4)]


def test_a_fused_projection_of_unequal_pieces_is_named() -> None:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj, self.o_proj = (
                nn.Linear(32, 64),
                nn.Linear(32, 32),
            )  # q 32 + k 16 + v 16 (grouped query): not 3 x 32

    model = nn.Sequential(Attn(), Attn())
    with pytest.raises(ConfigError, match=r"tp=2 cannot shard 0\.qkv_proj: it fuses projections of unequal widths"):
        derive_tp_styles(model, tp=2)


def test_shape_of_a_config() -> None:
    shape = hf.shape_of(hf.tiny_config("gpt2").to_dict())
    assert (
        shape.layers,
        shape.hidden,
        shape.heads,
        shape.vocab_size,
        shape.tied_embeddings,
        shape.learned_positions,
    ) == (4, 32, 4, 64, True, True)
    llama = hf.shape_of(hf.tiny_config("llama"), seq_len=16)
    assert (llama.kv_heads, llama.ffn, llama.seq_len, llama.learned_positions) == (2, 64, 16, False)


def test_text_files_are_packed_in_a_fixed_order(tmp_path) -> None:
    from shardwise.data.text import find_files, load_text_corpus

    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.txt").write_text("bb")
    (tmp_path / "a.txt").write_text("aa")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "cc"}) + "\n\n" + json.dumps({"text": "dd"}) + "\n")
    files = find_files(f"{tmp_path}/**/*.txt,{tmp_path}/*.jsonl")
    assert [f.rsplit("/", 1)[-1] for f in files] == ["a.txt", "x.txt", "c.jsonl"]
    corpus = load_text_corpus(
        f"{tmp_path}/**/*.txt,{tmp_path}/*.jsonl",
        tokenize=lambda t: [ord(c) - 90 for c in t],
        eos_id=0,
        vocab_size=16,
        val_fraction=0.2,
    )
    stream = torch.cat([corpus.train, corpus.val]).tolist()
    assert stream == [7, 7, 0, 8, 8, 0, 9, 9, 0, 10, 10, 0] and corpus.documents == 4 and len(corpus.val) == 2
    with pytest.raises(ConfigError, match="match no file"):
        find_files(f"{tmp_path}/nothing/*.txt")
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1 has no string field 'text'.*text_key"):
        load_text_corpus(str(tmp_path / "bad.jsonl"), tokenize=list, eos_id=None, vocab_size=4)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["ee", "ff", "gg"], "n": [1, 2, 3]}), tmp_path / "d.parquet", row_group_size=2)
    corpus = load_text_corpus(
        f"{tmp_path}/c.jsonl,{tmp_path}/d.parquet",
        tokenize=lambda t: [ord(c) - 90 for c in t],
        eos_id=0,
        vocab_size=16,
        val_fraction=0.1,
    )  # one document per row, row groups in order
    assert (
        torch.cat([corpus.train, corpus.val]).tolist()[-9:] == [11, 11, 0, 12, 12, 0, 13, 13, 0]
        and corpus.documents == 2 + 3
    )
    with pytest.raises(ConfigError, match=r"d\.parquet row 1: column 'n' holds int, not text"):
        load_text_corpus(str(tmp_path / "d.parquet"), tokenize=list, eos_id=None, vocab_size=4, text_key="n")
    with pytest.raises(ConfigError, match=r"has no column 'body'"):
        load_text_corpus(str(tmp_path / "d.parquet"), tokenize=list, eos_id=None, vocab_size=4, text_key="body")


def test_the_train_command_checks_the_model_directory_and_data_first(tmp_path) -> None:
    from shardwise.config import load_config
    from shardwise.jobs.hf_train import check_hf_job

    def config(**keys: str):
        return load_config(overrides=[f"{k}={v}" for k, v in keys.items()])

    with pytest.raises(ConfigError, match="does not exist; pass a directory written by save_pretrained"):
        check_hf_job(config(**{"model.hf": str(tmp_path / "nope"), "data.files": "x"}))
    hf.build_causal_lm(hf.tiny_config("llama")).save_pretrained(str(tmp_path / "m"))
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        check_hf_job(config(**{"model.hf": str(tmp_path / "m"), "data.files": "x"}))
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="match no file"):
        check_hf_job(config(**{"model.hf": str(tmp_path / "m"), "data.files": str(tmp_path / "*.txt")}))
