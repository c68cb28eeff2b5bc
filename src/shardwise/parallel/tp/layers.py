"""Tensor-parallel styles for the layer shapes torch's ``ColwiseParallel``/``RowwiseParallel`` do
not take: GPT-2's ``Conv1D``, fused projections (q/k/v or gate/up in one weight) and MoE experts
held as 3-D tensors.

Each style keeps the parameters as DTensors whose *global* layout is the original one (so
``full_tensor()``, DCP checkpoints, resharding and exports see the weights as the single-device
model has them) and computes on the local shards (Megatron-LM's column/row split, Shoeybi et al.
2019):

- **column split** ``y_r = x W_r (+ b_r)``: the input enters through an identity whose backward
  all-reduces the input gradient (``from_local(Replicate).to_local(grad_placements=Partial)``);
  the output stays local (the last dimension is 1/tp wide);
- **row split** ``y = sum_r x_r W_r (+ b)``: the local partial product is all-reduced
  (``Partial -> Replicate``), then the replicated bias is added;
- **fused** column split with ``k`` equal pieces (GPT-2's ``c_attn`` = [q | k | v], ``k = 3``):
  the fused dimension ``k * w`` of the parameter is viewed as ``(k, w)`` and ``w`` is sharded, so
  rank ``r`` holds the ``r``-th 1/tp of *each* piece, ``[q_r | k_r | v_r]``: whole heads of q, k
  and v, and the attention's own ``split`` (its ``split_size`` is divided by tp) and head reshapes
  see a consistent local layout. The parameter's global shape is then ``(in, k, w)`` instead of
  ``(in, k w)`` — the same elements in the same order (a ``reshape`` restores it), and a plain
  ``Shard`` that DCP checkpoints, reshards and ``full_tensor()`` handle (``_StridedShard``, which
  would keep the shape, is not one contiguous chunk per rank, which DCP requires);
- **fused q|k|v of unequal widths** (grouped-query attention: Phi-3's ``qkv_proj`` with fewer
  key/value heads than query heads): rank ``r`` computes the ``r``-th 1/tp of each of q, k and v,
  ``[q_r | k_r | v_r]`` — query heads ``r H/tp ..``, which use exactly the key/value heads
  ``r K/tp ..`` that it holds. No single ``Shard`` of the fused dimension holds those rows (q's
  slice is wider than k's), and a reordered global layout would no longer be the model's own in
  checkpoints and exports, so the weight stays whole on every rank (one parameter, the original
  layout) and each rank computes with its rows only; the weight's gradient (each rank's rows,
  zero elsewhere) is all-reduced over tp in backward. It costs that layer's memory on every rank
  and one all-reduce of its gradient per step; the activations are split as for any column split;
- **experts** (``gate_up_proj`` of shape (E, 2I, H), ``down_proj`` (E, H, I), applied with
  ``F.linear`` per expert): every expert's MLP is split like a dense MLP — gate and up by rows of
  I (fused, ``k = 2``: ``gate_up_proj`` becomes (E, 2, I, H)), down by its I columns — and the
  experts' summed output is all-reduced once
  per layer. The router stays replicated (E x H, small).

Communication per layer and step: one all-reduce of the activations forward (after the row split)
and one backward (the input gradient of the column split), as for a Linear pair.
"""

from __future__ import annotations

from abc import abstractmethod

import copy
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from shardwise.parallel.local import local_tensor


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``transformers.pytorch_utils.Conv1D`` (a Linear with a transposed (in, out) weight),
    recognized by its name and shape so this module never imports transformers."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and weight.dim() >= 2
        and hasattr(module, "nf")
    )


