"""The cost model's answer for one plan and step (:func:`shardwise.plan.cost.estimate`): the busiest
rank's memory and the step's time by term, the throughput they imply, and the shape ``shardwise
plan --json`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardwise.layout import Plan
from shardwise.plan.policy import RunPolicy


@dataclass(frozen=True)
class Estimate:
    """Predicted memory (bytes, the busiest rank) and time (seconds) of one plan and step."""

    plan: Plan
    global_batch: int
    micro_batch_size: int
    memory: dict[str, float]  # params, grads, optimizer, activations, buffers
    time: dict[str, float]  # compute, communication, bubble
    detail: dict[str, float] = field(default_factory=dict)  # tp, pp, dp communication, optimizer step, compute parts
    step_time_s: float = 0.0
    memory_limit: float = 0.0
    tokens_per_s: float = 0.0
    tflops_per_device: float = 0.0
    mfu: float = 0.0
    run: RunPolicy = field(default_factory=RunPolicy)

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def model_state_bytes(self) -> float:
        return self.memory["params"] + self.memory["grads"] + self.memory["optimizer"]

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.memory_limit

    def to_json(self) -> dict[str, Any]:
        """The shape ``shardwise plan --json`` prints for one plan."""
        p = self.plan
        return {
            "dp": p.dp_size,
            "dp_replicate": p.dp,
            "dp_shard": p.shard,
            "tp": p.tp,
            "pp": p.pp,
            "cp": p.cp,
            "ep": p.ep,
            "zero_stage": p.zero,
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": p.microbatches,
            "schedule": p.schedule if p.pp > 1 else "none",
            "virtual_stages": p.virtual_stages,
            "sequence_parallel": p.sequence_parallel,
            "recompute": p.recompute,
            "precision": p.precision,
            "plan": str(p),
            "params16": p.params16,
            "chunked_loss": p.chunked_loss,
            "sharded_accumulation": p.sharded_accumulation,
            **({"fp8_recipe": p.fp8_recipe} if p.precision == "fp8" else {}),
            "precision_policy": self.run.precision,
            "selective_mode": self.run.selective,
            "memory_per_device_bytes": int(self.memory_total),
            "memory_breakdown": {k: int(v) for k, v in self.memory.items()},
            "step_time_s": self.step_time_s,
            "time_breakdown": dict(self.time),
            "time_detail": dict(self.detail),
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "fits": self.fits,
        }


__all__ = ["Estimate"]
