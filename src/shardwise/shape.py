"""The shape of a decoder-only transformer: one value for the built-in GPT, the job configuration,
the verify workload and the planner (a leaf: it imports nothing of shardwise but its errors).

``TransformerShape(layers=4, hidden=128, heads=4, vocab_size=128, seq_len=128)`` is GPT-2's layout
by default (learned positions, biases, GELU MLP of ``ffn = 4 * hidden``). The planner also reads
the fields that describe other families: grouped-query attention (``kv_heads``), tied embeddings,
no biases, rotary positions (``learned_positions=False``), eager attention (keeps the ``s^2``
softmax) and separate q/k/v projections. A model implementation refuses the fields it does not
implement (the built-in GPT: see :class:`shardwise.models.gpt.GPT`).

Field metadata (``help``, ``min``, ``max``) is what ``shardwise train --help`` prints for the job's
``[model]`` table; :mod:`shardwise.config` reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from shardwise.errors import ConfigError

ATTENTION = ("fused", "eager")

# Keys a model spec (JSON, a Hugging Face config, a Python dict) may use for the same field.
ALIASES = {
    "n_layer": "layers", "num_layers": "layers", "num_hidden_layers": "layers",
    "n_embd": "hidden", "hidden_size": "hidden", "d_model": "hidden",
    "n_head": "heads", "num_heads": "heads", "num_attention_heads": "heads",
    "vocab": "vocab_size", "seq": "seq_len", "n_ctx": "seq_len", "n_positions": "seq_len",
    "max_position_embeddings": "seq_len",
    "ffn_size": "ffn", "intermediate_size": "ffn", "n_inner": "ffn",
    "num_kv_heads": "kv_heads", "num_key_value_heads": "kv_heads",
    "tie_embeddings": "tied_embeddings", "tie_word_embeddings": "tied_embeddings",
    "num_experts": "experts", "num_local_experts": "experts", "moe_experts": "experts",
    "num_experts_per_tok": "top_k", "moe_top_k": "top_k", "moe_intermediate_size": "expert_ffn",
    "router_aux_loss_coef": "aux_loss",
}
REQUIRED = ("layers", "hidden", "heads", "vocab_size", "seq_len")


def _opt(default: Any, help: str, *, min: float | None = None, max: float | None = None) -> Any:  # noqa: A002
    return field(default=default, metadata={"help": help, "min": min, "max": max})


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer by its shape (see the module doc)."""

    layers: int = _opt(4, "transformer blocks", min=1)
    hidden: int = _opt(128, "hidden size (a multiple of heads)", min=8)
    heads: int = _opt(4, "attention heads", min=1)
    vocab_size: int = _opt(128, "vocabulary size", min=1)
    seq_len: int = _opt(128, "context length (tokens; characters for the built-in job)", min=8)
    ffn: int = _opt(0, "MLP inner size (0: 4 * hidden)", min=0)
    kv_heads: int = _opt(0, "key/value heads for grouped-query attention (0: heads)", min=0)
    dropout: float = _opt(0.0, "dropout probability", min=0.0, max=0.9)
    tied_embeddings: bool = _opt(False, "the LM head shares the token embedding's weight")
    bias: bool = _opt(True, "linear layers and norms have biases")
    learned_positions: bool = _opt(True, "learned position embeddings (False: rotary, nothing learned)")
    attention: str = _opt(
        "fused", "fused (scaled_dot_product_attention / FlashAttention) or eager (keeps the s^2 softmax)"
    )
    separate_qkv: bool = _opt(False, "q, k and v are three Linear layers instead of one fused projection")
    experts: int = _opt(0, "experts per MoE layer (0: a dense MLP in every block)", min=0)
    top_k: int = _opt(2, "experts each token is routed to (MoE)", min=1)
    expert_ffn: int = _opt(0, "inner size of each expert (0: ffn)", min=0)
    aux_loss: float = _opt(0.01, "weight of the MoE load-balancing loss (sequence-wise)", min=0.0)
    name: str = _opt("", "a name for tables and reports")

    def __post_init__(self) -> None:
        if isinstance(self.dropout, bool):  # a planner spec's "dropout": true (the planner only asks whether)
            object.__setattr__(self, "dropout", 0.1 if self.dropout else 0.0)
        for key in REQUIRED:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model shape {key}={value!r} must be a positive integer", hint=f"e.g. {key}=8")
        for key in ("ffn", "kv_heads"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"model shape {key}={value!r} must be a non-negative integer", hint="leave it out for the default"
                )
        if self.hidden % self.heads:
            raise ConfigError(f"model shape hidden={self.hidden} is not divisible by heads={self.heads}",
                              hint=f"use a hidden size that is a multiple of {self.heads}")
        if self.heads % self.kv_heads_:
            raise ConfigError(f"model shape kv_heads={self.kv_heads} does not divide heads={self.heads}",
                              hint="use a divisor of heads (or leave kv_heads out)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model shape dropout={self.dropout} must lie in [0, 1)")
        for key in ("experts", "expert_ffn"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"model shape {key}={value!r} must be a non-negative integer", hint="0 for a dense model"
                )
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"model shape top_k={self.top_k} must lie in [1, experts={self.experts}]",
                              hint="route each token to at most as many experts as there are")
        if self.attention not in ATTENTION:
            raise ConfigError(f"model shape attention={self.attention!r} is unknown",
                              hint='use "fused" (scaled_dot_product_attention / FlashAttention) or "eager"')

    # -- derived ---------------------------------------------------------------------------
    @property
    def ffn_(self) -> int:
        """The MLP's inner size (``ffn`` or ``4 * hidden``)."""
        return self.ffn or 4 * self.hidden

    ffn_size = ffn_

    @property
    def expert_ffn_(self) -> int:
        """Each expert's inner size (``expert_ffn`` or ``ffn_``)."""
        return self.expert_ffn or self.ffn_

    @property
    def kv_heads_(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def param_count(self, *, embeddings: bool = True) -> int:
        """Parameters (weights and biases); ``embeddings=False`` leaves out the token and position
        embeddings. Attention ``4 h^2`` (``2 h^2 (1 + kv/h)`` with grouped-query attention), MLP
        ``2 h f`` (with ``E`` experts: ``E`` MLPs of ``2 h f_e`` and a router of ``h E``), two
        LayerNorms per block, a final norm and the LM head (shared when tied)."""
        h, f, v, b = self.hidden, self.ffn_, self.vocab_size, int(self.bias)
        kv = self.head_dim * self.kv_heads_
        attn = 2 * h * h + 2 * h * kv + b * (2 * h + 2 * kv)
        mlp = (
            2 * h * f + b * (f + h) if not self.experts else self.experts * 2 * h * self.expert_ffn_ + h * self.experts
        )
        per_block = attn + mlp + 4 * h
        head = 2 * h + (0 if self.tied_embeddings else v * h + b * v)
        embed = v * h + (self.seq_len * h if self.learned_positions else 0)
        body = self.layers * per_block + head
        if self.tied_embeddings and not embeddings:
            body += v * h  # the shared matrix is the LM head's weight too
        return body + (embed if embeddings else 0)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: ``6 N + 12 L h T`` (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, app. B).

        ``N`` counts the non-embedding parameters (an embedding lookup does no multiply-adds):
        each costs 2 FLOPs per token forward and 4 backward. The attention scores ``q k^T`` and the
        weighted sum ``a v`` add ``2 * 2 * T * h`` forward per layer and token, times 3 with the
        backward. The causal mask is not subtracted (the kernels do not skip the masked half). With
        experts only the ``top_k`` a token is routed to count (its active parameters).
        """
        idle = self.layers * (self.experts - self.top_k) * 2 * self.hidden * self.expert_ffn_ if self.experts else 0
        return 6 * (self.param_count(embeddings=False) - idle) + 12 * self.layers * self.hidden * self.seq_len

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], *, name: str = "") -> TransformerShape:
        """From a spec dict; accepts the common spellings (``n_layer``, ``hidden_size``, ``vocab``,
        ``seq``, ``num_key_value_heads`` ...; see :data:`ALIASES`)."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {"name": name} if name else {}
        for key, value in data.items():
            key = ALIASES.get(key, key)
            if key not in known:
                raise ConfigError(f"model spec key {key!r} is unknown",
                                  hint="use layers, hidden, heads, vocab, seq, ffn, kv_heads, tied_embeddings, bias, "
                                       "learned_positions, attention, dropout")
            values[key] = value
        missing = [k for k in REQUIRED if k not in values]
        if missing:
            raise ConfigError(f"model spec is missing {missing[0]!r}",
                              hint='e.g. {"layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200, "seq": 2048}')
        return cls(**values)

    @classmethod
    def from_json(cls, text: str, *, name: str = "") -> TransformerShape:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model spec is not JSON ({exc.msg} at column {exc.colno})",
                              hint='e.g. {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 64}') from None
        if not isinstance(data, dict):
            raise ConfigError(
                "model spec must be a JSON object",
                hint='e.g. {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 64}',
            )
        return cls.from_dict(data, name=name)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
