"""This rank's part of a tensor: a DTensor's local shard (``to_local()``, which keeps the autograd
link), any other tensor, or None, as it is. No communication."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t.to_local()`` for a DTensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t
