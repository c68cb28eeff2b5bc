"""Checks of the Trainer's arguments, and the small wrappers that make bad input name itself.

Everything here runs before any process-group work, so a wrong argument is one
:class:`~shardwise.errors.ConfigError` line on every rank instead of a hang or a torch traceback.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from shardwise.errors import ConfigError
from shardwise.train.lr import scale_lr


def check_counts(**values: Any) -> None:
    """Counts that must be positive integers (None: not set) and a clipping norm that must be positive."""
    required = ("global_batch_size", "grad_accum_steps", "log_every")
    for name, value in values.items():
        if name == "clip_grad_norm":
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ConfigError(
                    f"clip_grad_norm={value!r} must be a positive number",
                    hint="for example clip_grad_norm=1.0, or None for no clipping",
                )
            continue
        if value is None and name not in required:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            hint = f"for example {name}=1" + ("" if name in required else f", or {name}=None")
            raise ConfigError(f"{name}={value!r} must be a positive integer", hint=hint)


def check_batch_split(global_batch_size: int, dp_size: int, grad_accum_steps: int) -> None:
    """Every micro-batch has the same size: ``global = dp_size * grad_accum_steps * micro``."""
    parts = dp_size * grad_accum_steps
    if global_batch_size % parts:
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not split into {dp_size} data-parallel ranks x "
            f"{grad_accum_steps} accumulation steps",
            hint=f"use a multiple of {parts}, e.g. {parts * max(1, global_batch_size // parts)}",
        )


def scalar_loss(loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` checked to return a scalar tensor: torch's "grad can be implicitly created only
    for scalar outputs" never names the user's function, this does."""

    @functools.wraps(loss_fn)
    def checked(outputs: Any, targets: Any) -> torch.Tensor:
        loss = loss_fn(outputs, targets)
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(
                f"loss_fn returned a {type(loss).__name__}, not a tensor",
                hint="return a scalar torch.Tensor (the micro-batch mean)",
            )
        if loss.dim() != 0:
            raise ConfigError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar",
                              hint="return the mean over the micro-batch, e.g. F.cross_entropy(...) or loss.mean()")
        return loss

    return checked


def wants_total_steps(factory: Callable[..., Any]) -> bool:
    """True for a scheduler factory ``(optimizer, total_steps)``: built when ``fit`` knows the steps."""
    try:
        params = [p for p in inspect.signature(factory).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


def scale_learning_rates(optimizer: torch.optim.Optimizer, dp_size: int, *, rule: str) -> None:
    """Scale every parameter group's learning rate from one replica to ``dp_size`` (``rule``:
    ``none``, ``linear`` or ``sqrt``; see :func:`shardwise.train.lr.scale_lr`)."""
    if rule not in ("none", "linear", "sqrt"):
        raise ConfigError(f"scale_lr={rule!r} is unknown", hint="use 'none', 'linear' or 'sqrt'")
    if rule == "none":
        return
    for group in optimizer.param_groups:
        group["lr"] = scale_lr(group["lr"], dp_size, rule=rule)
