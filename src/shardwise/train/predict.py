"""Sharded prediction: the model's outputs for every sample of a dataset, under any plan.

Each data-parallel rank runs the forward on its unpadded shard (:class:`~shardwise.data.sampler.EvalSampler`:
rank ``r`` of ``D`` reads samples ``r, r + D, r + 2D, ...``), batch by batch, in the loop that
evaluation uses (:mod:`shardwise.train.lockstep`: when the forward communicates, every rank runs
the same number of forwards and drops the extra ones' outputs).

Within one data-parallel group several ranks hold the same outputs (the TP ranks, after the
logits are gathered; under a pipeline only the ranks of the last stage hold any), so one *holder*
per group reports them: tensor-parallel rank 0 of the last pipeline stage. Then either

- **gathered**: one ``gather_object`` to rank 0, which puts the samples back in dataset order
  (sample ``i`` is the ``i // D``-th of shard ``i % D``) and returns one tensor (outputs
  concatenated along dim 0) or, for outputs of varying shape, a list; other ranks return None; or
- **written**: each holder writes its shard to ``output_dir/predictions-<dp rank>-of-<D>.pt``
  (``{"indices": LongTensor, "outputs": [tensor per batch]}``), and nothing crosses the network.

Outputs are the model's tensor output, or the ``logits`` of a Hugging Face ``ModelOutput``,
moved to the CPU; a vocabulary-sharded (loss-parallel) DTensor is gathered first.
Context parallelism splits each sequence over ranks and is refused here.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from shardwise.errors import ConfigError
from shardwise.parallel.parallelize import ParallelModel
from shardwise.train.lockstep import forward_module, run_batches


def batch_inputs(batch: Any) -> Any:
    """The model's inputs of a collated batch: ``(inputs, targets)``, ``(inputs,)``, a dict with
    ``"inputs"``, or the inputs themselves."""
    if isinstance(batch, dict):
        if "inputs" not in batch:
            raise ConfigError(f"a prediction batch dict needs an 'inputs' key, got {sorted(batch)}")
        return batch["inputs"]
    if isinstance(batch, (list, tuple)) and len(batch) in (1, 2):
        return batch[0]
    return batch


def output_tensor(output: Any) -> torch.Tensor:
    """A plain CPU tensor of one forward's output (logits of a ``ModelOutput``; DTensors gathered)."""
    if not isinstance(output, torch.Tensor):
        logits = getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor):
            raise ConfigError(f"predict needs the model to return a tensor (or a ModelOutput with .logits), got {type(output).__name__}")
        output = logits
    if isinstance(output, DTensor):
        output = output.full_tensor()
    return output.detach().cpu()


def _is_holder(pm: ParallelModel) -> bool:
    if not dist.is_initialized():
        return True
    if pm.pipeline is not None and not pm.pipeline.has_last:
        return False
    return pm.meshes.tp.get_local_rank() == 0


@torch.no_grad()
def predict(pm: ParallelModel, loader: DataLoader, *, dp_rank: int, dp_size: int, precision: str, device: torch.device,
            output_dir: str | None = None, non_blocking: bool = False) -> torch.Tensor | list[torch.Tensor] | None:
    """The outputs for every sample behind ``loader`` (this rank's shard), see the module doc."""
    if pm.plan.cp_enabled:
        raise ConfigError(f"predict does not run under context parallelism (plan {pm.plan})",
                          hint="predict under the same plan without cp (dp, zero, tp and pp all work)")
    module = forward_module(pm)
    holder = _is_holder(pm)
    batches: list[torch.Tensor] = []

    def forward(batch: Any) -> Any:
        inputs = batch_inputs(batch)
        return pm.pipeline.predict_outputs(inputs) if pm.pipeline is not None else module(inputs)

    def collect(output: Any) -> None:
        if holder:
            batches.append(output_tensor(output))

    run_batches(pm, loader, forward=forward, collect=collect, precision=precision, device=device, non_blocking=non_blocking)
    indices = list(range(dp_rank, len(loader.dataset), dp_size))  # type: ignore[arg-type]
    if output_dir is not None:
        if holder:
            os.makedirs(output_dir, exist_ok=True)
            path = os.path.join(output_dir, f"predictions-{dp_rank:05d}-of-{dp_size:05d}.pt")
            torch.save({"indices": torch.tensor(indices, dtype=torch.int64), "outputs": batches}, path)
        if dist.is_initialized():
            dist.barrier()  # every shard is on disk when predict returns on any rank
        return None
    samples = [row for batch in batches for row in batch]  # one tensor per sample, in shard order
    if not dist.is_initialized():
        return _assemble({0: samples}, dp_size=1, total=len(indices))
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None  # type: ignore[assignment]
    dist.gather_object((dp_rank, samples) if holder else None, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    shards: dict[int, list[torch.Tensor]] = {}
    for item in gathered:
        if item is not None:
            shards.setdefault(item[0], item[1])  # the holder of each data-parallel group
    return _assemble(shards, dp_size=dp_size, total=len(loader.dataset))  # type: ignore[arg-type]


def _assemble(shards: dict[int, list[torch.Tensor]], *, dp_size: int, total: int) -> torch.Tensor | list[torch.Tensor]:
    """Sample ``i`` is the ``i // dp_size``-th of shard ``i % dp_size``: back in dataset order."""
    ordered = [shards[i % dp_size][i // dp_size] for i in range(total)]
    if ordered and all(t.shape == ordered[0].shape for t in ordered):
        return torch.stack(ordered)
    return ordered
