"""Bring each Muon update to whole matrices and back: the only communication of the optimizer.

A parameter's update ``U`` (momentum, Nesterov) is computed on this rank's shard, where the plan put
the parameter; only Newton–Schulz needs the whole matrix. Per parameter, by its placement:

- a plain tensor (dp/DDP, ZeRO-1, a pipeline stage) or a replicated DTensor: already whole; no
  communication (every replica computes the same O); MoE experts sharded over ``ep`` by whole
  experts: each rank orthogonalizes its own experts, no communication;
- a DTensor sharded on a 1-D mesh (ZeRO-2/3 on ``dp_shard``, TP on ``tp``), ``route="all_to_all"``
  (the default): the parameters of one mesh form one bucket; each gets an *owner* rank (largest
  first, onto the least-loaded rank), every rank sends its shards to their owners in **one**
  ``all_to_all_single``, each owner runs Newton–Schulz once per matrix it owns, and a second
  ``all_to_all_single`` sends each rank its slice of O. Bytes sent per rank and step ≈ 2·(N-1)/N ·
  |U| in the Newton–Schulz dtype (bf16: half of fp32), and Newton–Schulz FLOPs are split ~1/N.
- anything else (2-D meshes: HSDP, FSDP x TP), or ``route="gather"``, the reference path (Moonshot's
  distributed Muon): ``full_tensor()`` all-gathers U over the sharding dims on every rank, every
  rank runs Newton–Schulz on the whole matrix and keeps its own slice (no communication back).

Both give exactly the single-process result (same kernels on the same whole matrix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from shardwise.optim.newton_schulz import Units, orthogonalize

ROUTES = ("all_to_all", "gather")


@dataclass(frozen=True)
class Item:
    """One Muon parameter's step input: the parameter (its placement), its local update, its units."""

    param: torch.Tensor
    update: torch.Tensor  # this rank's shard of U
    units: Units


def _whole_units(p: DTensor, units: Units) -> bool:
    """Each rank holds whole units already: a batch (MoE experts) sharded evenly over its batch dim (EP)."""
    pl = p.placements[0]
    return (p.device_mesh.ndim == 1 and type(pl) is Shard and pl.dim == 0 and len(units.logical) == 3
            and tuple(p.shape) == units.logical and p.shape[0] % p.device_mesh.size() == 0)


def _kind(item: Item, route: str) -> str:
    p = item.param
    if not isinstance(p, DTensor) or all(isinstance(pl, Replicate) for pl in p.placements):
        return "local"
    if _whole_units(p, item.units):
        return "shards"
    if route == "all_to_all" and p.device_mesh.ndim == 1 and type(p.placements[0]) is Shard:
        return "owner"
    return "gather"


def chunk_sizes(size: int, n: int) -> list[int]:
    """Rows of each rank's shard of a dim of ``size`` over ``n`` ranks (``torch.chunk``, as ``Shard``)."""
    cs = math.ceil(size / n) if size else 0
    return [max(0, min(cs, size - i * cs)) for i in range(n)]


def orthogonalized(items: list[Item], *, route: str = "all_to_all", **ns: Any) -> list[torch.Tensor]:
    """This rank's slice of O for every item (module doc), in the Newton–Schulz dtype."""
    out: list[torch.Tensor | None] = [None] * len(items)
    buckets: dict[Any, list[int]] = {}
    for i, item in enumerate(items):
        kind = _kind(item, route)
        if kind == "local":
            out[i] = orthogonalize(item.update, item.units, **ns)
        elif kind == "shards":  # this rank's experts, each whole
            local = Units(logical=tuple(item.update.shape), split_dim=item.units.split_dim, sizes=item.units.sizes,
                          fan_out_dim=item.units.fan_out_dim)
            out[i] = orthogonalize(item.update, local, **ns)
        elif kind == "gather":
            out[i] = _gathered(item, **ns)
        else:
            buckets.setdefault(item.param.device_mesh, []).append(i)
    for mesh, idx in buckets.items():
        for i, o in zip(idx, _owned([items[i] for i in idx], mesh.get_group(), **ns)):
            out[i] = o
    return out  # type: ignore[return-value]


def _gathered(item: Item, **ns: Any) -> torch.Tensor:
    """The reference path: all-gather U, Newton–Schulz on every rank, keep the local slice."""
    p = item.param
    full = DTensor.from_local(item.update, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride()).full_tensor()
    o = orthogonalize(full, item.units, **ns)
    return distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None).to_local()


def owners(numels: list[int], n: int) -> list[int]:
    """Owner rank of each matrix: largest first onto the least-loaded rank (ties: lowest rank)."""
    load, out = [0] * n, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        r = min(range(n), key=lambda r: load[r])
        out[i], load[r] = r, load[r] + numels[i]
    return out


def _owned(items: list[Item], group: Any, **ns: Any) -> list[torch.Tensor]:
    """One all-to-all of U's shards to their owners, Newton–Schulz there, one all-to-all back."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    dtype = ns.get("dtype", torch.bfloat16)
    dims = [it.param.placements[0].dim for it in items]
    sizes = [chunk_sizes(it.param.shape[d], n) for it, d in zip(items, dims)]

    def shard_shape(i: int, rank: int) -> list[int]:
        shape = list(items[i].param.shape)
        shape[dims[i]] = sizes[i][rank]
        return shape

    own = owners([it.param.numel() for it in items], n)
    mine = [i for i in range(len(items)) if own[i] == me]
    numel = [[math.prod(shard_shape(i, r)) for r in range(n)] for i in range(len(items))]
    send_splits = [sum(numel[i][me] for i in range(len(items)) if own[i] == q) for q in range(n)]
    recv_splits = [sum(numel[i][j] for i in mine) for j in range(n)]
    send = torch.cat([items[i].update.reshape(-1).to(dtype) for q in range(n) for i in range(len(items)) if own[i] == q]
                     or [items[0].update.new_empty(0, dtype=dtype)])
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)

    # Whole matrices on their owner: source j's block holds its shards of `mine`, in order.
    parts = list(recv.split(recv_splits))
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
    for j in range(n):
        for i, flat in zip(mine, parts[j].split([numel[i][j] for i in mine])):
            pieces[i].append(flat.view(shard_shape(i, j)))
    result = {i: orthogonalize(torch.cat(pieces[i], dim=dims[i]), items[i].units, **ns).to(dtype) for i in mine}
    back = torch.cat([result[i].split(sizes[i], dim=dims[i])[j].reshape(-1) for j in range(n) for i in mine]
                     or [send.new_empty(0)])
    mine_back = send.new_empty(sum(send_splits))
    dist.all_to_all_single(mine_back, back, send_splits, recv_splits, group=group)

    out: list[torch.Tensor | None] = [None] * len(items)
    blocks = list(mine_back.split(send_splits))
    for q in range(n):
        idx = [i for i in range(len(items)) if own[i] == q]
        for i, flat in zip(idx, blocks[q].split([numel[i][me] for i in idx])):
            out[i] = flat.view(shard_shape(i, me))
    return out  # type: ignore[return-value]
