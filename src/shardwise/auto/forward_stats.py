"""One measured forward of any model: :func:`measure_module`, the core of :mod:`shardwise.auto.measure`.

The parameters are counted per repeated block (the embedding part before the blocks, the head
after), the FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` and the saved-for-backward
bytes from ``torch.autograd.graph.saved_tensors_hooks``, attributed to the block that is running.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from shardwise.models.blocks import block_modules
from shardwise.plan.stats import ModelStats


def measure_module(
    build: Callable[[], Any],
    example: Callable[[Any], Any],
    *,
    seq: int = 1,
    name: str = "model",
    device: str = "meta",
    backward: bool = False,
) -> ModelStats:
    """Statistics of any model, measured on the ``meta`` device (nothing is allocated).

    ``build()`` returns the ``nn.Module`` (it is called under ``torch.device("meta")``);
    ``example(device)`` returns the input of one sample. The repeated blocks are those FSDP wraps
    (:func:`shardwise.models.blocks.find_blocks`: one rule for all); everything else
    counts as the embedding (before the blocks) or head (after) part, split by parameter order.
    ``device="cpu"``: a real model run for real (``build`` is then called as it is), with a
    ``backward`` of the output's sum to show that the training step runs too.
    """
    if device == "meta":
        with torch.device("meta"):
            model = build()
    else:
        model = build()
    blocks = block_modules(model) or [model]  # no repeated blocks: the whole model is one block
    block_params, embed, head = _parameter_split(model, blocks)
    counter, state, logits_bytes = _hooked_forward(model, blocks, lambda: example(device), backward=backward)
    total_flops = counter.get_total_flops()
    n = max(1, len(blocks))
    block_saved = sum(v for k, v in state["saved"].items() if k is not None) / n
    block_flops = _block_flops(model, blocks, counter) or total_flops / n
    heads = int(getattr(getattr(model, "config", None), "heads", 0) or 0)
    hidden = int(getattr(getattr(model, "config", None), "hidden", 0) or 0)
    divides = (heads, hidden) if heads and hidden else ()
    return ModelStats(
        name=name,
        blocks=len(blocks),
        params_per_block=max(block_params, default=0),
        params_embed=embed,
        params_head=head,
        flops_per_block=block_flops,
        flops_head=max(0.0, total_flops - block_flops * len(blocks)),
        attn_flops_per_block=0.0,
        act_bytes_per_block=block_saved,
        attn_act_bytes_per_block=0.0,
        boundary_bytes=float(state["boundary"]),
        logits_bytes=float(logits_bytes),
        seq=seq,
        hidden=hidden,
        heads=heads,
        vocab=int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0),
        tp_divides=divides,
    )


def _parameter_split(model: nn.Module, blocks: list[nn.Module]) -> tuple[list[int], int, int]:
    """The parameters of each block, and those outside the blocks before them (the embedding part)
    and after them (the head), by parameter order."""
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    names = [n for n, _ in model.named_parameters()]
    first_block = next((i for i, (_, p) in enumerate(model.named_parameters()) if id(p) in in_blocks), len(names))
    embed = sum(
        p.numel() for i, (_, p) in enumerate(model.named_parameters()) if id(p) not in in_blocks and i < first_block
    )
    head = sum(
        p.numel() for i, (_, p) in enumerate(model.named_parameters()) if id(p) not in in_blocks and i >= first_block
    )
    return block_params, embed, head


def _hooked_forward(
    model: nn.Module, blocks: list[nn.Module], inputs: Callable[[], Any], *, backward: bool
) -> tuple[FlopCounterMode, dict[str, Any], int]:
    """One forward of ``inputs()`` (and the backward of the logits' sum with ``backward``) under the
    FLOP counter, with the saved-for-backward bytes attributed to the running block. Returns the
    counter, the state (``saved`` bytes per block id, ``None`` outside the blocks; the ``boundary``
    bytes of the first block input, at 16-bit) and the logits' bytes at 16-bit."""
    state = {"active": None, "saved": {}, "boundary": 0}

    def pre(module: nn.Module, args: tuple) -> None:
        state["active"] = id(module)
        if isinstance(args[0], torch.Tensor) and not state["boundary"]:
            state["boundary"] = args[0].numel() * 2  # counted at 16-bit like the analytic path

    def post(module: nn.Module, args: tuple, out: Any) -> None:
        state["active"] = None

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = state["active"]
        scale = 2 / t.element_size() if t.is_floating_point() else 1  # normalize to 16-bit
        state["saved"][key] = state["saved"].get(key, 0.0) + t.numel() * t.element_size() * scale
        return t

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))]
    counter = FlopCounterMode(display=False)
    logits_bytes = 0
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
            out = model(inputs())
            logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
            if isinstance(logits, torch.Tensor):
                logits_bytes = logits.numel() * 2
        if backward and isinstance(logits, torch.Tensor) and logits.requires_grad:
            logits.float().sum().backward()
    finally:
        for h in handles:
            h.remove()
    return counter, state, logits_bytes


def _block_flops(model: nn.Module, blocks: list[nn.Module], counter: FlopCounterMode) -> float:
    """The FLOPs of the costliest block (0.0 when the counter names none of them)."""
    if blocks[0] is model:
        return float(counter.get_total_flops())
    block_flops = 0.0
    for key, counts in counter.get_flop_counts().items():
        if key.count(".") == _block_depth(model, blocks):
            block_flops = max(block_flops, float(sum(counts.values())))
    return block_flops


def _block_depth(model: Any, blocks: list[Any]) -> int:
    """Dots in a block's qualified name as FlopCounterMode reports it (``Global`` prefix aside)."""
    for name, module in model.named_modules():
        if blocks and module is blocks[0]:
            return name.count(".") + 1  # FlopCounterMode names are "<ModelClass>.<path>"
    return -1
