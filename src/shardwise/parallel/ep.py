"""Expert parallel: the experts of each MoE layer split over ``ep`` data-parallel ranks, tokens
dispatched to them and combined with all-to-all (GShard, Lepikhin et al. 2020; Switch, Fedus et al.
2021; torchtitan's and Megatron-Core's expert parallelism).

**Which ranks.** ``ep`` borrows ranks that already see different batches: it splits the innermost
data-parallel dimension in use (``shard`` under ZeRO, else ``dp``) into ``(rest, ep)``. Rank ``r``
of an ``ep`` group keeps experts ``[r E/ep, (r+1) E/ep)`` of every MoE layer (a ``DTensor``
sharded on dim 0 over the ``ep`` mesh, so checkpoints save and reshard them like any sharded
weight). The ranks that hold the same experts and see different tokens form the *expert data
parallel* mesh, over which the expert gradients are reduced (``edp = dp * shard * cp / ep``).

**One MoE layer, forward** (the model's own router has chosen ``top_k_index`` and weights)::

    sort this rank's (token, expert) assignments by expert -> by owning rank
    counts:  all_to_all of how many rows each rank sends each other rank (ep integers)
    tokens:  all_to_all of the hidden states of those rows          ([N, h] out, [M, h] in)
    compute: the module's own forward on the received rows with its local experts
    return:  all_to_all of the outputs back to where the rows came from
    combine: y[token] += weight * output   (the routing weights stay at the token's rank)

Backward runs the two all-to-alls the other way (autograd of ``all_to_all_single``). Volume per
layer and step: ``2 x (ep - 1)/ep x k x tokens x h`` elements forward, the same backward.

**Gradients.** An expert's owner receives the tokens of every rank of its ``ep`` group, so the
gradient it computes is the sum over those ranks' losses: it is scaled by ``1/ep`` on its way to
the weights, and the expert units are data-parallel over ``edp`` (averaging over ``edp``), which
together give the single-process mean. Everything else (attention, router, norms) is data
parallel as without ``ep``.

**Contract.** An MoE layer's experts are one module with an integer ``num_experts``, its expert
weights as 3-D parameters whose first dimension is ``num_experts``, and
``forward(hidden[T, h], top_k_index[T, k], top_k_weights[T, k]) -> [T, h]`` that skips indices
outside ``[0, num_experts)`` (shardwise's :class:`~shardwise.models.moe.Experts`, Hugging Face's
fused experts of Mixtral and Qwen-MoE).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shardwise.errors import ConfigError
from shardwise.layout import Plan


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of the MoE layers (see the contract in the module doc)."""
    found = []
    for name, module in model.named_modules():
        n = getattr(module, "num_experts", None)
        if isinstance(n, int) and n > 0 and _expert_params(module, n):
            found.append((name, module))
    return found


def _expert_params(module: nn.Module, n: int) -> dict[str, nn.Parameter]:
    return {
        k: p for k, p in module.named_parameters(recurse=False) if p.dim() == 3 and p.shape[0] == n
    }  # not a router's [E, H]


def check_expert_parallel(model: nn.Module, ep: int) -> None:
    """Refuse, before any process-group work, what expert parallelism cannot split."""
    if ep <= 1:
        return
    experts = expert_modules(model)
    if not experts:
        raise ConfigError(
            f"ep={ep} on {type(model).__name__}, which has no MoE layers",
            hint="use a mixture-of-experts model (e.g. the built-in GPT with --model.experts=4), or drop ep",
        )
    for name, module in experts:
        if module.num_experts % ep:
            raise ConfigError(f"ep={ep} does not divide the {module.num_experts} experts of {name}",
                              hint=f"use an ep that divides {module.num_experts}")


@dataclass(frozen=True)
class ExpertMeshes:
    """``ep``: the ranks that split one layer's experts; ``edp``: the ranks that hold the same
    experts and see different tokens (1-D, or 2-D ``(dp_replicate, shard)`` for HSDP)."""

    ep: DeviceMesh
    edp: DeviceMesh


