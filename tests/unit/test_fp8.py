"""FP8 conversion on one process (torchao's float8 training API, emulated on this CPU) and the
per-block compile's eager fallback. The distributed parity of both is tests/distributed/test_fp8.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.compile import apply_compile, inductor_missing
from shardwise.parallel.fp8 import Fp8Options, apply_fp8, compute_precision

pytest.importorskip("torchao")


class Odd(nn.Module):
    """A block with one layer the FP8 kernels cannot take (20 output features) and an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 20)
        self.down = nn.Linear(20, 32)
        self.lm_head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.down(F.gelu(self.odd(F.gelu(self.up(self.embed(ids)))))))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture()
def parallel_log():
    handler, logger = Lines(), logging.getLogger("shardwise.parallel")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(old)


def kinds(model: nn.Module) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_sizes_not_a_multiple_of_16_and_the_head_stay_high_precision_and_are_named(parallel_log) -> None:
    torch.manual_seed(0)
    model = Odd()
    conversion = apply_fp8(model, recipe="tensorwise")
    assert kinds(model) == {"up": "Float8Linear", "odd": "Linear", "down": "Linear", "lm_head": "Linear"}
    assert conversion.converted == ("up",)
    assert dict(conversion.kept) == {
        "odd": "64x20 is not a multiple of 16",
        "down": "20x32 is not a multiple of 16",
        "lm_head": "LM head",
    }
    line = next(x for x in parallel_log if x.startswith("fp8 (tensorwise)"))
    for name in ("up", "odd (64x20 is not a multiple of 16)", "lm_head (LM head)", "emulated"):
        assert name in line, line
    loss = F.cross_entropy(model(torch.randint(0, 64, (2, 8))).flatten(0, 1), torch.randint(0, 64, (16,)))
    loss.backward()  # no opaque kernel error: the odd layer never reaches an FP8 GEMM
    assert model.odd.weight.grad is not None and model.up.weight.grad is not None


def test_the_user_filter_and_keep_head_override_the_default() -> None:
    model = GPT(GPTConfig(vocab_size=64, hidden=32, heads=2, layers=2, seq_len=8))
    conversion = apply_fp8(
        model,
        recipe="rowwise",
        options=Fp8Options(filter=lambda m, name: "mlp" not in name, keep_head=False),
        log_it=False,
    )
    got = kinds(model)
    assert got["lm_head"] == "Float8Linear" and got["blocks.0.attn.q_proj"] == "Float8Linear"
    assert got["blocks.1.mlp.fc_in"] == "Linear"
    assert ("blocks.1.mlp.fc_out", "filter") in conversion.kept
    assert model.blocks[0].attn.q_proj.config.round_scales_to_power_of_2  # rowwise: torchao's recipe


def test_fp8_numerics_are_fp8_and_scales_are_powers_of_two() -> None:
    """Emulated FP8 is not fp32 (it really rounds), yet close; power-of-two scales make the output
    of a row independent of the other rows in the batch (the property the parity tests rely on)."""
    torch.manual_seed(0)
    ref = nn.Linear(32, 32)
    x = torch.randn(8, 32) * torch.linspace(0.1, 10, 8)[:, None]  # rows of very different magnitude
    for po2, split_invariant in ((True, True), (False, False)):
        layer = nn.Sequential(nn.Linear(32, 32))
        layer[0].load_state_dict(ref.state_dict())
        apply_fp8(layer, recipe="tensorwise", options=Fp8Options(power_of_2_scales=po2), log_it=False)
        with torch.no_grad():
            whole, halves = layer(x), torch.cat([layer(x[:4]), layer(x[4:])])
        exact = ref(x).detach()
        assert not torch.equal(whole, exact)
        assert float((whole - exact).norm() / exact.norm()) < 0.05  # e4m3: 3 mantissa bits
        assert torch.equal(whole, halves) == split_invariant


def test_bad_fp8_input_is_one_line() -> None:
    with pytest.raises(ConfigError, match="high_precision"):
        Fp8Options(high_precision="fp16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="fp8_recipe"):
        Plan.parse("dp=1,precision=fp8,fp8_recipe=blockwise")
    with pytest.raises(ConfigError, match="tensorwise"):
        apply_fp8(
            nn.Sequential(nn.Linear(16, 16)),
            recipe="rowwise",
            options=Fp8Options(fsdp_float8_all_gather=True),
            fsdp=True,
        )
    assert (
        compute_precision("fp8", None) == "bf16"
        and compute_precision("fp8", Fp8Options(high_precision="fp32")) == "fp32"
    )
    assert compute_precision("bf16", None) == "bf16"


def test_compile_without_a_cpp_compiler_runs_eagerly_and_says_so(parallel_log) -> None:
    import torch._inductor.config as inductor

    assert inductor_missing("cpu") is None  # this machine has g++
    model = GPT(GPTConfig(vocab_size=64, hidden=32, heads=2, layers=2, seq_len=8))
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        assert "no C++ compiler" in (inductor_missing("cpu") or "")
        assert apply_compile(model, device_type="cpu") == []
    assert any(line.startswith("plan compile: running eagerly, no C++ compiler") for line in parallel_log), parallel_log
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model.modules())
