"""What a batch is: ``(inputs, targets)``, moved to the device.

A dataset item is ``(input, target)`` (or a mapping with ``"inputs"`` and ``"targets"``); the default
collate stacks them into a batch of the same shape. ``inputs`` may itself be a tensor, a tuple or a
mapping of tensors; the model is called as ``model(inputs)``. A mapping batch's other keys are
keyword arguments of that call (``model(inputs, position_ids=...)``, :func:`batch_kwargs`).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from shardwise.errors import ConfigError, ShardwiseError


def move_batch(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor on ``device`` (the same nesting of tuples, lists and dicts)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: move_batch(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch(v, device, non_blocking) for v in batch)
    return batch


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(inputs, targets)`` of a collated batch."""
    if isinstance(batch, dict) and "inputs" in batch and "targets" in batch:
        return batch["inputs"], batch["targets"]
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ShardwiseError(
        f"a batch must be (inputs, targets) or a dict with 'inputs' and 'targets', got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else ""),
        hint="make the dataset return (input, target) pairs, or pass a collate_fn that builds them",
    )


def batch_kwargs(batch: Any) -> dict[str, Any]:
    """The keyword arguments of the model's forward a batch carries: a mapping batch's keys other
    than ``inputs`` and ``targets`` (``position_ids`` of packed documents, :mod:`shardwise.data.instruct`)."""
    if isinstance(batch, dict) and "inputs" in batch and "targets" in batch:
        return {k: v for k, v in batch.items() if k not in ("inputs", "targets")}
    return {}


def with_batch_kwargs(batch: Any, extra: dict[str, Any], *, context_parallel: bool) -> dict[str, Any]:
    """The model's keyword arguments for ``batch``: its own (:func:`batch_kwargs`) and ``extra`` (what
    sharding adds: context parallel's ``position_ids``). Packed documents' ``position_ids`` under
    context parallelism are refused: its split attention knows positions, not documents."""
    own = batch_kwargs(batch)
    if context_parallel and "position_ids" in own:
        raise ConfigError(
            "a batch of packed documents (with position_ids) under context parallelism, whose split attention "
            "cannot keep the documents apart",
            hint="use padded batches with cp, or a plan without cp",
        )
    return {**own, **extra}


def chunks(loader: Iterable[Any], k: int) -> Iterator[list[Any]]:
    """Group the loader's micro-batches ``k`` at a time (one optimizer step each); a last group of
    fewer than ``k`` is dropped (epochs are cut to whole global batches, so there is none)."""
    group: list[Any] = []
    for batch in loader:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
