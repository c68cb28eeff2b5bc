"""What ``shardwise verify`` trains: the built-in GPT on random tokens with ragged loss masks, or a
user's ``--script`` file.

A workload has ``build(seed) -> nn.Module``, ``batch(step, size) -> (inputs, targets)`` (the same
global batch on every rank for a step) and ``loss(output, target)``.

**Ragged masks** (:func:`ragged_mask`): each sample keeps one contiguous span of its targets, of
random start and length (from none to all of them), the rest set to ``-100``, as a prompt before a
completion and padding after it do. Micro-batches, data-parallel shards, context-parallel chunks
and pipeline microbatches then all hold different numbers of valid targets, some none: a
weighting that counts samples instead of valid targets diverges from one process on them, one
that counts tokens (``loss_reduction="tokens"``) must not.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.reduction import IGNORE_INDEX
from shardwise.shape import TransformerShape

SMALL_GPT = GPTConfig(vocab_size=64, seq_len=16, layers=2, hidden=32, heads=4)


def ragged_mask(targets: torch.Tensor, generator: torch.Generator, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``targets [B, S]`` with all but one random span per sample set to ``ignore_index`` (module doc)."""
    out = targets.clone()
    b, s = targets.shape
    starts = torch.randint(0, s, (b,), generator=generator)
    for row in range(b):
        start = int(starts[row])
        length = int(torch.randint(0, s - start + 1, (1,), generator=generator))
        keep = torch.zeros(s, dtype=torch.bool)
        keep[start:start + length] = True
        out[row, ~keep] = ignore_index
    return out


@dataclass(frozen=True)
class GPTWorkload:
    """shardwise's GPT of ``shape`` (small by default) on random token ids (next-token
    cross-entropy, a mean over the valid targets); ``masked``: with ragged loss masks."""

    shape: TransformerShape = SMALL_GPT
    masked: bool = True

    def build(self, seed: int) -> nn.Module:
        return GPT(self.shape, seed=seed)

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(10_000 + step)
        ids = torch.randint(0, self.shape.vocab_size, (size, self.shape.seq_len + 1), generator=gen)
        targets = ids[:, 1:]
        return ids[:, :-1], ragged_mask(targets, gen) if self.masked else targets

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten(0, 1), ignore_index=IGNORE_INDEX)


@dataclass(frozen=True)
class ScriptWorkload:
    """A user file defining ``build_model(seed) -> nn.Module``, ``make_batch(step, size) ->
    (inputs, targets)`` and optionally ``loss_fn(output, target)`` (default: cross-entropy,
    ignoring targets of ``-100``) and ``make_optimizer(params) -> Optimizer`` (what the Trainer's
    ``optimizer=`` takes; :meth:`optimizer` returns it, None when the file has none)."""

    path: str

    def _module(self) -> Any:
        spec = importlib.util.spec_from_file_location("shardwise_verify_user", self.path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"--script {self.path} cannot be imported", hint="pass a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name in ("build_model", "make_batch"):
            if not callable(getattr(module, name, None)):
                raise ConfigError(f"--script {self.path} defines no {name}()",
                                  hint="define build_model(seed) and make_batch(step, size); loss_fn is optional")
        return module

    def build(self, seed: int) -> nn.Module:
        return self._module().build_model(seed)

    def optimizer(self) -> ScriptOptimizer | None:
        """The file's ``make_optimizer`` as a factory that a spawned process can receive, or None."""
        return ScriptOptimizer(self.path) if callable(getattr(self._module(), "make_optimizer", None)) else None

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._module().make_batch(step, size)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        fn = getattr(self._module(), "loss_fn", None)
        if fn is not None:
            return fn(output, target)
        return F.cross_entropy(
            output.flatten(0, -2) if output.dim() > 2 else output, target.flatten(), ignore_index=IGNORE_INDEX
        )


@dataclass(frozen=True)
class ScriptOptimizer:
    """``make_optimizer(params)`` of a ``--script`` file, as a picklable optimizer factory: each
    process that calls it imports the file itself."""

    path: str

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        return ScriptWorkload(self.path)._module().make_optimizer(params)

