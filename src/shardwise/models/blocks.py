"""The repeated blocks of a model: one rule for every part of shardwise that needs them.

FSDP groups each block's parameters into one all-gather (:mod:`shardwise.parallel.fsdp`),
activation checkpointing and ``torch.compile`` take a block as their unit, the pipeline splits
between blocks (:mod:`shardwise.parallel.pipeline.split`), the planner prices a block
(:mod:`shardwise.auto.measure`) and certification drops blocks to shrink a copy
(:mod:`shardwise.auto.certify`). They all find the blocks here, so the planner prices what FSDP
wraps and the pipeline splits.

**The rule.** A *candidate* is an ``nn.ModuleList`` or ``nn.Sequential`` (the model itself
included) with at least ``min_repeats`` children, all of one class, the first of which holds
parameters. The trunk is the candidate with the most parameters; ties go to the shallowest, then
to the first in ``named_modules()`` order. Its children are the blocks. A GPT's ``blocks``, a
Hugging Face model's ``model.layers`` or ``transformer.h``, a CNN's ``stages``: the trunk holds
nearly all parameters, while a block's inner lists (MoE experts, an MLP's ``Sequential``) are
parts of one block and so always smaller than the list that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Blocks:
    """Where the blocks are: ``name`` the dotted path of their container (``""``: the model
    itself is the sequence of blocks), ``container`` the ``ModuleList``/``Sequential``."""

    name: str
    container: nn.Module

    @property
    def modules(self) -> list[nn.Module]:
        return list(self.container.children())


def find_blocks(model: nn.Module, *, min_repeats: int = 2) -> Blocks | None:
    """The trunk of ``model`` by the module doc's rule, or None when it has none (then the whole
    model is one unit). ``min_repeats=1``: a pipeline stage that kept a single block."""
    best: tuple[int, int] | None = None  # (parameters, -depth)
    found: Blocks | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < max(1, min_repeats) or len({type(c) for c in children}) != 1:
            continue
        if next(children[0].parameters(), None) is None:
            continue
        key = (sum(p.numel() for p in module.parameters()), -(name.count(".") + 1 if name else 0))
        if best is None or key > best:
            best, found = key, Blocks(name, module)
    return found


def block_modules(model: nn.Module, *, min_repeats: int = 2) -> list[nn.Module]:
    """The blocks of ``model`` (:func:`find_blocks`), or [] when it has none."""
    found = find_blocks(model, min_repeats=min_repeats)
    return found.modules if found is not None else []
