"""Which of a checkpoint's components goes where (:class:`~shardwise.checkpoint.manager.CheckpointManager`):
the model and optimizers through DCP (ZeRO-1's by its rank-local optimizer), every other Stateful to the
per-rank file; and the saved optimizer hyper-parameters merged with this rank's current parameter groups on load."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from shardwise.errors import ConfigError


def split_components(
    components: Mapping[str, Any],
) -> tuple[nn.Module | None, list[torch.optim.Optimizer], dict[str, Any]]:
    """Model and optimizers go through DCP; every other Stateful goes to the per-rank file.

    Accepted forms: an ``nn.Module``, a ``ParallelModel`` or any wrapper with a ``.module`` (the
    Trainer's ``ModelState``); a ``torch.optim.Optimizer`` or a wrapper with an ``.optimizer``
    (the Trainer's ``OptimizerState``). They are unwrapped so ``get_state_dict`` sees the real ones.
    """
    model, optims, others = None, [], {}
    for name, obj in components.items():
        module = obj if isinstance(obj, nn.Module) else getattr(obj, "module", None)
        optim = optimizer_of(obj)
        if optim is not None:
            optims.append(local_optimizer(optim))
        elif isinstance(module, nn.Module):
            if model is not None and module is not model:
                raise ConfigError(
                    f"two models among the checkpointed components ({name!r} and another)",
                    hint="checkpoint one (possibly wrapped) model per manager",
                )
            model = module
        else:
            others[name] = obj
    return model, optims, others


def optimizer_of(obj: Any) -> torch.optim.Optimizer | None:
    """``obj`` as an optimizer: itself, or the ``.optimizer`` of a wrapper that also holds the module
    (the Trainer's ``OptimizerState``; an LR scheduler also has an ``.optimizer``, and is not one)."""
    if isinstance(obj, torch.optim.Optimizer):
        return obj
    optim = getattr(obj, "optimizer", None) if getattr(obj, "module", None) is not None else None
    return optim if isinstance(optim, torch.optim.Optimizer) else None


def local_optimizer(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """What DCP saves and loads of ``optim``: under ZeRO-1 (``ZeroRedundancyOptimizer``) this rank's
    own optimizer over its partition of the parameters, by name, as a pipeline stage's optimizer is
    (each rank writes the state of its own parameters; a load reads those of the parameters it now
    holds, under any plan); any other optimizer itself."""
    return optim.optim if isinstance(optim, ZeroRedundancyOptimizer) else optim


def sync_loaded(components: Mapping[str, Any]) -> None:
    """After a load: a ZeRO-1 optimizer's own param groups take the hyper-parameters (a scheduled lr)
    that its rank-local optimizer loaded; it hands its own to the local one at every step."""
    for obj in components.values():
        optim = optimizer_of(obj)
        if isinstance(optim, ZeroRedundancyOptimizer):
            for outer, local in zip(optim.param_groups, optim.optim.param_groups):
                outer.update({k: v for k, v in local.items() if k != "params"})


def merge_param_groups(
    current: list[dict[str, Any]], saved: list[dict[str, Any]] | None, path: str
) -> list[dict[str, Any]]:
    """Saved hyper-parameters (lr, momentum, ...) with this rank's current parameter names."""
    if saved is None or len(saved) != len(current):
        raise ConfigError(
            f"checkpoint {path} has {0 if saved is None else len(saved)} optimizer param groups, "
            f"the optimizer has {len(current)}",
            hint="build the optimizer the same way as the saved run",
        )
    return [{**s, "params": c["params"]} for c, s in zip(current, saved)]
