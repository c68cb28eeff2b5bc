"""The compute dtype of each precision, and the forward pass's autocast context: one table for the
training loop (autocast), FSDP2's mixed-precision policy (``param_dtype``) and the calibration.

``fp8`` maps to bf16: what runs everything FP8 does not convert (:mod:`shardwise.parallel.fp8`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from shardwise.errors import ConfigError

DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The 16-bit dtype ``precision`` computes in (None: fp32); a ConfigError for an unknown one."""
    if precision not in DTYPES:
        raise ConfigError(f"precision={precision!r} is unknown", hint="use fp32, bf16, fp16 or fp8")
    return DTYPES[precision]


def autocast(precision: str | None, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The forward-pass context for ``precision``: ``torch.autocast`` to its dtype; a no-op for fp32
    (and for None: no autocast at all)."""
    dtype = autocast_dtype(precision) if precision is not None else None
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
