"""Learning-rate helpers: scaling with the data-parallel size, and warmup + cosine decay.

Scaling (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): when the global batch grows ``n``
times, SGD keeps the same per-sample update if the learning rate grows ``n`` times too (the
*linear* rule), which needs a warmup to be stable; for adaptive optimizers (Adam) the
*square-root* rule ``lr * sqrt(n)`` (Krizhevsky 2014; Hoffer et al. 2017) is the usual choice.

Schedule: linear warmup from ``warmup_start_factor * lr`` to ``lr`` over ``warmup_steps``, then
half a cosine from ``lr`` down to ``min_lr_ratio * lr`` at ``total_steps``::

    f(s) = start + (1 - start) * s / warmup                        for s < warmup
    f(s) = m + (1 - m) * 0.5 * (1 + cos(pi * (s - warmup) / (total - warmup)))   afterwards
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from shardwise.errors import ConfigError


def scale_lr(base_lr: float, dp_size: int, *, rule: str = "linear", base_dp_size: int = 1) -> float:
    """``base_lr`` tuned for ``base_dp_size`` replicas, scaled to ``dp_size`` by ``rule``."""
    if dp_size < 1 or base_dp_size < 1:
        raise ConfigError(
            f"scale_lr needs positive sizes, got dp_size={dp_size}, base_dp_size={base_dp_size}",
            hint="pass the data-parallel size",
        )
    ratio = dp_size / base_dp_size
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise ConfigError(f"scale_lr rule={rule!r} is unknown", hint="use 'linear', 'sqrt' or 'none'")


def warmup_cosine_factor(
    step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0, warmup_start_factor: float = 0.0
) -> float:
    """The multiplier of the base learning rate at ``step`` (see the module doc)."""
    if warmup_steps > 0 and step < warmup_steps:
        return warmup_start_factor + (1.0 - warmup_start_factor) * step / warmup_steps
    decay = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    *, warmup_steps: int, total_steps: int | None = None, min_lr_ratio: float = 0.0, warmup_start_factor: float = 0.0
) -> Callable[..., LRScheduler]:
    """A scheduler factory for ``TrainOptions(lr_scheduler=...)``: stepped once per optimizer step.

    Without ``total_steps`` the factory takes ``(optimizer, total_steps)`` and the Trainer calls it
    when ``fit`` knows the number of steps; the warmup is then at most that number."""
    if total_steps is None:
        if warmup_steps < 0:
            raise ConfigError(f"warmup_cosine(warmup_steps={warmup_steps}) is negative", hint="use warmup_steps >= 0")

        def deferred(optimizer: torch.optim.Optimizer, total: int) -> LRScheduler:
            return warmup_cosine(warmup_steps=min(warmup_steps, total), total_steps=total, min_lr_ratio=min_lr_ratio,
                                 warmup_start_factor=warmup_start_factor)(optimizer)

        return deferred
    if warmup_steps < 0 or total_steps < 1 or warmup_steps > total_steps:
        raise ConfigError(
            f"warmup_cosine(warmup_steps={warmup_steps}, total_steps={total_steps}) is not a schedule",
            hint="use 0 <= warmup_steps <= total_steps and total_steps >= 1",
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]", hint="for example 0.1")

    def factory(optimizer: torch.optim.Optimizer) -> LRScheduler:
        return LambdaLR(
            optimizer,
            lambda step: warmup_cosine_factor(
                step,
                warmup_steps=warmup_steps,
                total_steps=total_steps,
                min_lr_ratio=min_lr_ratio,
                warmup_start_factor=warmup_start_factor,
            ),
        )

    return factory
