"""ZeRO stages 1-3 and HSDP, built from torch's own pieces.

How each stage maps onto torch (honestly — torch has no single "ZeRO-2" switch):

- **ZeRO-1** (optimizer state sharded, Rajbhandari et al. 2020 §5.1): DDP keeps the gradient
  all-reduce over the whole ``dp`` mesh (2·(N-1)/N · |grads| bytes per rank per step, bucketed),
  and :class:`torch.distributed.optim.ZeroRedundancyOptimizer` gives each rank of the
  ``dp_shard`` group the optimizer state of about 1/N of the parameters; after its local step each
  rank broadcasts its updated parameters (|params| bytes in total per step). Parameters and
  gradients stay replicated; only the optimizer-state share shrinks. The optimizer must therefore
  be built by :func:`build_optimizer` (``ParallelModel.build_optimizer``).
- **ZeRO-2** (+ gradients sharded): ``fully_shard(..., reshard_after_forward=False)``. Gradients
  are reduce-scattered (each rank keeps 1/N), the optimizer state is 1/N. FSDP2 always shards the
  parameters *at rest* too, so between steps parameter memory is also 1/N (more than the paper's
  ZeRO-2 saves); from forward to the end of backward a block's full parameters stay resident,
  so the communication is the paper's ZeRO-2 volume: one all-gather + one reduce-scatter per
  block per step (no re-gather in backward).
- **ZeRO-3** (+ parameters sharded): ``fully_shard(..., reshard_after_forward=True)`` per block
  and at the root: all-gather a block's parameters before its forward, free them after, gather
  again in backward, reduce-scatter its gradients: 2 all-gathers + 1 reduce-scatter per block.
- **HSDP** (ZeRO-2/3 with ``dp > 1`` and ``shard > 1``): the same ``fully_shard`` on the 2-D mesh
  ``(dp_replicate, dp_shard)``: shard within a row, then all-reduce the reduced shards across rows.

With tensor parallel, ``fully_shard`` shards the TP DTensors once more over ``dp_shard`` (2-D
parameters, FSDP × TP). ``replicate`` (the FSDP2-based DDP) plays DDP's role when TP parameters
must be all-reduced over ``dp`` without sharding (DP × TP, which classic DDP cannot wrap).

Mixed precision: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the sharded
fp32 parameters are the master weights the optimizer updates; each all-gather casts to bf16 for
compute, and gradients are reduced in fp32. CPU offload keeps the sharded parameters, gradients
and optimizer state in host memory (``CPUOffloadPolicy``); the optimizer step then runs on the CPU.

16-bit parameter storage for compute (``Plan.params16``, torchtitan's default): the same policy,
and nothing else casts: the training loop runs no autocast, so every operator computes in the
16-bit dtype of the gathered parameters and the activations it saves (the residual stream, norm
inputs, a pipeline stage's output) are 16-bit. Per rank: the fp32 masters, their fp32 gradients
and the optimizer state, sharded as the ZeRO stage says; a unit's 16-bit parameters exist from its
all-gather to its reshard (ZeRO-3: its forward, and again its backward; ZeRO-2: forward to the end
of backward); its 16-bit gradients until their fp32 reduce-scatter. Without ZeRO-2/3 the
data-parallel wrapper is ``replicate`` with the same policy (DDP has none in torch's public API),
which all-reduces fp32 gradients like DDP; with a single token-parallel rank (one process, or tp
or pp alone) ``replicate`` over that one rank only casts: 16-bit copies of every parameter during
forward and backward, fp32 masters and gradients, no communication. ZeRO-1 cannot have it
(``ZeroRedundancyOptimizer`` needs DDP's plain parameters).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from shardwise.errors import ConfigError
from shardwise.models.blocks import block_modules
from shardwise.parallel.precision import autocast_dtype



@dataclass(frozen=True)
class FSDPOptions:
    """How ``fully_shard`` is applied, beyond what the plan says.

    ``reshard_after_forward``: None picks the stage's policy (ZeRO-3: True, ZeRO-2: False); the
    root module is never resharded after forward (its parameters are needed first in backward).
    The compute precision and CPU offload are the plan's (``Plan.precision``, ``Plan.cpu_offload``),
    so the wrapping and the training loop's autocast cannot disagree.
    """

    reshard_after_forward: bool | None = None
    reduce_dtype: torch.dtype = torch.float32


def _policies(options: FSDPOptions, mesh: DeviceMesh, *, precision: str, cpu_offload: bool) -> dict[str, Any]:
    mp = MixedPrecisionPolicy(param_dtype=autocast_dtype(precision), reduce_dtype=options.reduce_dtype)
    # Pinned host memory (fast async copies to the GPU) needs an accelerator; on a CPU mesh the
    # "offloaded" state already lives in host memory and the policy only changes where the step runs.
    pin = mesh.device_type != "cpu"
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=pin) if cpu_offload else OffloadPolicy()
    return {"mp_policy": mp, "offload_policy": offload}


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, stage: int, precision: str = "fp32", cpu_offload: bool = False,
               options: FSDPOptions = FSDPOptions()) -> nn.Module:
    """ZeRO-2 or ZeRO-3 with ``fully_shard``: each trunk block, then the root (module doc).

    ``mesh`` is 1-D (FSDP: ``dp_shard``) or 2-D (HSDP: ``(dp_replicate, dp_shard)``); ``precision``
    is the compute dtype (fp32 master weights and reductions stay), ``cpu_offload`` keeps sharded
    parameters, gradients and optimizer state in host memory.
    """
    if stage not in (2, 3):
        raise ConfigError(
            f"apply_fsdp handles ZeRO stages 2 and 3, not {stage}", hint="stage 1 uses build_optimizer with DDP"
        )
    reshard = options.reshard_after_forward if options.reshard_after_forward is not None else stage == 3
    kwargs = _policies(options, mesh, precision=precision, cpu_offload=cpu_offload)
    for block in block_modules(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **kwargs)
    # The root holds what is left (embeddings, final norm, head); it is used first in backward,
    # so keeping it gathered after forward costs little memory and saves one all-gather.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **kwargs)
    return model


def apply_expert_units(
    experts: Iterable[nn.Module],
    mesh: DeviceMesh,
    *,
    stage: int,
    precision: str = "fp32",
    cpu_offload: bool = False,
    options: FSDPOptions = FSDPOptions(),
) -> None:
    """Each MoE layer's experts as its own data-parallel unit over the expert-data-parallel
    ``mesh`` (:mod:`shardwise.parallel.ep`): ``fully_shard`` for ZeRO-2/3, else ``replicate``
    (gradients averaged over ``mesh``)."""
    kwargs = _policies(options, mesh, precision=precision, cpu_offload=cpu_offload)
    for module in experts:
        if stage >= 2:
            reshard = options.reshard_after_forward if options.reshard_after_forward is not None else stage == 3
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, **kwargs)
        else:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(module, mesh=mesh, **kwargs)


def apply_replicate(model: nn.Module, mesh: DeviceMesh, *, precision: str = "fp32", cpu_offload: bool = False,
                    options: FSDPOptions = FSDPOptions()) -> nn.Module:
    """Plain data parallel for models with DTensor (TP) parameters: torch's FSDP2-based
    ``replicate``: the gradients of each block are all-reduced over ``mesh`` in backward
    (2·(N-1)/N · |grads| per rank per step, like DDP), with no sharding."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    kwargs = _policies(options, mesh, precision=precision, cpu_offload=cpu_offload)
    for block in block_modules(model):
        replicate(block, mesh=mesh, **kwargs)
    replicate(model, mesh=mesh, **kwargs)
    return model


