"""Activation checkpointing (recomputation) of the trunk blocks: ``none``, ``selective``, ``full``.

- ``full`` (Chen et al. 2016): a block keeps only its input; backward reruns its forward. Memory
  for activations drops from O(L · per-block activations) to O(L · block input + one block);
  compute grows by about one forward (~33% of a training step).
- ``selective`` (Korthikanti et al. 2022, torchtitan's op-level policy): inside each block the
  outputs of the expensive ops (matmuls, attention) are saved and only the cheap pointwise ops
  (norms, activations, dropout, softmax) are recomputed: most of the memory, little of the compute.

Built on torch's composable ``checkpoint`` (hooks; parameter names and ``state_dict`` keys stay
unchanged) with ``create_selective_checkpoint_contexts`` for the selective policy. Applied after
TP so recomputation replays the TP collectives, and before FSDP so FSDP's all-gathers happen in the
recomputed forward too. No communication of its own.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shardwise.errors import ConfigError
from shardwise.models.blocks import block_modules

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_checkpointing(model: nn.Module, *, mode: str,
                        recompute_context: Callable[[], ContextManager[Any]] | None = None) -> nn.Module:
    """Checkpoint every trunk block (:func:`~shardwise.models.blocks.find_blocks`) according to ``mode``; in place.

    ``recompute_context()``: entered around each block's recomputation in backward, for what the
    forward ran under (context parallel's split attention)."""
    if mode == "none":
        return model
    if mode not in ("selective", "full"):
        raise ConfigError(f"recompute={mode!r} is unknown", hint="use none, selective or full")
    blocks = block_modules(model, min_repeats=1)  # a pipeline stage may hold a single block
    if not blocks:
        raise ConfigError(
            f"recompute={mode} found no repeated blocks in {type(model).__name__}",
            hint="keep the blocks in an nn.ModuleList/nn.Sequential, or use recompute=none",
        )
    for block in blocks:
        checkpoint(block, context_fn=functools.partial(_contexts, mode, recompute_context))
    return model


def _contexts(
    mode: str, extra: Callable[[], ContextManager[Any]] | None
) -> tuple[ContextManager[Any], ContextManager[Any]]:
    """(forward, recomputation) contexts of one checkpointed region."""
    if mode == "selective":
        forward, recompute = create_selective_checkpoint_contexts(_policy)
    else:
        forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
    return forward, recompute if extra is None else _entered(recompute, extra())


@contextlib.contextmanager
def _entered(*contexts: ContextManager[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx)
        yield
