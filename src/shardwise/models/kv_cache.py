"""A key/value cache for the built-in GPT's attention, so decoding runs one new position per step.

Causal attention at position ``i`` reads the keys and values of positions ``0..i`` only, and those
do not change when later tokens arrive. So a decoder keeps each layer's ``k`` and ``v``
(``[B, heads, T, head_dim]``) and feeds only the new tokens: the step costs ``O(T)`` attention and
no recomputation of the earlier positions' projections and MLPs, instead of a full ``O(T^2)``
forward over the whole sequence.

The cache holds whatever the attention computes: under tensor parallelism the projections are
split by heads, so each rank caches its own ``heads / tp`` heads and no cache tensor is ever
communicated. It is a plain object passed into ``GPT.forward(ids, cache=...)`` and extended there
in place; the model keeps no state between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerKV:
    """One layer's cached keys and values, ``[B, heads, T, head_dim]`` each (None: empty)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' ``k``, ``v`` (along the sequence, dim 2); returns all of them."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


@dataclass
class KVCache:
    """The cache of every layer; ``length``: the positions it holds (the next token's position)."""

    layers: list[LayerKV] = field(default_factory=list)

    @classmethod
    def empty(cls, layers: int) -> KVCache:
        return cls([LayerKV() for _ in range(layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


def causal_mask(past: int, new: int, *, device: torch.device) -> torch.Tensor | None:
    """The boolean attention mask ``[new, past + new]`` of ``new`` queries at positions
    ``past..past+new-1`` over all keys: query ``i`` sees key ``j`` iff ``j <= past + i``. None when
    no key is masked (one query sees every cached key)."""
    if new == 1:
        return None
    keys = torch.arange(past + new, device=device)
    queries = torch.arange(past, past + new, device=device)
    return keys[None, :] <= queries[:, None]
