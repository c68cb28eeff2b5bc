"""The chunked LM head + cross-entropy on one device (no process group): the math against
``F.cross_entropy(F.linear(...))`` at fp32 rounding for ragged chunks, masks, bias and both
reductions; the head that passes its input through while training; and the one-line refusals
(no head, a loss that is not the token cross-entropy, a model that changes the logits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.chunked_loss import ChunkedLoss, find_lm_head, install_chunked_head, loss_reduction
from shardwise.parallel.linear_ce import chunk_tokens, linear_cross_entropy
from shardwise.plan.support import runtime_conflict
from shardwise.auto.choose import chunkable_loss


def _grads(fn, *tensors):
    for t in tensors:
        t.grad = None
    loss = fn()
    (3.0 * loss).backward()  # a loss scale reaches every gradient
    return loss.detach(), [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("chunk", [1, 7, 36, None])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_cross_entropy_equals_the_unchunked_loss(chunk, reduction, bias) -> None:
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(4, 9, 16, generator=gen) * 0.5).requires_grad_()
    w = (torch.randn(50, 16, generator=gen) * 0.5).requires_grad_()
    b = torch.randn(50, generator=gen).requires_grad_() if bias else None
    y = torch.randint(0, 50, (4, 9), generator=gen)
    y[0, :5] = -100
    y[2, 3] = -100
    leaves = [t for t in (h, w, b) if t is not None]
    want, want_grads = _grads(
        lambda: F.cross_entropy(F.linear(h, w, b).flatten(0, 1), y.flatten(), reduction=reduction), *leaves
    )
    got, got_grads = _grads(lambda: linear_cross_entropy(h, w, b, y, reduction=reduction, chunk=chunk), *leaves)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_edge_cases() -> None:
    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 3, 8, generator=gen), torch.randn(20, 8, generator=gen)
    # no valid target: F.cross_entropy's mean is nan, the sum 0
    none = torch.full((2, 3), -100)
    assert torch.isnan(linear_cross_entropy(h, w, None, none)) and torch.isnan(
        F.cross_entropy(F.linear(h, w).flatten(0, 1), none.flatten())
    )
    assert float(linear_cross_entropy(h, w, None, none, reduction="sum")) == 0.0
    # a frozen head gets no gradient, the input still does
    hg = h.clone().requires_grad_()
    linear_cross_entropy(hg, w, None, torch.randint(0, 20, (2, 3), generator=gen)).backward()
    assert hg.grad is not None and w.grad is None
    # under autocast the matmuls run in bf16, the softmax in fp32: as autocast's own head + loss
    y = torch.randint(0, 20, (2, 3), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(h, w).flatten(0, 1).float(), y.flatten())
        got = linear_cross_entropy(h, w, None, y, chunk=2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    with pytest.raises(ConfigError, match="hidden states but"):
        linear_cross_entropy(h, w, None, y.flatten()[:5])


def test_chunk_rule() -> None:
    assert chunk_tokens(8192, hidden=4096, vocab_local=128_256) == 262  # a Llama-3 head: 32 chunks
    assert chunk_tokens(64, hidden=32, vocab_local=200) == 11
    assert chunk_tokens(64, hidden=32, vocab_local=16) == 64  # a vocabulary below the width: one chunk
    assert chunk_tokens(1, hidden=4096, vocab_local=10**6) == 1


SHAPE = GPTConfig(vocab_size=96, seq_len=8, layers=1, hidden=16, heads=2)


def _gpt_loss(output, targets):
    return F.cross_entropy(output.flatten(0, 1), targets.flatten())


def test_a_chunked_head_trains_like_the_plain_one_and_evaluates_to_logits() -> None:
    plain, chunked = GPT(SHAPE, seed=3), GPT(SHAPE, seed=3)
    head = install_chunked_head(chunked)
    assert head is chunked.lm_head and install_chunked_head(chunked) is head  # idempotent, names and parameters kept
    assert list(dict(chunked.named_parameters())) == list(dict(plain.named_parameters()))
    loss_fn = ChunkedLoss(head, _gpt_loss)
    gen = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 96, (3, 8), generator=gen), torch.randint(0, 96, (3, 8), generator=gen)
    y[1, 2:] = -100
    want = _gpt_loss(plain(ids), y)
    want.backward()
    out = chunked(ids)
    assert out.shape == (3, 8, 16)  # training: the head passed the hidden states through
    got = loss_fn(out, y)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for (name, p), q in zip(chunked.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    chunked.eval()
    with torch.no_grad():
        logits = chunked(ids)
        assert logits.shape == (3, 8, 96)  # evaluation: the logits, and the user's loss on them
        torch.testing.assert_close(loss_fn(logits, y), _gpt_loss(plain.eval()(ids), y), rtol=1e-6, atol=0)


class SoftCapped(nn.Module):
    """A model that changes the logits after its head (Gemma 2's final soft-cap)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(SHAPE, seed=0)

    def forward(self, ids):
        return 30.0 * torch.tanh(self.gpt(ids) / 30.0)


def test_chunked_loss_says_in_one_line_when_it_cannot_apply() -> None:
    with pytest.raises(ConfigError, match="has no LM head"):
        find_lm_head(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
    with pytest.raises(ConfigError, match="is not the token cross-entropy"):
        loss_reduction(lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), label_smoothing=0.1), 96)
    with pytest.raises(ConfigError, match="loss_fn failed on a"):
        loss_reduction(lambda out, y: F.mse_loss(out, y), 96)
    assert loss_reduction(lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum"), 96) == "sum"
    model = SoftCapped()
    loss_fn = ChunkedLoss(install_chunked_head(model), _gpt_loss)
    ids = torch.randint(0, 96, (2, 8))
    with pytest.raises(ConfigError, match="changes the logits after its head"):
        loss_fn(model(ids), ids)
    assert runtime_conflict(Plan.parse("zero=1,shard=2,precision=bf16,params16")) is not None
    # plan="auto" considers chunked_loss only where it can run
    assert chunkable_loss(GPT(SHAPE), _gpt_loss) and not chunkable_loss(GPT(SHAPE), None)
    assert not chunkable_loss(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3)), _gpt_loss)
    assert not chunkable_loss(
        GPT(SHAPE), lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), label_smoothing=0.1)
    )
    with pytest.raises(ConfigError, match="params16 needs a 16-bit precision"):
        Plan.parse("params16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_liger_and_the_chunked_path_agree() -> None:
    """On CUDA the chunked loss is Liger's kernel where it is installed, else ours: both equal the
    unchunked head + loss (fp32 to rounding; bf16 to bf16 rounding)."""
    liger = pytest.importorskip("liger_kernel")
    assert liger is not None
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(8, 64, 128, generator=gen) * 0.5).cuda().requires_grad_()
    w = (torch.randn(5000, 128, generator=gen) * 0.05).cuda().requires_grad_()
    y = torch.randint(0, 5000, (8, 64), generator=gen).cuda()
    y[:, :10] = -100
    model = nn.Module()
    model.lm_head = nn.Linear(128, 5000, bias=False).cuda()
    model.lm_head.weight = nn.Parameter(w.detach().clone())
    head = install_chunked_head(model)
    loss_fn = ChunkedLoss(head, lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))
    out = head(h)  # training: the hidden states, stashed for the loss
    via_liger, liger_grads = _grads(lambda: loss_fn(out, y), h, head.weight)
    ours, our_grads = _grads(lambda: linear_cross_entropy(h, w, None, y), h, w)
    want, want_grads = _grads(lambda: F.cross_entropy(F.linear(h, w).flatten(0, 1), y.flatten()), h, w)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(via_liger, want, rtol=1e-4, atol=0)
    for a, b, c in zip(liger_grads, our_grads, want_grads):
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-3, atol=1e-5)
