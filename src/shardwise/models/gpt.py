"""A small character-level GPT, written as plain single-device code.

Pre-norm decoder blocks (GPT-2 layout, Radford et al. 2019)::

    x = tok_emb(ids) + pos_emb(positions)
    for block in blocks:
        x = x + attn.o_proj(softmax(q k^T / sqrt(d) + causal mask) v)    with q, k, v from ln1(x)
        x = x + mlp.fc_out(gelu(mlp.fc_in(ln2(x))))
    logits = lm_head(ln_f(x))

Nothing here knows about parallelism, so tensor parallelism can be applied from outside by
module name: ``blocks.*.attn.{q,k,v}_proj`` and ``blocks.*.mlp.fc_in`` colwise,
``blocks.*.attn.o_proj`` and ``blocks.*.mlp.fc_out`` rowwise (Megatron-LM, Shoeybi et al. 2019).
For that the attention takes the *local* number of heads from the size of ``q_proj``'s output
(``q.view(B, T, -1, head_dim)``), so a colwise-sharded projection that yields ``heads / tp`` heads
works unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. ``ffn=0`` means ``4 * hidden``."""

    vocab_size: int = 128
    seq_len: int = 128
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    ffn: int = 0
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "layers", "hidden", "heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GPT {name}={getattr(self, name)} must be positive")
        if self.hidden % self.heads:
            raise ConfigError(f"GPT hidden={self.hidden} is not divisible by heads={self.heads}",
                              hint=f"use a hidden size that is a multiple of {self.heads}")
        if self.ffn < 0 or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPT ffn={self.ffn} must be >= 0 and dropout={self.dropout} in [0, 1)")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def param_count(self, *, embeddings: bool = True) -> int:
        """Parameters (weights and biases); ``embeddings=False`` leaves out ``tok_emb`` and ``pos_emb``."""
        h, f = self.hidden, self.ffn_size
        per_block = 2 * 2 * h + 4 * (h * h + h) + (h * f + f) + (f * h + h)  # ln1, ln2, attn, mlp
        body = self.layers * per_block + 2 * h + (h * self.vocab_size + self.vocab_size)  # + ln_f, lm_head
        return body + (self.vocab_size * h + self.seq_len * h if embeddings else 0)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: ``6 N + 12 L h T`` (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, app. B).

        ``N`` counts the non-embedding parameters (an embedding lookup does no multiply-adds):
        each costs 2 FLOPs per token forward and 4 backward. The attention scores ``q k^T`` and the
        weighted sum ``a v`` add ``2 * 2 * T * h`` forward per layer and token, times 3 with the
        backward. The causal mask is not subtracted (the kernels do not skip the masked half).
        """
        return 6 * self.param_count(embeddings=False) + 12 * self.layers * self.hidden * self.seq_len


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h = config.hidden
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.o_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: the local head count, which is heads / tp when the projections are colwise-sharded.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.hidden, config.ffn_size)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(config.ffn_size, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """``GPT(config, seed=0)``: ``forward(ids[B, T]) -> logits[B, T, vocab]``.

    Built on the ``meta`` device (``with torch.device("meta"): GPT(cfg)``) it allocates nothing;
    materialize with ``model.to_empty(device=...)`` then ``model.init_weights(seed)``.
    """

    def __init__(self, config: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_emb = nn.Embedding(config.seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size)
        if self.tok_emb.weight.device.type != "meta":
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """GPT-2 initialization from ``seed``: N(0, 0.02) weights, zero biases, unit LayerNorms, and
        the residual output projections (``o_proj``, ``fc_out``) scaled by ``1/sqrt(2 * layers)``.

        Values are drawn on the CPU in a fixed order of parameter names, so they are the same on
        every device and every rank; a DTensor parameter receives its shard of the same values.
        """
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                full = torch.zeros(param.shape)
            elif ".ln" in name or name.startswith("ln_f"):
                full = torch.ones(param.shape)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "fc_out.weight")) else 0.02
                full = torch.randn(param.shape, generator=gen) * std
            _copy_full(param, full)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.config.seq_len:
            raise ConfigError(f"input length {t} exceeds the model's seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=ids.device)
        x = self.drop(self.tok_emb(ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, vocab_limit: int | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of ``ids[B, T]`` (context cropped to ``seq_len``).

        ``vocab_limit``: sample only ids below it (a vocabulary padded for tensor parallelism has
        ids that stand for no character).
        """
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            logits = self(ids[:, -self.config.seq_len:])
            if hasattr(logits, "full_tensor"):  # a DTensor when tensor parallelism shards the vocabulary
                logits = logits.full_tensor()
            logits = logits[:, -1, :].float() / max(temperature, 1e-6)
            if vocab_limit is not None:
                logits[:, vocab_limit:] = float("-inf")
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(ids.device)
            ids = torch.cat([ids, nxt], dim=1)
        self.train(was_training)
        return ids


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-size CPU tensor into a parameter, or into its shard if it is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        param.copy_(distribute_tensor(full.to(param.device), param.device_mesh, param.placements))
    else:
        param.copy_(full)
