"""Data parallel with PyTorch DDP over the ``dp`` mesh.

Every rank holds the full model; after the backward pass DDP all-reduces (averages) gradients over
the data-parallel group, bucket by bucket, overlapping communication with the rest of the backward.

Options (:class:`DDPOptions`):

- ``bucket_cap_mb``: gradient bucket size. Bigger buckets mean fewer, larger all-reduces (less
  latency overhead, what MindSpore calls all-reduce fusion); smaller buckets start communicating
  earlier in the backward (more overlap). 25 MB is DDP's default.
- ``gradient_as_bucket_view``: gradients are views into the communication buckets, saving one
  copy of the gradients in memory and a memcpy per step.
- ``static_graph``: the set of used parameters never changes between steps; DDP can then skip
  re-checking and supports reentrant activation checkpointing.
- ``comm_hook``: gradient compression by name: ``"fp16"`` / ``"bf16"`` (cast each bucket to 16 bits
  before the all-reduce, halving the bytes; the average is cast back to the gradient dtype; bf16
  needs NCCL) or
  ``"powersgd"`` (Vogels et al. 2019, rank-``powersgd_rank`` approximation with error feedback; the
  first ``powersgd_start_iter`` steps use the plain all-reduce).
- ``sync_batchnorm``: convert BatchNorm layers to SyncBatchNorm so batch statistics are computed
  over the whole data-parallel batch (one all-reduce of mean/var per BN layer per forward). PyTorch
  implements SyncBatchNorm for accelerators only: on CPU the layers stay per-rank BatchNorm, with a
  warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from shardwise.errors import ConfigError

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class DDPOptions:
    """How DDP buckets, communicates and treats the graph (see the module doc)."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    forward_sync_buffers: bool = True  # broadcast rank 0's buffers (BN stats) before each forward
    comm_hook: str = "none"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 10
    sync_batchnorm: bool = False

    def __post_init__(self) -> None:
        if self.comm_hook not in COMM_HOOKS:
            raise ConfigError(
                f"ddp comm_hook={self.comm_hook!r} is unknown", hint=f"use one of {', '.join(COMM_HOOKS)}"
            )
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"ddp bucket_cap_mb={self.bucket_cap_mb} must be positive", hint="for example 25")
        if self.powersgd_rank < 1:
            raise ConfigError(f"ddp powersgd_rank={self.powersgd_rank} must be at least 1", hint="for example 1 or 4")


def _comm_hook(options: DDPOptions, group: Any) -> tuple[Any, Callable[..., Any]] | None:
    """The (state, hook) pair for ``options.comm_hook``, or None for DDP's built-in all-reduce."""
    if options.comm_hook == "fp16":
        return group, default_hooks.fp16_compress_hook
    if options.comm_hook == "bf16":
        return group, default_hooks.bf16_compress_hook
    if options.comm_hook == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=options.powersgd_rank,
            start_powerSGD_iter=max(options.powersgd_start_iter, 2),  # PowerSGD needs >= 2 warm-up steps
        )
        return state, powersgd.powerSGD_hook
    return None


def convert_sync_batchnorm(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """BatchNorm -> SyncBatchNorm over ``dp_mesh`` on accelerators; unchanged (with a warning) on CPU."""
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return model
    if dp_mesh.device_type == "cpu":
        warnings.warn(
            "sync_batchnorm: PyTorch's SyncBatchNorm runs on GPUs only; on CPU each rank keeps "
            "its own BatchNorm statistics (as without the option)",
            stacklevel=3,
        )
        return model
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=dp_mesh.get_group())


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, *, options: DDPOptions) -> nn.Module:
    """Wrap ``model`` in DDP over the ``dp`` mesh: one gradient all-reduce per bucket per step."""
    group = dp_mesh.get_group()
    if options.comm_hook == "bf16" and dist.get_backend(group) != "nccl":
        # torch's bf16 hook checks for NCCL >= 2.10; Gloo has no bf16 all-reduce path for it.
        raise ConfigError(
            f"ddp comm_hook='bf16' needs the NCCL backend, this job uses {dist.get_backend(group)}",
            hint="use comm_hook='fp16' (or 'powersgd') on Gloo/CPU",
        )
    if options.sync_batchnorm:
        model = convert_sync_batchnorm(model, dp_mesh)
    device = next(model.parameters()).device
    # A frozen quantized base (torchao's NF4, QLoRA) is neither broadcast nor reduced: every rank
    # quantized the same weights, and they get no gradient.
    quantized = [n for n, p in model.named_parameters() if not p.requires_grad and type(p.data) is not torch.Tensor]
    if quantized:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, quantized)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=options.bucket_cap_mb,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        static_graph=options.static_graph,
        find_unused_parameters=options.find_unused_parameters,
        forward_sync_buffers=options.forward_sync_buffers,
    )
    hook = _comm_hook(options, group)
    if hook is not None:
        ddp.register_comm_hook(*hook)
    return ddp
