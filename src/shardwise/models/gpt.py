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

Decoding: ``forward(ids, cache=KVCache.empty(layers))`` runs the prompt and keeps every layer's
keys and values in the cache; each later call feeds only the new tokens (at positions
``cache.length, ...``) and attends over the cached ones (:mod:`shardwise.models.kv_cache`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.kv_cache import KVCache, LayerKV, causal_mask
from shardwise.models.moe import MoE
from shardwise.shape import TransformerShape


def GPTConfig(**fields: Any) -> TransformerShape:  # noqa: N802 - named like the value it builds
    """The built-in GPT's shape: a :class:`~shardwise.shape.TransformerShape` with the GPT's own
    layout (separate q/k/v projections, learned positions, biases, untied LM head). ``ffn=0``
    means ``4 * hidden``."""
    return TransformerShape(**{"separate_qkv": True, "name": "gpt", **fields})


# What this implementation realizes of a TransformerShape; any other value is refused.
_FIXED = {"kv_heads": (0,), "tied_embeddings": (False,), "bias": (True,), "learned_positions": (True,),
          "attention": ("fused",)}


def _gpt_shape(config: TransformerShape) -> TransformerShape:
    """``config`` as the GPT realizes it (separate q/k/v), or a ConfigError naming the field it lacks."""
    if not isinstance(config, TransformerShape):
        raise ConfigError(
            f"GPT takes a TransformerShape, got {type(config).__name__}", hint="build it with GPTConfig(...)"
        )
    for key, allowed in _FIXED.items():
        value = getattr(config, key)
        if value not in allowed and not (key == "kv_heads" and value == config.heads):
            raise ConfigError(f"the built-in GPT does not implement {key}={value!r}",
                              hint=f"leave {key} at its default ({allowed[0]!r}), or bring your own model")
    return replace(config, separate_qkv=True, name=config.name or "gpt")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TransformerShape) -> None:
        super().__init__()
        h = config.hidden
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.o_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        """``kv``: this layer's cache; ``x`` then holds the positions after the cached ones, whose
        keys and values are appended to it, and the queries attend over all of them."""
        b, t, _ = x.shape
        # -1: the local head count, which is heads / tp when the projections are colwise-sharded.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        past = kv.length if kv is not None else 0
        if kv is not None:
            k, v = kv.extend(k, v)
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_mask(past, t, device=x.device), dropout_p=dropout
            )
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: TransformerShape) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.hidden, config.ffn_size)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(config.ffn_size, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, config: TransformerShape) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.mlp: nn.Module = MLP(config) if not config.experts else MoE(
            config.hidden, config.expert_ffn_, config.experts, config.top_k, config.aux_loss)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)) if kv is None else self.attn(self.ln1(x), kv))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """``GPT(config, seed=0)``: ``forward(ids[B, T]) -> logits[B, T, vocab]``.

    Built on the ``meta`` device (``with torch.device("meta"): GPT(cfg)``) it allocates nothing;
    materialize with ``model.to_empty(device=...)`` then ``model.init_weights(seed)``.
    """

    def __init__(self, config: TransformerShape, *, seed: int = 0) -> None:
        super().__init__()
        config = self.config = _gpt_shape(config)
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
        the residual output projections (``o_proj``, ``fc_out``, the experts' ``down_proj``) scaled by
        ``1/sqrt(2 * layers)``.

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
                std = residual_std if name.endswith(("o_proj.weight", "fc_out.weight", "experts.down_proj")) else 0.02
                full = torch.randn(param.shape, generator=gen) * std
            _copy_full(param, full)

    def forward(
        self, ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """``position_ids`` (``[T]`` or ``[B, T]``, default ``0..T-1``): the tokens' positions, for a
        caller that feeds part of a sequence (context parallel's chunks). ``cache``: a
        :class:`~shardwise.models.kv_cache.KVCache` of the positions before ``ids`` (the default
        positions then start at ``cache.length``), extended in place with those of ``ids``."""
        t = ids.shape[1]
        past = cache.length if cache is not None else 0
        if past + t > self.config.seq_len:
            cached = f" after {past} cached positions" if past else ""
            raise ConfigError(f"input length {t}{cached} exceeds the model's seq_len={self.config.seq_len}")
        pos = torch.arange(past, past + t, device=ids.device) if position_ids is None else position_ids
        x = self.drop(self.tok_emb(ids) + self.pos_emb(pos))
        for i, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache.layers[i])
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
