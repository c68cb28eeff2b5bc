"""Which parameters Muon takes, and the matrices (units) it orthogonalizes each one as.

Read from the (possibly parallelized) model by module type and name, so it works on the module the
Trainer built (parameter names survive ``fully_shard``, TP and the pipeline split):

- ``nn.Linear`` weights and GPT-2 ``Conv1D`` weights go to Muon: one matrix, or, for a fused
  projection, its pieces one by one: q|k|v (a name containing ``qkv``, ``c_attn``,
  ``query_key_value``, ``wqkv``: 3 pieces, of the attention's q/k/v widths under grouped-query
  attention) and gate|up (``gate_up``: 2 pieces). A tensor-parallel fused view ``(3, w, in)``
  (:mod:`shardwise.parallel.tp.layers`) is the same matrix ``(3w, in)``.
- MoE expert weights (3-D ``(E, out, in)`` tensors of one module, or the 4-D TP view of a fused
  ``gate_up``) go to Muon as a batch of E matrices (two pieces each for gate|up).
- Embeddings, the LM head (and any weight tied to an embedding), norms, biases, scalars, routers
  and convolutions go to AdamW.
- Any other parameter of 2+ dims is refused (a ConfigError naming it): shardwise does not guess
  whether it is a matrix. Name it in ``muon=`` or ``adamw=`` (fnmatch patterns over parameter names).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.optim.newton_schulz import Units
from shardwise.parallel.chunked_loss import find_lm_head
from shardwise.parallel.tp.layers import is_conv1d, qkv_widths

_FUSED_QKV = ("qkv", "c_attn", "query_key_value", "wqkv")
_ROUTERS = ("router", "gate")


@dataclass
class Routing:
    """Parameters by optimizer, names in module order; ``units[name]`` for each Muon parameter."""

    muon: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    units: dict[str, Units] = field(default_factory=dict)

    def summary(self) -> str:
        matrices = sum(u.count for u in self.units.values())
        n_muon = sum(p.numel() for _, p in self.muon)
        n_adamw = sum(p.numel() for _, p in self.adamw)
        return (f"Muon: {len(self.muon)} parameters ({matrices} matrices, {n_muon:,} values); "
                f"AdamW: {len(self.adamw)} parameters ({n_adamw:,} values)")


def _pieces(name: str, out: int, parent: nn.Module | None) -> tuple[int, ...] | None:
    low = name.lower()
    if any(k in low for k in _FUSED_QKV):
        widths = qkv_widths(parent) if parent is not None else None
        # tensor parallelism divides the attention's head counts by tp (its local widths); the
        # weight keeps its global rows, in the same q : k : v proportions
        if widths is not None and sum(widths) and out % sum(widths) == 0:
            return tuple(w * (out // sum(widths)) for w in widths)
        if out % 3:
            raise ConfigError(f"Muon cannot split the fused q|k|v weight {name} ({out} outputs) into 3 pieces",
                              hint=f"name it in muon=[{name!r}] to orthogonalize it whole, or in adamw=[...]")
        return (out // 3,) * 3
    if "gate_up" in low:
        return (out // 2,) * 2
    return None


def _matrix_units(name: str, module: nn.Module, p: torch.Tensor, parent: nn.Module | None) -> Units:
    """A Linear/Conv1D weight: logical (out, in) (Conv1D: (in, out)), fused pieces along fan-out."""
    conv1d = is_conv1d(module)
    out = int(module.nf) if conv1d else int(module.out_features)  # type: ignore[arg-type]
    fan_in = int(p.shape[0]) if conv1d else int(module.in_features)  # type: ignore[arg-type]
    logical = (fan_in, out) if conv1d else (out, fan_in)
    fan_out_dim = 1 if conv1d else 0
    return Units(logical=logical, split_dim=fan_out_dim, sizes=_pieces(name, out, parent), fan_out_dim=fan_out_dim)


def _expert_units(name: str, p: torch.Tensor) -> Units:
    """(E, out, in), or the TP view (E, 2, I, in) of a fused gate|up: a batch of E matrices."""
    shape = tuple(int(s) for s in p.shape)
    logical = (shape[0], shape[1] * shape[2], shape[3]) if len(shape) == 4 else shape
    sizes = (logical[1] // 2,) * 2 if "gate_up" in name.lower() else None
    return Units(logical=logical, split_dim=1, sizes=sizes, fan_out_dim=1)


def _is_experts(module: nn.Module) -> bool:
    own = [p for p in module.parameters(recurse=False) if p.dim() >= 3]
    return len(own) >= 2 and len({p.shape[0] for p in own}) == 1


def _head_and_embeddings(model: nn.Module) -> set[int]:
    ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    try:
        ids.add(id(find_lm_head(model)[1].weight))
    except ConfigError:
        pass  # a model without an LM head (a classifier, an MLP)
    return ids


def _route_one(full: str, pname: str, module: nn.Module, p: torch.Tensor, parent: nn.Module | None,
               special: set[int]) -> Units | None:
    """Units for Muon, None for AdamW, or a ConfigError for a parameter it cannot classify."""
    if (
        p.dim() < 2
        or pname == "bias"
        or id(p) in special
        or isinstance(module, (nn.Embedding, nn.modules.conv._ConvNd))
    ):
        return None
    if pname == "weight" and (isinstance(module, nn.Linear) or is_conv1d(module)):
        return _matrix_units(full, module, p, parent)
    if _is_experts(module) and p.dim() >= 3:
        return _expert_units(full, p)
    if any(k in type(module).__name__.lower() for k in _ROUTERS) or pname.lower() in _ROUTERS:
        return None
    raise ConfigError(
        f"Muon cannot tell what parameter {full} (shape {tuple(p.shape)}, in a {type(module).__name__}) is",
        hint=f"name it in muon=[{full!r}] (one matrix) or adamw=[{full!r}]",
    )


def route(model: nn.Module, *, muon: tuple[str, ...] = (), adamw: tuple[str, ...] = ()) -> Routing:
    """Split ``model``'s trainable parameters between Muon and AdamW (module doc). ``muon``/``adamw``:
    fnmatch patterns of parameter names that override the rules (a pattern in ``muon`` makes the
    parameter one matrix, or a batch of matrices for 3-D)."""
    out, seen = Routing(), set()
    special = _head_and_embeddings(model)
    modules = dict(model.named_modules())
    for mname, module in modules.items():
        parent = modules.get(mname.rpartition(".")[0]) if mname else None
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            full = f"{mname}.{pname}" if mname else pname
            if any(fnmatch.fnmatchcase(full, pat) for pat in adamw):
                units = None
            elif any(fnmatch.fnmatchcase(full, pat) for pat in muon):
                if p.dim() not in (2, 3):
                    raise ConfigError(
                        f"muon={list(muon)} names {full} of shape {tuple(p.shape)}: Muon takes 2-D or 3-D (batched) "
                        "parameters",
                        hint="leave it to AdamW",
                    )
                units = Units(logical=tuple(int(s) for s in p.shape), split_dim=p.dim() - 2, fan_out_dim=p.dim() - 2)
            else:
                units = _route_one(full, pname, module, p, parent, special)
            if units is None:
                out.adamw.append((full, p))
            else:
                out.muon.append((full, p))
                out.units[full] = units
    return out
