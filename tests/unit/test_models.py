"""Built-in models: shapes, parameter counts, the FLOPs formula, determinism, causality."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models import GPT, GPTConfig, ResNet, SimpleNet, resnet_small

TINY = GPTConfig(vocab_size=50, seq_len=16, layers=2, hidden=32, heads=4, ffn=48)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread avoids thread hand-off costs (large on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_gpt_shapes_and_module_names() -> None:
    model = GPT(TINY)
    logits = model(torch.randint(0, 50, (3, 16)))
    assert logits.shape == (3, 16, 50)
    assert model(torch.randint(0, 50, (2, 5))).shape == (2, 5, 50)  # shorter than seq_len
    names = dict(model.named_modules())
    for name in (
        "tok_emb",
        "pos_emb",
        "blocks.1.ln1",
        "blocks.1.attn.q_proj",
        "blocks.1.attn.k_proj",
        "blocks.1.attn.v_proj",
        "blocks.1.attn.o_proj",
        "blocks.1.ln2",
        "blocks.1.mlp.fc_in",
        "blocks.1.mlp.fc_out",
        "ln_f",
        "lm_head",
    ):
        assert name in names, name
    assert isinstance(model.blocks, nn.ModuleList)
    with pytest.raises(ConfigError, match="exceeds the model's seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_gpt_param_count_matches_the_module() -> None:
    for cfg in (TINY, GPTConfig(vocab_size=99, seq_len=128, layers=4, hidden=128, heads=4)):
        model = GPT(cfg)
        assert cfg.param_count() == sum(p.numel() for p in model.parameters())
        emb = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
        assert cfg.param_count(embeddings=False) == cfg.param_count() - emb


def test_gpt_flops_formula() -> None:
    # 6 * non-embedding params + 12 * layers * hidden * seq_len, written out for TINY:
    h, f, v, layers, t = 32, 48, 50, 2, 16
    per_block = 4 * h + 4 * (h * h + h) + (h * f + f) + (f * h + h)
    n = layers * per_block + 2 * h + h * v + v
    assert TINY.flops_per_token() == 6 * n + 12 * layers * h * t
    # doubling the context only adds attention FLOPs
    longer = GPTConfig(vocab_size=50, seq_len=32, layers=2, hidden=32, heads=4, ffn=48)
    assert longer.flops_per_token() - TINY.flops_per_token() == 12 * layers * h * 16


def test_gpt_init_is_deterministic_from_the_seed() -> None:
    a, b, c = GPT(TINY, seed=3), GPT(TINY, seed=3), GPT(TINY, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and pa.ndim == 2:
            assert not torch.equal(pa, pc), name
    # the global RNG does not matter, and meta-built + init_weights gives the same values
    torch.manual_seed(123)
    with torch.device("meta"):
        meta = GPT(TINY)
    meta.to_empty(device="cpu")
    meta.init_weights(3)
    for pa, pm in zip(a.parameters(), meta.parameters()):
        assert torch.equal(pa, pm)
    std = a.blocks[0].attn.o_proj.weight.std().item()
    assert std < 0.02  # residual projections are scaled down by 1/sqrt(2 * layers)


def test_gpt_is_causal() -> None:
    model = GPT(TINY).eval()
    ids = torch.randint(0, 50, (1, 16))
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % 50
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt_forward_infers_local_heads_from_q_proj() -> None:
    """A colwise-sharded attention (half the heads, as with tp=2) runs the same code unchanged."""
    model = GPT(TINY).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 16, 32)
    full = attn(x)
    halves = []
    for part in range(2):
        local = type(attn)(TINY)
        rows = slice(part * 16, (part + 1) * 16)
        for proj in ("q_proj", "k_proj", "v_proj"):
            src, dst = getattr(attn, proj), getattr(local, proj)
            dst.weight = nn.Parameter(src.weight[rows].clone())
            dst.bias = nn.Parameter(src.bias[rows].clone())
        local.o_proj.weight = nn.Parameter(attn.o_proj.weight[:, rows].clone())
        local.o_proj.bias = nn.Parameter(attn.o_proj.bias.clone() / 2)
        halves.append(local(x))
    torch.testing.assert_close(halves[0] + halves[1], full, rtol=1e-5, atol=1e-6)


def test_gpt_generate_extends_the_prompt_reproducibly() -> None:
    model = GPT(TINY)
    prompt = torch.tensor([[1, 2, 3]])
    a = model.generate(prompt, 20, generator=torch.Generator().manual_seed(0), top_k=5)
    b = model.generate(prompt, 20, generator=torch.Generator().manual_seed(0), top_k=5)
    assert a.shape == (1, 23) and torch.equal(a, b) and torch.equal(a[:, :3], prompt)
    assert model.training  # generate restores the mode
    limited = model.generate(prompt, 30, generator=torch.Generator().manual_seed(0), vocab_limit=7)
    assert int(limited[:, 3:].max()) < 7


def test_gpt_kv_cache_gives_the_logits_of_the_full_forward() -> None:
    """A prompt of 5, a chunk of 3 after it (a partial causal mask over the cached keys), then one
    position at a time up to seq_len: every position's logits equal one forward of the whole
    sequence; past seq_len the cached call is refused like a long input."""
    from shardwise.models.kv_cache import KVCache

    model = GPT(TINY).eval()
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    cache = KVCache.empty(TINY.layers)
    parts = [model(ids[:, :5], cache=cache), model(ids[:, 5:8], cache=cache)]
    assert cache.length == 8 and cache.layers[1].k.shape == (2, 4, 8, 8)
    parts += [model(ids[:, i:i + 1], cache=cache) for i in range(8, 16)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="after 16 cached positions exceeds the model's seq_len=16"):
        model(ids[:, :1], cache=cache)


def test_gpt_config_errors() -> None:
    with pytest.raises(ConfigError, match="not divisible by heads"):
        GPTConfig(hidden=30, heads=4)


def test_simplenet_is_dense_relu_dropout_dense() -> None:
    net = SimpleNet(64, 256, 10, dropout=0.5, seed=0)
    assert [type(m) for m in net.children()] == [nn.Linear, nn.ReLU, nn.Dropout, nn.Linear]
    assert net(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    assert sum(p.numel() for p in net.parameters()) == 64 * 256 + 256 + 256 * 10 + 10
    again = SimpleNet(64, 256, 10, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), again.parameters()))


def test_resnet_shapes_and_batchnorm() -> None:
    net = resnet_small(seed=0)
    assert net(torch.randn(4, 1, 8, 8)).shape == (4, 10)
    rgb = ResNet(in_channels=3, num_classes=100, seed=0)
    assert rgb(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in net.modules()) == 1 + 3 * 2 * 2 + 2  # stem, blocks, 2 projections
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(resnet_small(seed=0))
    assert not any(type(m) is nn.BatchNorm2d for m in converted.modules())
    again = resnet_small(seed=0)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), again.parameters()))
