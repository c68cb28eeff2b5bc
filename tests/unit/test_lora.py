"""LoRA and QLoRA pieces that need no process group: the TP styles of adapters (PEFT's names, each
adapter following its base's style), targets that match nothing, the spec's checks, NF4 storage
(bytes, tp refused) and the planner's terms (states for the adapters only, a cheaper backward)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from shardwise.errors import ConfigError  # noqa: E402
from shardwise.layout import Plan  # noqa: E402
from shardwise.models import hf  # noqa: E402
from shardwise.models.lora import LoRA, add_adapters, base_key  # noqa: E402


def _llama(**overrides):
    return hf.build_causal_lm(hf.tiny_config("llama", **overrides), seed=0)


def test_tp_plan_names_peft_pieces_and_follows_the_base() -> None:
    from shardwise.parallel.parallelize import validate

    model = add_adapters(_llama(), LoRA(r=4, targets=("q_proj", "o_proj")), seed=0)
    styles = dict(validate(model, Plan.parse("tp=2")).entries)
    attn = "base_model.model.model.layers.*.self_attn"
    assert styles[f"{attn}.q_proj.base_layer"] == "colwise" and styles[f"{attn}.q_proj.lora_B.*"] == "colwise"
    assert (
        styles[f"{attn}.q_proj.lora_A.*"] == "replicate" and styles[f"{attn}.q_proj.lora_dropout.*"] == "adapter_input"
    )
    assert styles[f"{attn}.o_proj.base_layer"] == "rowwise" and styles[f"{attn}.o_proj.lora_A.*"] == "rowwise"
    assert styles[f"{attn}.o_proj.lora_B.*"] == "adapter_sequence"
    assert styles[f"{attn}.k_proj"] == "colwise"  # no adapter: the layer itself


def test_a_user_plan_on_the_lora_layer_is_expanded_and_explicit_pieces_win() -> None:
    from shardwise.parallel.tp import TPStyles
    from shardwise.parallel.tp.adapters import adapter_styles

    model = add_adapters(_llama(layers=1), LoRA(r=4, targets=("q_proj",)), seed=0)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    out = adapter_styles(model, TPStyles.of({q: "colwise", f"{q}.lora_B.default": "replicate"}))
    assert out.entries[0] == (f"{q}.base_layer", "colwise") and out.entries[-1] == (f"{q}.lora_B.default", "replicate")
    with pytest.raises(ConfigError, match="cannot split the LoRA adapter"):
        adapter_styles(model, TPStyles.of({q: "vocab_embedding"}))


def test_a_target_matching_no_layer_is_one_line_with_candidates() -> None:
    with pytest.raises(ConfigError) as err:
        add_adapters(_llama(layers=1), LoRA(r=4, targets=("q_prj",)))
    text = str(err.value)
    assert "q_prj" in text and "did you mean q_proj" in text and "gate_proj" in text and "\n" not in text


def test_spec_checks_and_family_defaults() -> None:
    for bad in (dict(r=0), dict(alpha=0), dict(dropout=1.0), dict(base="int8"), dict(targets=())):
        with pytest.raises(ConfigError):
            LoRA(**bad)
    model = add_adapters(_llama(layers=1), LoRA(r=2))
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "base_layer")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (
        base_key("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )


def test_adapters_on_a_meta_model_equal_those_on_the_real_one() -> None:
    from shardwise.checkpoint.hf_load import parameters_on_meta

    config = hf.tiny_config("llama", layers=2)
    real = add_adapters(hf.build_causal_lm(config, seed=0), LoRA(r=4, init_b_zero=False), seed=5)
    with parameters_on_meta():
        meta_base = hf.build_causal_lm(config, seed=0)
    meta = add_adapters(meta_base, LoRA(r=4, init_b_zero=False), seed=5)
    adapters = {n: p for n, p in meta.named_parameters() if p.requires_grad}
    assert adapters and all(not p.is_meta for p in adapters.values())
    assert all(p.is_meta for n, p in meta.named_parameters() if not p.requires_grad)
    real_params = dict(real.named_parameters())
    assert all(torch.equal(p, real_params[n]) for n, p in adapters.items())


def test_nf4_base_bytes_and_tp_refused() -> None:
    pytest.importorskip("torchao")
    from shardwise.models.nf4 import parameter_bytes, quantize_base
    from shardwise.parallel.parallelize import validate

    model = add_adapters(_llama(hidden=64), LoRA(r=4), seed=0)
    fp32 = sum(
        p.numel() * 4
        for n, p in model.named_parameters()
        if not p.requires_grad and "embed" not in n and "lm_head" not in n and p.dim() == 2
    )
    names = quantize_base(model)
    assert names and all(".base_layer." in n for n in names)
    held = parameter_bytes(model)
    assert 0.125 < held["nf4"] / fp32 < 0.14  # 4.13 bits of 32
    x = torch.randint(0, 64, (2, 8))
    model(x).logits.sum().backward()  # gradients reach the adapters only
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
    with pytest.raises(ConfigError, match="tp cannot split the 4-bit NF4 weight"):
        validate(model, Plan.parse("tp=2"))


def test_planner_states_and_time_of_lora() -> None:
    from shardwise.plan.adapters import trainable_share, with_lora
    from shardwise.plan.cost import estimate
    from shardwise.plan.planner import cluster_of, stats_of

    stats = stats_of("gpt3-1.3b", seq=2048)
    cluster = cluster_of("h100", world_size=8)
    plan = Plan.parse("zero=3,shard=8")
    full = estimate(stats, cluster, plan, global_batch=32)
    lora = estimate(with_lora(stats, r=16), cluster, plan, global_batch=32)
    qlora = estimate(with_lora(stats, r=16, base="nf4"), cluster, plan, global_batch=32)
    share = trainable_share(with_lora(stats, r=16))
    assert 0.001 < share < 0.02
    assert lora.memory["optimizer"] == pytest.approx(full.memory["optimizer"] * share / (1 - share), rel=0.05)
    assert lora.memory["grads"] < 0.05 * full.memory["grads"]
    assert qlora.memory["params"] < 0.3 * lora.memory["params"]
    assert 0.6 < lora.step_time_s / full.step_time_s < 0.95  # backward without the base's weight gradients


def test_train_command_refuses_bad_lora_input_in_one_line(tmp_path, capsys) -> None:
    import os

    from shardwise.cli import main

    model_dir = tmp_path / "tiny"
    hf.save_tiny(str(model_dir), family="llama", texts=[open(os.__file__).read()[:3000]], vocab=64, layers=1)
    (tmp_path / "d.txt").write_text("some text\n" * 50)
    cases = [(["--model.hf", str(model_dir), "--lora.r", "4", "--lora.targets", "q_prj"], "did you mean q_proj"),
             (["--lora.r", "4"], "lora.r adds adapters to a Hugging Face model"),
             (["--model.hf", str(model_dir), "--lora.base", "nf4"], "add --lora.r")]
    for extra, expected in cases:
        code = main(
            [
                "train",
                "--data.files",
                str(tmp_path / "d.txt"),
                "--nproc",
                "1",
                "--run.runs_dir",
                str(tmp_path / "runs"),
                *extra,
            ]
            if "--model.hf" in extra
            else ["train", "--nproc", "1", "--run.runs_dir", str(tmp_path / "runs"), *extra]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and expected in err[-1], (extra, err)
    assert not (tmp_path / "runs").exists()  # nothing written
