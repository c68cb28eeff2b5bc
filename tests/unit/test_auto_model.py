"""plan="auto" on any model, without processes: the sample's statistics, the shrunken copy that
certification runs on, the verdicts, and `shardwise plan --model-script` / `--model.hf`."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import pytest
import torch
from torch import nn

from shardwise.cli import main
from shardwise.errors import ConfigError
from shardwise.models import hf
from shardwise.auto.measure import sample_stats, stats_from_model_script
from shardwise.auto.certify import CertifyOptions, Verdict, shrink, shrink_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_first_sample_sets_the_shape_and_tokens_per_sample_overrides_it() -> None:
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
    stats = sample_stats(cnn, torch.zeros(1, 3, 16, 16))
    assert stats.seq == 1 and stats.params_total == sum(p.numel() for p in cnn.parameters())
    # forward FLOPs of one sample: the convolution's multiply-adds and the linear layer's
    assert stats.flops_per_sample == pytest.approx(2 * (16 * 16 * 8 * 3 * 9 + 8 * 16 * 16 * 10), rel=1e-6)
    llama = hf.build_causal_lm(hf.tiny_config("llama", seq=64), seed=0)
    assert sample_stats(llama, torch.zeros(1, 24, dtype=torch.long)).seq == 24  # token ids: dimension 1
    assert sample_stats(llama, torch.zeros(1, 24, dtype=torch.long), tokens_per_sample=48).seq == 48
    with pytest.raises(
        ConfigError, match=r"cannot run its first training sample \(a torch.float32 tensor of shape \(1, 5\)\)"
    ):
        sample_stats(nn.Linear(12, 4), torch.zeros(1, 5))


def test_hf_statistics_count_the_gated_mlp() -> None:
    llama = hf.build_causal_lm(hf.tiny_config("llama"), seed=0)
    gpt2 = hf.build_causal_lm(hf.tiny_config("gpt2"), seed=0)
    for model in (llama, gpt2):  # the closed forms count the real parameters (RMSNorm's missing bias aside: < 1%);
        stats = hf.stats_of_config(model.config, seq=16)  # without the gate, Llama's would be 20% short
        assert stats.params_total == pytest.approx(sum(p.numel() for p in model.parameters()), rel=0.01)


def test_shrink_keeps_the_layer_types_and_cuts_only_identical_blocks() -> None:
    llama = hf.build_causal_lm(hf.tiny_config("llama", layers=5), seed=0)
    small, what = shrink(llama, blocks=2)
    assert len(small.model.layers) == 2 and small.config.num_hidden_layers == 2 and not small.training
    assert len(llama.model.layers) == 5 and llama.config.num_hidden_layers == 5  # the original is untouched
    assert "2 of 5 blocks of 'model.layers'" in what
    ids = torch.zeros(2, 8, dtype=torch.long)
    assert small(ids).logits.shape == (2, 8, 64)
    torch.testing.assert_close(small.model.embed_tokens.weight, llama.model.embed_tokens.weight)  # the user's weights
    # widths differ from block to block: nothing is cut
    mlp = nn.Sequential(nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 4))
    assert len(shrink(mlp, blocks=2)[0]) == 3
    # a Sequential of identical blocks, the model itself
    stack = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    assert len(shrink(stack, blocks=2)[0]) == 2
    built, what = shrink_config(hf.tiny_config("mixtral", layers=4), blocks=2)
    assert built.config.num_hidden_layers == 2 and "2 of 4 layers" in what
    with pytest.raises(ConfigError, match="meta device"):
        shrink(nn.Linear(4, 4, device="meta"), blocks=2)


def test_verdicts_name_the_check_that_failed() -> None:
    ok = Verdict("dp=2", {"loss": 0.0, "grad norm": 2e-7, "weights": 1e-7}, rtol=1e-5, seconds=0.1)
    assert ok.passed and ok.failed is None
    bad = Verdict("dp=2", {"loss": 0.0, "grad norm": 3e-2, "weights": 1e-3}, rtol=1e-5, seconds=0.1, weight="0.weight")
    assert bad.failed == "grad norm diverged: max rel diff 0.03 > rtol 1e-05"
    assert not Verdict("tp=2", {"loss": math.nan, "grad norm": 0.0, "weights": 0.0}, rtol=1e-5, seconds=0.1).passed
    assert "did not run" in Verdict("pp=2", {}, rtol=1e-5, seconds=0.0, error="ConfigError: x").failed
    assert bad.to_dict()["failed"].startswith("grad norm") and bad.to_dict()["worst_weight"] == "0.weight"
    assert CertifyOptions().wanted(1000) and not CertifyOptions().wanted(999) and not CertifyOptions().wanted(None)
    assert CertifyOptions.of(True).wanted(1) and not CertifyOptions.of(False).wanted(10**6)
    with pytest.raises(ConfigError, match="certify="):
        CertifyOptions.of("yes")


def _plan(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *argv]) == 0
    return out.getvalue()


def test_plan_model_script_and_model_hf_print_the_trainers_table(tmp_path) -> None:
    """`--model-script` (a verify script) and `--model.hf` (a directory or its config.json) plan with
    the statistics Trainer(plan="auto") uses for the same model and sample length."""
    script = os.path.join(ROOT, "examples", "hf_verify_script.py")
    common = ["--devices", "8", "--device-type", "h100", "--top", "2"]
    by_script = _plan("--model-script", script, *common)
    hf.tiny_config("llama").to_json_file(str(tmp_path / "config.json"))
    by_dir = _plan("--model.hf", str(tmp_path), "--seq", "16", *common)
    by_file = _plan("--model.hf", str(tmp_path / "config.json"), "--seq", "16", *common)
    assert by_script == by_dir == by_file and "seq 16" in by_script
    llama = hf.build_causal_lm(hf.tiny_config("llama"), seed=0)
    assert stats_from_model_script(script) == sample_stats(llama, torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ConfigError, match="defines no build_model"):
        (tmp_path / "empty.py").write_text("X = 1\n")
        stats_from_model_script(str(tmp_path / "empty.py"))
    data = json.loads(_plan("--model.hf", str(tmp_path), *common, "--json"))
    assert data["seq"] == 32 and data["model"] == "llama"  # without --seq: the config's context length


class _Wrapped(nn.Module):
    """A user's two-line wrapper around an HF model, with a data-dependent op in its forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if ids.max().item() >= 0 else 0.0  # .item(): the meta device cannot run it
        return self.model(ids).logits * scale


