"""What a returning replica group receives from a live peer (torchft's heal), and how it loads it.

A heal sends the Trainer's whole checkpointed state (:func:`shardwise.train.state.checkpointed_parts`:
model, optimizer, train state with the step, the data position and this rank's RNG, scheduler,
loss scaler) from group rank ``g`` of a live replica group to group rank ``g`` of the returning one,
over torchft's checkpoint transport (HTTP, ``torch.save`` streaming). Both groups run the same plan,
so rank ``g`` of each holds the same shards: DTensors (ZeRO-3, TP) travel as their local shards and
are rebuilt on the receiver with its own parameters' meshes and placements (the receiver's own
state is the template). An optimizer that has not stepped yet is sent as nothing: reading its
state through ``get_optimizer_state_dict`` would create it (a zero-gradient step at learning rate
0), and Adam's step count would then differ from a run that was never healed.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch.distributed.tensor import DTensor


def to_local(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard (a detached copy: the sender keeps
    training while the receiver reads it)."""
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: to_local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_local(v) for v in value)
    return value


def like(template: Any, received: Any) -> Any:
    """``received`` with a DTensor wherever ``template`` (this rank's own state) has one at the same
    place, built from the received local shard with the template's mesh and placements."""
    if isinstance(template, DTensor) and isinstance(received, torch.Tensor) and not isinstance(received, DTensor):
        return DTensor.from_local(received.to(template.device), template.device_mesh, template.placements,
                                  shape=template.shape, stride=template.stride(), run_check=False)
    if isinstance(template, Mapping) and isinstance(received, Mapping):
        return {k: like(template.get(k), v) for k, v in received.items()}
    if isinstance(template, (list, tuple)) and isinstance(received, (list, tuple)) and len(template) == len(received):
        return type(received)(like(t, r) for t, r in zip(template, received))
    return received


def heal_fns(parts: Callable[[], dict[str, Any]], *,
             optimizer: torch.optim.Optimizer) -> tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """``(state_dict, load_state_dict)`` for torchft's Manager: the Trainer's checkpointed ``parts()``
    as local tensors, and their load on a returning group (module doc)."""

    def state_dict() -> dict[str, Any]:
        return {name: to_local(part.state_dict()) if name != "optimizer" or optimizer.state else None
                for name, part in parts().items()}

    def load_state_dict(received: dict[str, Any]) -> None:
        for name, part in parts().items():  # the optimizer after the model: its template needs the parameters in place
            if received.get(name) is None:
                continue  # an optimizer that has not stepped on the sender has not stepped here either (same step)
            part.load_state_dict(like(part.state_dict(), received[name]))

    return state_dict, load_state_dict
