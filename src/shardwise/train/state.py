"""The trainer's ``Stateful`` pieces: everything a checkpoint must hold to resume exactly.

Each object has ``state_dict()`` / ``load_state_dict()`` (torch.distributed.checkpoint's
``Stateful`` protocol), so a checkpoint manager can save them together:

- :class:`ModelState` / :class:`OptimizerState` go through
  ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` & co.), which strips the
  DDP ``module.`` prefix and keeps FSDP/TP parameters as DTensors (sharded save, reshardable load);
- :class:`TrainState`: step and epoch counters, the sampler position (epoch and global samples
  consumed in it), and the RNG states of Python, NumPy and torch (CPU and CUDA);
- :func:`checkpointed_parts`: the Trainer's whole set (with the LoRA base reference, the scheduler
  and the loss scaler where the run has them).

RNG states differ per rank (dropout must differ across data-parallel ranks), so they are stored
under a per-rank key ``rng.rank<r>``; a checkpoint writer that deduplicates replicated values
would otherwise keep only rank 0's. Resuming with another world size finds no entry for new ranks,
which then keep their freshly seeded generators (the data order stays exact regardless).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardwise.checkpoint.adapters import BaseReference
from shardwise.data.sampler import ShardedSampler


class ModelState:
    """The (wrapped) model's parameters and buffers, with wrapper prefixes removed."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state, options=StateDictOptions(strict=True))


class OptimizerState:
    """The optimizer's state keyed by parameter names (not positions), so it survives resharding."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.module, self.optimizer, state)


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class TrainState:
    """Counters and the data position (see the module doc)."""

    rank: int = 0
    step: int = 0  # optimizer steps taken (including steps skipped by the loss scaler)
    epoch: int = 0
    samples_seen: int = 0  # global samples trained on, over all epochs
    sampler: ShardedSampler | None = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.step, "epoch": self.epoch, "samples_seen": self.samples_seen}
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        state[f"rng.rank{self.rank}"] = capture_rng()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.samples_seen = int(state.get("samples_seen", 0))
        if self.sampler is not None and "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])
        rng = state.get(f"rng.rank{self.rank}")
        if rng is not None:
            restore_rng(rng)


def checkpointed_parts(model: Any, optimizer: torch.optim.Optimizer, state: TrainState, *, lora: tuple[Any, Any] | None,
                       scheduler: Any = None, scaler: Any = None) -> dict[str, Any]:
    """What a Trainer checkpoint saves, by name: the parallel ``model``'s module and ``optimizer``
    (sharded as trained), the train state, and where present the LoRA base reference (adapters
    only: the frozen base is referenced by path and hash, see checkpoint/adapters.py), the
    learning-rate scheduler and the fp16 loss scaler."""
    parts: dict[str, Any] = {
        "model": ModelState(model.module),
        "optimizer": OptimizerState(model.module, optimizer),
        "train_state": state,
    }
    if lora is not None:
        parts["lora_base"] = BaseReference(model.module, path=lora[0], lora=lora[1] or model.lora_config or {})
    if scheduler is not None:
        parts["lr_scheduler"] = scheduler
    if scaler is not None:
        parts["grad_scaler"] = scaler
    return parts