class _ItemMLP(nn.Module):
    """Repeated blocks and an .item() in the forward, no config anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(4))
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x) * (1.0 if x.abs().max().item() < 1e9 else 0.0)
        return self.head(x)


def test_auto_sizing_falls_back_when_the_meta_forward_fails(caplog: pytest.LogCaptureFixture) -> None:
    """HF config in the tree, then one real CPU forward and backward at a short length scaled to
    the real one, then the parameter count; each logs which one sized the model."""
    import logging

    caplog.set_level(logging.INFO, logger="shardwise")
    config = hf.tiny_config("llama", seq=256)
    config._attn_implementation = "eager"
    wrapped = _Wrapped(hf.build_causal_lm(config, seed=0))
    stats = sample_stats(wrapped, torch.zeros(1, 256, dtype=torch.long))
    assert (
        stats.seq == 256
        and stats.blocks == 4
        and stats.params_total == pytest.approx(sum(p.numel() for p in wrapped.parameters()), rel=0.05)
    )
    assert (
        "from the Hugging Face config inside it" in caplog.text and "item" in caplog.text
    )  # and why the meta forward failed
    caplog.clear()
    mlp = _ItemMLP()
    ids = torch.randint(0, 32, (1, 256))
    stats = sample_stats(mlp, ids)
    assert stats.seq == 256 and stats.blocks == 4 and stats.params_total == sum(p.numel() for p in mlp.parameters())
    short = sample_stats(mlp, ids[:, :64])  # the CPU run is at 64 tokens: 256 scales its activations by 4
    assert stats.act_bytes_per_block == pytest.approx(4 * short.act_bytes_per_block) and stats.act_bytes_per_block > 0
    assert "by one forward and backward on the CPU (2 of its blocks, 64 of 256 tokens" in caplog.text
    caplog.clear()
    on_meta = _ItemMLP().to("meta")
    stats = sample_stats(on_meta, ids)
    assert (
        stats.blocks == 4 and stats.act_bytes_per_block == 34 * 64 * 256 and "from its parameter count" in caplog.text
    )
    with pytest.raises(ConfigError, match=r"cannot run its first training sample .*on the meta device .*on the CPU"):
        sample_stats(_ItemMLP(), torch.zeros(1, 4))  # float ids: cannot run at all
    small, what = shrink(wrapped, blocks=2)  # certification's copy: the HF config inside says 2 layers
    assert (
        "2 of 4 blocks" in what
        and small.model.config.num_hidden_layers == 2
        and wrapped.model.config.num_hidden_layers == 4
    )