def build_expert_meshes(plan: Plan, root: DeviceMesh) -> ExpertMeshes:
    """Split the innermost data-parallel dimension of ``root`` (``(pp, dp_replicate, dp_shard, cp,
    tp)``) into ``(rest, ep)``; every rank calls this (it creates process groups)."""
    mesh = root.mesh
    pp, dpr, dps, cp, tp = mesh.shape
    if plan.zero > 0:
        grid = mesh.reshape(pp, dpr, dps // plan.ep, plan.ep, cp, tp)
        names = ("pp", "dp_replicate", "edp_shard", "ep", "cp", "tp")
    else:
        grid = mesh.reshape(pp, dpr // plan.ep, plan.ep, dps, cp, tp)
        names = ("pp", "edp_replicate", "ep", "dp_shard", "cp", "tp")
    experts = DeviceMesh(root.device_type, grid, mesh_dim_names=names)
    if plan.zero > 0:
        shard = experts["edp_shard", "cp"]._flatten("edp_shard_cp")
        edp = experts["dp_replicate", "edp_shard_cp"] if dpr > 1 else shard
    else:
        edp = experts["edp_replicate", "dp_shard", "cp"]._flatten("edp")
    return ExpertMeshes(ep=experts["ep"], edp=edp)


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Shard every MoE layer's experts over ``mesh`` and route tokens to them (module doc); in
    place. Returns the experts modules (the data-parallel units of their gradients)."""
    out = []
    for _, module in expert_modules(model):
        for name, p in _expert_params(module, module.num_experts).items():
            # Every rank holds the same full weights (same seed); each keeps its own slice.
            local = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)
            setattr(module, name, nn.Parameter(local, requires_grad=p.requires_grad))
        module._shardwise_ep = _Dispatch(mesh, module.num_experts, type(module).forward)  # type: ignore[attr-defined]
        module.forward = types.MethodType(_expert_parallel_forward, module)  # names and state_dict keys unchanged
        out.append(module)
    return out


@dataclass(frozen=True)
class _Dispatch:
    mesh: DeviceMesh
    num_experts: int
    original_forward: Any  # the module class's own forward: the local compute


@contextlib.contextmanager
def _local_weights(module: nn.Module, names: list[str], grad_scale: float) -> Iterator[None]:
    """The module's expert weights as this rank's local slices, and ``num_experts`` as their count,
    while its own forward runs (``to_local`` keeps the autograd link to the sharded parameters); their gradient is
    scaled by
    ``grad_scale`` on the way back (see "Gradients" in the module doc)."""
    saved = {n: module._parameters[n] for n in names}
    experts = module.num_experts
    try:
        for n, p in saved.items():
            local = p.to_local() if isinstance(p, DTensor) else p
            module._parameters[n] = _ScaleGrad.apply(local, grad_scale)  # type: ignore[assignment]
        # The count the module's own code sees (transformers' grouped_mm histograms over it).
        module.num_experts = int(module._parameters[names[0]].shape[0])
        yield
    finally:
        module._parameters.update(saved)
        module.num_experts = experts


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _wait(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (an AsyncCollectiveTensor otherwise)."""
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


def _expert_parallel_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """Dispatch, local compute and combine of one MoE layer (the steps of the module doc)."""
    d: _Dispatch = self._shardwise_ep  # type: ignore[attr-defined]
    group, ep = d.mesh.get_group(), d.mesh.size()
    per = d.num_experts // ep
    t, k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    weight = top_k_weights.reshape(-1)
    token = torch.arange(t, device=hidden.device).repeat_interleave(k)
    valid = (expert >= 0) & (expert < d.num_experts)
    expert, weight, token = expert[valid], weight[valid], token[valid]
    order = torch.argsort(expert, stable=True)  # by expert, hence by owning rank
    expert, weight, token = expert[order], weight[order], token[order]
    owner = torch.div(expert, per, rounding_mode="floor")
    send = torch.bincount(owner, minlength=ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_splits, recv_splits = send.tolist(), recv.tolist()
    rows = _wait(all_to_all_single_autograd(hidden[token], recv_splits, send_splits, group))
    local_expert = torch.empty(sum(recv_splits), dtype=expert.dtype, device=expert.device)
    dist.all_to_all_single(local_expert, expert - owner * per, recv_splits, send_splits, group=group)
    # the module's own math on its local experts; the routing weights are applied at home
    with _local_weights(self, list(_expert_params(self, d.num_experts)), 1.0 / ep):
        computed = d.original_forward(self, rows, local_expert[:, None], rows.new_ones((rows.shape[0], 1)))
    back = _wait(all_to_all_single_autograd(computed, send_splits, recv_splits, group))
    out = torch.zeros_like(hidden)
    return out.index_add(0, token, back * weight[:, None].to(back.dtype))
