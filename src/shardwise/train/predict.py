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
moved to the CPU; a vocabulary-sharded (loss-parallel) DTensor is gathered first. Under context
parallelism each rank of a cp group computes the outputs of its zig-zag sequence chunks
(``[B, S / cp, ...]``); one all-gather over the cp group (in rank order, the order of
:meth:`~shardwise.parallel.cp.ContextParallel.key_positions`) and a scatter by those positions
give every rank the whole sequence ``[B, S, ...]``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from shardwise.errors import ConfigError
from shardwise.parallel.cp import ContextParallel
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
    """A plain tensor of one forward's output (logits of a ``ModelOutput``; a DTensor gathered, so
    every rank of its mesh calls this), on the output's device."""
    if not isinstance(output, torch.Tensor):
        logits = getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor):
            raise ConfigError(
                "predict needs the model to return a tensor (or a ModelOutput with .logits), got "
                f"{type(output).__name__}"
            )
        output = logits
    if isinstance(output, DTensor):
        output = output.full_tensor()
    return output.detach()


def whole_sequence(cp: ContextParallel, local: torch.Tensor) -> torch.Tensor:
    """The outputs ``[B, S, ...]`` of the whole sequences from this rank's chunks ``[B, S / cp, ...]``
    (module doc): all-gather over the cp group, then each gathered position put where it belongs."""
    parts = [torch.empty_like(local) for _ in range(cp.size)]
    dist.all_gather(parts, local.contiguous(), group=cp.group)
    gathered = torch.cat(parts, dim=1)
    whole = torch.empty_like(gathered)
    whole[:, cp.key_positions(gathered.shape[1]).to(gathered.device)] = gathered
    return whole


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
    module = forward_module(pm)
    holder = _is_holder(pm)
    batches: list[torch.Tensor] = []

    def forward(part: tuple[Any, Any, dict[str, Any]]) -> Any:
        inputs, _, extra = part
        return pm.pipeline.predict_outputs(inputs, **extra) if pm.pipeline is not None else module(inputs, **extra)

    def collect(output: Any) -> None:
        if output is None:  # a pipeline stage before the last
            return
        tensor = output_tensor(output)  # on every rank: a loss-parallel DTensor is gathered over tp
        if pm.context_parallel is not None:  # every rank of the cp group takes part
            tensor = whole_sequence(pm.context_parallel, tensor)
        if holder:
            batches.append(tensor.cpu())

    run_batches(
        pm,
        loader,
        shard=lambda batch: pm.shard_batch(batch_inputs(batch), None),
        forward=forward,
        collect=collect,
        precision=precision,
        device=device,
        non_blocking=non_blocking,
    )
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
