"""What the decode loop asks of a model: one call, ``logits, cache = lm(ids, cache, use_cache=...)``.

``ids[B, T]`` are the positions after those ``cache`` holds (all of the sequence when ``cache``
is None); ``logits[B, T, V]`` are the model's, and the returned cache holds the keys and values
of every position so far (None when ``use_cache`` is False: the caller then feeds the whole
sequence again at every step). Two models speak it, each through a small adapter, so the loop in
:mod:`shardwise.generate.decode` has no branch on the kind of model:

- a Hugging Face causal LM: ``model(input_ids=ids, use_cache=..., past_key_values=cache)`` (the
  cache keyword is ``cache`` in recent transformers 5 releases), logits and cache read off the
  ``ModelOutput``;
- the built-in GPT: ``model(ids, cache=KVCache)`` (:mod:`shardwise.models.kv_cache`), the cache
  created empty for the prefill and extended in place.

Both run through the module's own ``__call__``, so the parallel wrappers' hooks (FSDP's
all-gathers, DDP) run as in any forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise.models.gpt import GPT
from shardwise.models.hf import logits_of
from shardwise.models.kv_cache import KVCache


class CausalLM(Protocol):
    """A model as the decode loop calls it (module doc); ``module`` is the parallelized module."""

    module: nn.Module

    def __call__(self, ids: torch.Tensor, cache: Any, *, use_cache: bool) -> tuple[torch.Tensor, Any]: ...


def _cache_argument(model: nn.Module) -> str:
    """The keyword the model's forward takes its KV cache by: ``cache`` in recent transformers 5
    releases, ``past_key_values`` before (still accepted there, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(_innermost(model).forward).parameters else "past_key_values"


def _innermost(model: nn.Module) -> nn.Module:
    """The model under its wrappers (DDP's ``module``, peft's ``get_base_model()``), whose forward
    names the keywords (a wrapper's takes ``**kwargs`` and passes them on)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            inner = model.module
        elif callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        else:
            return model
        if inner is model:
            return model
        model = inner


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@dataclass(frozen=True)
class HFCausalLM:
    """A Hugging Face causal LM (or anything with its calling convention)."""

    module: nn.Module

    def __call__(self, ids: torch.Tensor, cache: Any, *, use_cache: bool) -> tuple[torch.Tensor, Any]:
        past = {} if cache is None else {_cache_argument(self.module): cache}
        out = self.module(input_ids=ids, use_cache=use_cache, **past)
        return logits_of(out), _cache_of(out) if use_cache else None


@dataclass(frozen=True)
class GPTCausalLM:
    """The built-in GPT (possibly wrapped by DDP or sharded by FSDP/TP) with its KV cache."""

    module: nn.Module
    layers: int

    def __call__(
        self, ids: torch.Tensor, cache: KVCache | None, *, use_cache: bool
    ) -> tuple[torch.Tensor, KVCache | None]:
        if not use_cache:
            return self.module(ids), None
        cache = cache if cache is not None else KVCache.empty(self.layers)
        return self.module(ids, cache=cache), cache


def causal_lm(module: nn.Module) -> CausalLM:
    """The adapter for ``module``: the GPT's own for the built-in GPT, else the Hugging Face one."""
    inner = module.module if isinstance(module, DistributedDataParallel) else module
    if isinstance(inner, GPT):  # FSDP2's fully_shard keeps the class as a base of the one it makes
        return GPTCausalLM(module, layers=len(inner.blocks))
    return HFCausalLM(module)
