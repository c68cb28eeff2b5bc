"""``plan="auto"`` from the training data: the sample's shape, the check before measuring, certification.

The Trainer chooses an automatic plan when ``fit`` (or ``Trainer.setup``) sees the training data,
because two of its inputs come from there:

- **the per-sample shape**: the first sample of the dataset (of a streaming dataset, the first
  of a fresh pass; the Trainer's own pass starts over), collated as a batch of one with the
  Trainer's ``collate_fn`` (:func:`first_inputs`); its sequence length is dimension 1 of integer
  inputs (token ids), 1 for anything else, unless ``tokens_per_sample`` says otherwise
  (:func:`shardwise.models.measure.sample_stats`);
- **certification**: a few steps of the candidate plans on the first global batches of that data
  (:func:`certify_plans`, the engine is :mod:`shardwise.verify.certify`).

Everything that can be checked without measuring the machine is checked first: the arguments, the
data (readable, at least one global batch), the model (its statistics, a forward on ``meta``) and
whether any plan fits this device's memory at all (:func:`device_spec`: the memory the calibration
would report, with preset speeds; fitting does not depend on speed). Only then is the machine
measured (the first time, about a minute) and the plan ranked with its real figures.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import IterableDataset, default_collate

from shardwise.checkpoint.hf_load import Pretrained
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.layout import Plan
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.planner import cluster_for_device
from shardwise.runtime.detect import RuntimeEnv
from shardwise.parallel.reduction import IGNORE_INDEX
from shardwise.train.batch import split_batch
from shardwise.verify.certify import Certificate, CertifyOptions, DataWorkload, certify, shrink, shrink_config


@dataclass(frozen=True)
class AutoData:
    """What ``plan="auto"`` takes from ``fit``: the training data, its collate function, the
    certification options and the length of the run (``certify=None`` certifies long runs)."""

    dataset: Any
    collate_fn: Callable[[list[Any]], Any] | None = None
    certify: CertifyOptions = CertifyOptions()
    total_steps: int | None = None
    grad_accum_steps: int = 1

    @property
    def certifying(self) -> bool:
        return self.certify.wanted(self.total_steps)

    def _items(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices`` (modulo the data's length): by index, or for a streaming
        dataset from the start of a fresh pass of it (the Trainer's own pass starts over)."""
        if isinstance(self.dataset, IterableDataset):
            pool = list(itertools.islice(iter(self.dataset), max(indices) + 1))
            n = len(pool)
        else:
            pool, n = self.dataset, len(self.dataset)
        if n == 0:
            raise ConfigError("the training data is empty", hint="pass a dataset with at least one global batch of samples")
        return [pool[i % n] for i in indices]

    def collate(self, indices: Sequence[int]) -> tuple[Any, Any]:
        """``(inputs, targets)`` of the samples at ``indices`` (modulo the data's length), collated
        like the Trainer's loader."""
        try:
            items = self._items(indices)
        except ShardwiseError:
            raise
        except Exception as exc:  # the user's dataset: one line naming it
            raise ConfigError(f"the training data's sample {indices[0]} cannot be read ({type(exc).__name__}: {str(exc)[:160]})",
                              hint="check the dataset's __getitem__") from None
        try:
            return split_batch((self.collate_fn or default_collate)(items))
        except ShardwiseError:
            raise
        except Exception as exc:
            raise ConfigError(f"the training data's samples cannot be collated ({type(exc).__name__}: {str(exc)[:160]})",
                              hint="pass a collate_fn that stacks them into (inputs, targets)") from None


def first_inputs(data: AutoData) -> Any:
    """The inputs of the first sample, as a batch of one (what the model's forward takes)."""
    return data.collate([0])[0]  # an empty dataset fails there, as one line


def device_spec(env: RuntimeEnv) -> ClusterSpec:
    """This device's preset with the memory the calibration would measure (a GPU's total memory,
    else the host's memory shared by its local processes): enough to tell whether any plan fits,
    before the machine's speed is measured."""
    if env.device.type == "cuda":
        props = torch.cuda.get_device_properties(env.device)
        return cluster_for_device("cuda", world_size=env.world_size, device_name=props.name, memory_bytes=float(props.total_memory))
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(1, env.local_world_size)
    return replace(cluster_for_device(env.device.type, world_size=env.world_size), memory_bytes=memory)


def certify_plans(model: Any, plans: Sequence[Plan], *, data: AutoData, env: RuntimeEnv,
                  loss_fn: Callable[[Any, Any], torch.Tensor], loss_parallel: bool = False, loss_reduction: str = "samples",
                  ignore_index: int = IGNORE_INDEX, optimizer: Callable[[Any], torch.optim.Optimizer] | None = None) -> Certificate:
    """Certify ``plans`` in order on a shrunken copy of ``model`` and the first global batches of the
    data (:func:`shardwise.verify.certify.certify`) with the user's ``optimizer`` factory (None: SGD
    with momentum). ``model`` is the user's module, or a Hugging Face ``Pretrained`` directory
    (rebuilt from its config with fewer layers). Collective: every rank."""
    plans = list(plans)[: data.certify.max_plans]
    accumulation = min(data.grad_accum_steps, 2)
    # one global batch that every candidate splits evenly: dp ranks x micro-steps x pipeline microbatches
    global_batch = 2
    for p in plans:
        global_batch = math.lcm(global_batch, p.dp_size * accumulation * (p.microbatches if p.pp_enabled else 1))
    batches = [data.collate(range(step * global_batch, (step + 1) * global_batch)) for step in range(data.certify.steps)]
    copies: dict[int, DataWorkload] = {}

    def workload_for(plan: Plan) -> DataWorkload:
        """The shrunken copy for ``plan``: 2 blocks, or one per pipeline stage (made once per size)."""
        blocks = max(2, plan.pp * max(1, plan.virtual_stages))
        if blocks not in copies:
            if isinstance(model, Pretrained):
                template, what = shrink_config(model.config(), blocks=blocks)
            else:
                template, what = shrink(model, blocks=blocks)
            params = sum(p.numel() for p in template.parameters())
            copies[blocks] = DataWorkload(template, batches, loss_fn, description=f"{what}, {params:,} parameters")
        return copies[blocks]

    compared = {"samples": f"the first {data.certify.steps * global_batch} of the training data (in order)"}
    return certify(workload_for, plans, options=data.certify, accumulation=accumulation, global_batch=global_batch,
                   device=str(env.device), loss_parallel=loss_parallel, compared=compared, loss_reduction=loss_reduction,
                   ignore_index=ignore_index, optimizer=optimizer)
