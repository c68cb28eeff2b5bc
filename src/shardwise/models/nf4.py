"""QLoRA's frozen base in 4 bits (Dettmers et al. 2023): torchao's NF4 tensor, never our own.

:func:`quantize_base` replaces the weight of every frozen ``nn.Linear`` of the model except the
LM head by ``torchao``'s ``NF4Tensor``: 4-bit NormalFloat codes in blocks of ``block_size`` = 64
weights with one absmax scaler each, the scalers themselves quantized to 8 bits in groups of
``scaler_block_size`` (double quantization): about 4.13 bits per weight (0.52 bytes against bf16's
2 and fp32's 4). ``F.linear`` on an NF4 weight dequantizes it to the input's dtype and multiplies;
its backward gives the input gradient only (the weight is frozen): the base's weight-gradient
GEMM is skipped and no weight gradient is ever allocated.

Sharding: FSDP2 (ZeRO-2/3) splits an NF4 weight along its rows and all-gathers the codes and
scalers (torchao implements ``fsdp_pre_all_gather``/``fsdp_post_all_gather``), so each rank holds
1/N of the 4-bit base; the split must fall on whole scaler groups, which
:func:`quantizable` checks for up to 8 shards (a layer that cannot is left in its dtype). DDP and
ZeRO-1 leave NF4 weights out of their parameter broadcast (every rank quantized the same weights;
they get no gradient to reduce). Tensor parallel is refused with one line: torchao's NF4 splits
only along rows, and a row-wise layer needs its columns split.

``torchao`` is an optional extra (``shardwise[lora]``); this module imports it inside functions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError

BLOCK = 64
SCALER_BLOCK = 256
MAX_SHARDS = 8  # a quantized weight splits into up to 8 row shards on whole scaler groups


def require_torchao() -> Any:
    """``torchao.quantization`` (to_nf4, NF4Tensor), or a ConfigError naming the extra."""
    from shardwise.models.lora import quiet_torchao

    try:
        with quiet_torchao():
            from torchao import quantization
    except ImportError:
        raise ConfigError(
            "QLoRA's 4-bit base (lora.base=nf4) needs the 'torchao' package", hint="pip install 'shardwise[lora]'"
        ) from None
    return quantization


def scaler_block(numel: int) -> int | None:
    """The scaler group size for a weight of ``numel`` elements: 256, or the largest power of two
    below it that splits into ``MAX_SHARDS`` row shards of whole groups; None if none does."""
    if numel % (BLOCK * MAX_SHARDS):
        return None
    blocks_per_shard = numel // BLOCK // MAX_SHARDS
    size = SCALER_BLOCK
    while size > 1 and blocks_per_shard % size:
        size //= 2
    return size


def quantizable(module: nn.Module) -> bool:
    """A frozen ``nn.Linear`` whose weight splits into whole NF4 blocks (module doc)."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) and isinstance(weight, torch.Tensor) and not weight.requires_grad
            and type(weight.data) is torch.Tensor and weight.dim() == 2 and scaler_block(weight.numel()) is not None)


def _head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    try:
        return get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a DTensor's local part) is torchao's NF4 tensor."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return type(local).__name__ == "NF4Tensor" or type(getattr(local, "data", None)).__name__ == "NF4Tensor"


@torch.no_grad()
def quantize_base(model: nn.Module) -> list[str]:
    """Store every frozen Linear weight but the LM head's in NF4 (module doc); returns their names."""
    ao = require_torchao()
    head = _head(model)
    done = []
    for name, module in model.named_modules():
        if module is head or name.rsplit(".", 1)[-1] == "lm_head" or not quantizable(module):
            continue
        weight = module.weight
        nf4 = ao.to_nf4(weight.detach(), block_size=BLOCK, scaler_block_size=scaler_block(weight.numel()))
        module.weight = nn.Parameter(nf4, requires_grad=False)
        done.append(f"{name}.weight")
    if not done:
        raise ConfigError(
            f"lora.base=nf4 found no frozen Linear weight of {type(model).__name__} to quantize",
            hint="add adapters first (the base must be frozen), with layers whose size is a multiple of 512",
        )
    return done


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's bytes of parameters: ``nf4`` (codes and scalers of the 4-bit base), ``frozen``
    (other frozen weights) and ``trainable``, over local shards."""
    out = {"nf4": 0, "frozen": 0, "trainable": 0}
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if is_nf4(local):
            inner = local if type(local).__name__ == "NF4Tensor" else local.data
            out["nf4"] += sum(
                t.numel() * t.element_size()
                for t in (
                    inner.quantized_data,
                    inner.quantized_scalers,
                    inner.quantization_factor,
                    inner.scaler_mean,
                    inner.nf4,
                )
            )
        else:
            out["trainable" if p.requires_grad else "frozen"] += local.numel() * local.element_size()
    return out