def in_out(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a Linear or Conv1D, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        nx, nf = module.weight.shape
        return int(nx), int(nf)
    return None


def expert_weights(module: nn.Module) -> dict[str, tuple[str, int]] | None:
    """For a module holding MoE experts as 3-D tensors applied with ``F.linear`` per expert:
    ``{name: (role, dim)}`` with role ``fused`` (gate_up, split dim 1 in 2 pieces), ``col`` (split
    dim 1) or ``row`` (split dim 2); None when the module does not look like that."""
    params = {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
    if len(params) < 2 or len({p.shape[0] for p in params.values()}) != 1:
        return None
    roles: dict[str, tuple[str, int]] = {}
    for name, p in params.items():
        low = name.lower()
        if "gate_up" in low:
            roles[name] = ("fused", 1)
        elif "down" in low or low.startswith("w2"):
            roles[name] = ("row", 2)
        elif any(k in low for k in ("gate", "up", "w1", "w3")):
            roles[name] = ("col", 1)
        else:
            return None
    rows = [params[n] for n, (r, _) in roles.items() if r == "row"]
    cols = [(params[n], r) for n, (r, _) in roles.items() if r != "row"]
    if len(rows) != 1 or not cols:
        return None
    hidden, inner = rows[0].shape[1], rows[0].shape[2]
    for p, role in cols:  # (E, I or 2I, H) against down's (E, H, I)
        if p.shape[2] != hidden or p.shape[1] != (2 * inner if role == "fused" else inner):
            return None
    return roles


def inner_sizes(module: nn.Module, style: str) -> dict[str, int]:
    """The sizes a style divides by tp (for validation), by a readable name."""
    shape = in_out(module)
    if style in ("colwise", "colwise_rep", "lm_head") and shape:
        return {"out_features": shape[1]}
    if style == "rowwise" and shape:
        return {"in_features": shape[0]}
    if style.startswith("colwise_fused") and shape:
        pieces = fused_pieces(style)
        return {f"out_features/{pieces}": shape[1] // pieces}
    if style == "colwise_grouped" and shape:
        return {"out_features": shape[1]}
    if style == "experts":
        roles = expert_weights(module) or {}
        return {
            f"{n}.dim{d}" + ("/2" if r == "fused" else ""): getattr(module, n).shape[d] // (2 if r == "fused" else 1)
            for n, (r, d) in roles.items()
        }
    return {}


def fused_pieces(style: str) -> int:
    """``colwise_fused3`` -> 3."""
    return int(style.removeprefix("colwise_fused") or 3)


# -- the collectives at the edges of a split (DTensor's, differentiable) ----------------------------
def copy_in(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; the backward all-reduces the gradient (each rank holds a partial one)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def reduce_out(y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """All-reduce of the ranks' partial sums forward; identity backward."""
    return DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class _LocalStyle(ParallelStyle):
    """Distribute some parameters with given placements and compute on their local shards."""

    @abstractmethod
    def placements(self, module: nn.Module) -> dict[str, tuple[Placement, tuple[int, int] | None]]:
        """``{name: (placement, fused)}``; ``fused = (dim, pieces)`` views that dim as (pieces, width)
        before sharding (the placement then names a dim of the viewed shape)."""

    @abstractmethod
    def forward(self, mesh: DeviceMesh) -> Callable[..., Any]:
        """The module's forward computing on the local shards."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, (placement, fused) in self.placements(module).items():
            p = module._parameters[name]
            if p is None or isinstance(p, DTensor):
                continue
            full = p.detach()
            if fused is not None:
                dim, pieces = fused
                full = full.reshape(*full.shape[:dim], pieces, full.shape[dim] // pieces, *full.shape[dim + 1:])
            dt = distribute_tensor(full, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        module.forward = types.MethodType(self.forward(device_mesh), module)
        return module


def _column(dim: int, pieces: int) -> tuple[Placement, tuple[int, int] | None]:
    return (Shard(dim), None) if pieces == 1 else (Shard(dim + 1), (dim, pieces))


def _unfused(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A local (..., pieces, w/tp, ...) shard as (..., pieces * w/tp, ...): [q_r | k_r | v_r]."""
    return t if t is None else t.reshape(*t.shape[:dim], -1, *t.shape[dim + 2:])


class ColumnSplit(_LocalStyle):
    """Column split of a Linear or Conv1D, optionally fused from ``pieces`` equal projections."""

    def __init__(self, pieces: int = 1) -> None:
        super().__init__()
        self.pieces = pieces

    def placements(self, module: nn.Module) -> dict[str, tuple[Placement, tuple[int, int] | None]]:
        out_dim = 1 if is_conv1d(module) else 0
        return {
            "weight": _column(out_dim, self.pieces),
            **({"bias": _column(0, self.pieces)} if module.bias is not None else {}),
        }

    def forward(self, mesh: DeviceMesh) -> Callable[..., Any]:
        fused = self.pieces > 1

        def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
            x = copy_in(x, mesh)
            w, b = local_tensor(module.weight), local_tensor(module.bias)
            if fused:
                w, b = _unfused(w, 1 if is_conv1d(module) else 0), _unfused(b, 0)
            if is_conv1d(module):
                y = x.reshape(-1, x.shape[-1]) @ w
                return (y if b is None else y + b).view(*x.shape[:-1], -1)
            return F.linear(x, w, b)

        return run


class RowSplit(_LocalStyle):
    """Row split of a Conv1D (torch's RowwiseParallel covers Linear): partial products all-reduced."""

    def placements(self, module: nn.Module) -> dict[str, tuple[Placement, tuple[int, int] | None]]:
        return {"weight": (Shard(0), None), **({"bias": (Replicate(), None)} if module.bias is not None else {})}

    def forward(self, mesh: DeviceMesh) -> Callable[..., Any]:
        def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
            y = reduce_out((x.reshape(-1, x.shape[-1]) @ local_tensor(module.weight)), mesh).view(*x.shape[:-1], -1)
            b = local_tensor(module.bias)
            return y if b is None else y + b

        return run


def qkv_widths(attention: nn.Module) -> tuple[int, int, int] | None:
    """(q, k, v) widths of an attention module's fused projection, from its head counts and
    ``head_dim`` (attributes, else its ``config``: ``num_attention_heads``, ``num_key_value_heads``);
    None when they are not all there."""
    config = getattr(attention, "config", None)

    def count(*names: str) -> int | None:
        for holder in (attention, config):
            for name in names:
                value = getattr(holder, name, None)
                if isinstance(value, int) and value > 0:
                    return value
        return None

    heads = count("num_heads", "num_attention_heads", "n_head", "n_heads")
    kv = count("num_key_value_heads", "num_kv_heads", "n_kv_heads") or heads
    head_dim = count("head_dim")
    if heads is None or kv is None or head_dim is None:
        return None
    return heads * head_dim, kv * head_dim, kv * head_dim


class GroupedColumnSplit(ParallelStyle):
    """Column split of a Linear fused from pieces of unequal ``widths`` (q|k|v under grouped-query
    attention, module doc): the weight stays whole, each rank computes with the ``r``-th 1/tp of
    every piece, and the weight's gradient is all-reduced over tp."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.widths = tuple(widths)

    def rows(self, rank: int, tp: int) -> torch.Tensor:
        starts = [sum(self.widths[:i]) for i in range(len(self.widths))]
        return torch.cat(
            [torch.arange(s + rank * (w // tp), s + (rank + 1) * (w // tp)) for s, w in zip(starts, self.widths)]
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rows = self.rows(device_mesh.get_local_rank(), device_mesh.size())
        cache: dict[torch.device, torch.Tensor] = {}

        def run(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            w = mod.weight
            index = cache.setdefault(w.device, rows.to(w.device))
            x = copy_in(x, device_mesh)
            w = copy_in(w, device_mesh).index_select(0, index)  # backward: the rows' gradients, summed over tp
            b = None if mod.bias is None else copy_in(mod.bias, device_mesh).index_select(0, index)
            return F.linear(x, w, b)

        module.forward = types.MethodType(run, module)
        return module


def expert_weights_sharded(module: nn.Module) -> dict[str, str]:
    """The roles of an :class:`ExpertSplit` module's tensors once sharded (a fused one is 4-D)."""
    roles = {}
    for name, p in module.named_parameters(recurse=False):
        if isinstance(p, DTensor):
            low = name.lower()
            roles[name] = "fused" if p.dim() == 4 else "row" if ("down" in low or low.startswith("w2")) else "col"
    return roles


class ExpertSplit(_LocalStyle):
    """Every expert's MLP split over tp (module doc); the module's own forward runs on a view of it
    whose expert tensors are the local shards."""

    def placements(self, module: nn.Module) -> dict[str, tuple[Placement, tuple[int, int] | None]]:
        roles = expert_weights(module) or {}
        return {n: (_column(1, 2) if role == "fused" else (Shard(dim), None)) for n, (role, dim) in roles.items()}

    def forward(self, mesh: DeviceMesh) -> Callable[..., Any]:
        def run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            original = type(module).forward
            roles = expert_weights_sharded(module)
            view = copy.copy(module)
            view.__dict__ = dict(module.__dict__)
            view.__dict__["_parameters"] = {n: p for n, p in module._parameters.items() if n not in roles}
            for n, role in roles.items():
                local = local_tensor(module._parameters[n])
                view.__dict__[n] = _unfused(local, 1) if role == "fused" else local
            floating = lambda a: copy_in(a, mesh) if isinstance(a, torch.Tensor) and a.is_floating_point() else a  # noqa: E731
            out = original(view, *[floating(a) for a in args], **{k: floating(v) for k, v in kwargs.items()})
            return reduce_out(out, mesh)

        return run