def build_optimizer(
    params: Iterable[nn.Parameter],
    factory: Callable[..., torch.optim.Optimizer],
    *,
    zero_group: Any | None,
    **defaults: Any,
) -> torch.optim.Optimizer:
    """``factory(params, **defaults)`` (an optimizer class or any callable taking the parameters),
    or for ZeRO-1 (``zero_group`` given) the same optimizer inside ``ZeroRedundancyOptimizer``:
    each rank of ``zero_group`` builds the optimizer over its ~1/N partition of the parameters
    (greedy by size), steps only those, and broadcasts the updated parameters to the group.

    ``ZeroRedundancyOptimizer`` builds each rank's optimizer from *parameter groups* (dicts), and
    keeps their hyperparameters (a scheduled learning rate) in step with its own groups, one to one.
    A factory may take parameters only and make groups of its own (AdamW without decay on biases and
    norms), so it is called once over all the parameters (an optimizer allocates its state at the
    first step: nothing is spent), and its groups, each with its own hyperparameters, are what is
    partitioned, for its class to build on each rank (with the defaults its constructor takes)."""
    if zero_group is None:
        return factory(params, **defaults)
    whole = factory(list(params), **defaults)
    accepted = inspect.signature(type(whole)).parameters  # the defaults its constructor takes (AdamW's lack one)
    build = partial(type(whole), **{k: v for k, v in whole.defaults.items() if k in accepted})
    return ZeroRedundancyOptimizer(whole.param_groups, optimizer_class=build, process_group=zero_group)
