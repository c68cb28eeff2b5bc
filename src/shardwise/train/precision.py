"""Mixed precision: autocast contexts and a dynamic loss scaler whose decisions agree across ranks.

Weights, gradients and optimizer state stay fp32 ("master weights"); only the forward (and so the
backward) math runs in 16 bits under ``torch.autocast``. With ``Plan.params16`` the parameters
themselves are cast to 16 bits for compute by FSDP2's mixed-precision policy and the loop runs
no autocast (:func:`autocast_precision`).

``fp8`` converts the Linear layers to FP8 GEMMs (:mod:`shardwise.parallel.fp8`); everything else
runs under bf16 autocast, as in torchtitan (where FSDP's ``param_dtype`` is bf16 and the FP8 layers
sit inside it), unless the FP8 options ask for fp32 (``Fp8Options(high_precision="fp32")``; the
loop then passes ``compute_precision``'s answer, "fp32", here).

fp16 has a narrow range, so small gradients underflow. Dynamic loss scaling (Micikevicius et al.
2018) multiplies the loss by ``S`` before backward, divides the gradients by ``S`` before the
optimizer step, and adapts ``S``: when any gradient is inf/nan the step is skipped and
``S <- S * backoff_factor``; after ``growth_interval`` consecutive clean steps ``S <- S *
growth_factor``.

Cross-rank agreement: with DDP the gradients are already averaged, but with sharded gradients
(FSDP, TP) or an inf produced after the reduction each rank sees only its own part. The found-inf
flag is therefore all-reduced with MAX over the *whole world* (one 1-element all-reduce per step),
so every rank skips the same steps and keeps the same scale; otherwise replicas would diverge.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
import torch.distributed as dist

from shardwise.parallel.local import local_tensor
from shardwise.parallel.precision import DTYPES, autocast, autocast_dtype

__all__ = ["DTYPES", "LossScaler", "autocast", "autocast_dtype", "autocast_precision", "check_precision"]


def check_precision(precision: str, device_type: str) -> None:
    """Refuse nothing that works, but never let a slow or unsupported choice pass silently."""
    autocast_dtype(precision)
    if precision == "fp16" and device_type == "cpu":
        warnings.warn(
            "precision='fp16' on a CPU: CPUs have no fast fp16 matrix units, so this is emulated and "
            "usually slower than fp32; use precision='bf16' (or 'fp32') on CPUs",
            stacklevel=3,
        )


def autocast_precision(precision: str, *, params16: bool) -> str:
    """The precision the loop's autocast runs at: the plan's, except with ``params16`` (16-bit
    parameter storage, :mod:`shardwise.parallel.fsdp`), whose forward runs in the 16-bit dtype of
    the parameters FSDP2 casts, with no autocast ("fp32": a no-op context)."""
    return "fp32" if params16 else precision


class LossScaler:
    """Dynamic loss scaling with a world-wide inf/nan decision (see the module doc). Stateful.

    Per step::

        (loss * scaler.scale).backward()
        if scaler.unscale_(params):       # divides grads by scale; True when all are finite everywhere
            optimizer.step()
        scaler.update()                   # back off after a skip, grow after growth_interval clean steps
    """

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.group = group  # None: the whole world
        self.clean_steps = 0
        self.skipped_steps = 0
        self.found_inf = False

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale; return True when the step may be taken (all finite).

        Communication: one all-reduce (MAX) of a single float over ``group`` (the world).
        """
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros(1, device=device)
        if grads:
            inv = torch.full((1,), 1.0 / self.scale, device=device)
            # One fused kernel per device/dtype: multiply by 1/scale and flag non-finite values.
            by_type: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for g in grads:
                by_type.setdefault((g.device, g.dtype), []).append(g)
            for group in by_type.values():
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        self.found_inf = bool(found.item() > 0)
        return not self.found_inf

    def update(self) -> None:
        """Adapt the scale after the step (identical on every rank because ``found_inf`` is)."""
        if self.found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
