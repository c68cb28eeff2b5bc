"""Cut a single-device model into pipeline stages, without tracing it.

Three ways to say where the cuts go:

- **explicit stages**: :class:`PipelineStages` ``(stage1, stage2, ...)`` — each child is one stage,
  as in MindSpore's ``PipelineCell(SequentialCell([stage1, stage2]), micro_size)``;
- **explicit split points**: indices (or names such as ``"blocks.4"``) of the trunk units where a
  new stage begins, as in ``torch.distributed.pipelining``'s ``SplitPoint.BEGINNING``;
- **automatic**: the model's *trunk* is found and cut into ``S`` contiguous groups that minimise
  the most expensive stage (cost = parameter count, or forward FLOPs measured on an example batch).

The trunk is either the whole model when it is an ``nn.Sequential`` (each child is a unit), or the
largest (by parameters) ``nn.ModuleList``/``nn.Sequential`` *anywhere inside the model* holding
>= 2 modules of one type: a GPT's ``blocks``, a Hugging Face ``model.layers`` or ``transformer.h``
(the shallowest wins a tie). On each level of the path down to it, the modules with parameters
registered before it form the *input section* (embeddings: the first stage owns them), those after
it the *output section* (final norm, head: the last stage owns them); modules without parameters
(rotary embeddings, dropout) are shared by all stages. Each stage runs the model's own ``forward``
on a view of the model (:mod:`shardwise.parallel.pipeline.stage`), so whatever the blocks receive
besides the hidden state (rotary embeddings, position ids, masks) is recomputed by the model's code
on every stage from the batch's inputs, and only the hidden state crosses a stage boundary.

A weight shared between stages (tied input and output embeddings: GPT-2, Gemma) is held by each of
them; :func:`stage_ties` lists such ties, and the pipeline sums their gradients over the stages
that hold them after each step (:mod:`shardwise.parallel.pipeline`).

Stage modules keep the original parameter names (``blocks.3.attn.qkv.weight`` stays that), so
tensor-parallel styles written for the whole model apply to a stage unchanged, and the union of the
stages' ``state_dict`` equals the model's.

Balancing: with unit costs ``c_1..c_n`` and extra costs ``a`` (input section, stage 0) and ``b``
(output section, last stage), choose cut points ``0 = k_0 < k_1 < ... < k_S = n`` minimising
``max_s (sum_{k_{s-1} < i <= k_s} c_i + [s=1] a + [s=S] b)`` — the classic linear-partition
dynamic programme, O(S n^2) — with ties broken by the smaller sum of squared stage costs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.blocks import find_blocks
from shardwise.parallel.pipeline.stage import SequentialStage, TrunkStage

Balance = Literal["params", "flops"]


class PipelineStages(nn.Sequential):
    """User-declared stages: ``PipelineStages(stage1, stage2)``; child ``i`` becomes stage ``i``.

    Run as a whole on one process it is the plain composition ``stage_S(... stage_1(x))``, which is
    what the single-process reference computes.
    """


@dataclass(frozen=True)
class Trunk:
    """Where the repeated part of a model is, and what surrounds it."""

    name: str | None  # dotted path of the trunk container ("blocks", "model.layers"); None: the model itself
    units: tuple[tuple[str, nn.Module], ...]  # (name inside the trunk, module), in order
    inputs: tuple[str, ...]  # modules registered before the trunk, on each level of the path to it
    outputs: tuple[str, ...]  # modules registered after it (innermost level first)


def find_trunk(model: nn.Module) -> Trunk:
    """Locate the sequential trunk of ``model`` (see the module doc) or raise a ConfigError."""
    if isinstance(model, nn.Sequential):
        return Trunk(name=None, units=tuple(model.named_children()), inputs=(), outputs=())
    found = find_blocks(model)  # the blocks FSDP wraps and the planner prices (one rule)
    if found is None or not found.name:
        raise ConfigError(
            f"cannot find a sequential trunk in {type(model).__name__} "
            "(no nn.Sequential, and no ModuleList of repeated blocks inside it)",
            hint="wrap the stages in shardwise.PipelineStages(stage1, stage2, ...) or use pp=1",
        )
    name = found.name
    parts = name.split(".")
    inputs: list[str] = []
    outputs: list[str] = []
    for depth in range(len(parts)):  # innermost level first in the output order (norm before head)
        prefix = ".".join(parts[:depth])
        parent = model.get_submodule(prefix) if prefix else model
        names = [n for n, m in parent._modules.items() if m is not None]
        here = names.index(parts[depth])
        dotted = [f"{prefix}.{n}" if prefix else n for n in names]
        inputs += dotted[:here]
        outputs[:0] = dotted[here + 1 :]
    return Trunk(
        name=name, units=tuple(model.get_submodule(name).named_children()), inputs=tuple(inputs), outputs=tuple(outputs)
    )


# -- costs and cut points ------------------------------------------------------------------------
def _numel(modules: Sequence[nn.Module]) -> int:
    seen: set[int] = set()
    total = 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _flop_costs(model: nn.Module, trunk: Trunk, example_inputs: tuple[Any, ...]) -> tuple[list[float], float, float]:
    """Forward FLOPs per trunk unit, of the input section and of the output section."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*example_inputs)
    prefix = type(model).__name__
    counts = {key: float(sum(v.values())) for key, v in counter.get_flop_counts().items()}

    def of(*names: str) -> float:
        return counts.get(".".join((prefix, *names)), 0.0)

    base = (trunk.name,) if trunk.name else ()
    units = [of(*base, n) for n, _ in trunk.units]
    return units, sum(of(n) for n in trunk.inputs), sum(of(n) for n in trunk.outputs)


def balanced_cuts(
    costs: Sequence[float], num_stages: int, *, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """Start index of each stage: contiguous, non-empty groups minimising the largest stage cost."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # best[s][k]: (max stage cost, sum of squared stage costs) of placing units[:k] on stages
    # 0..s-1, compared lexicographically: the sum of squares breaks ties between equally good
    # maxima in favour of even stages. arg[s][k]: where stage s-1 starts.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    arg = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, num_stages + 1):
        extra = (first_extra if s == 1 else 0.0) + (last_extra if s == num_stages else 0.0)
        for k in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, k):
                stage = prefix[k] - prefix[j] + extra
                cost = (max(best[s - 1][j][0], stage), best[s - 1][j][1] + stage * stage)
                if cost < best[s][k]:
                    best[s][k], arg[s][k] = cost, j
    starts, k = [], n
    for s in range(num_stages, 0, -1):
        k = arg[s][k]
        starts.append(k)
    return starts[::-1]


def _parse_split_points(points: Sequence[int | str], trunk: Trunk, num_stages: int) -> list[int]:
    names = [n for n, _ in trunk.units]
    starts = [0]
    for point in points:
        if isinstance(point, int):
            index = point
        else:
            tail = point.split(".")[-1] if not trunk.name or point.startswith(f"{trunk.name}.") else None
            if tail is None or tail not in names:
                raise ConfigError(
                    f"split point {point!r} is not a unit of the trunk",
                    hint=f"use e.g. {(trunk.name + '.') if trunk.name else ''}{names[len(names) // 2]}",
                )
            index = names.index(tail)
        starts.append(index)
    if len(starts) != num_stages:
        raise ConfigError(
            f"{len(points)} split points make {len(starts)} stages but the plan needs {num_stages}",
            hint=f"give {num_stages - 1} split points",
        )
    if any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= len(names):
        raise ConfigError(
            f"split points {list(points)} must be increasing and inside 1..{len(names) - 1}",
            hint="every stage needs at least one unit",
        )
    return starts


@dataclass(frozen=True)
class Tie:
    """One weight held by several stages (tied embeddings): ``(stage, parameter name)`` of each
    holder, lowest stage first. The first holder's copy counts in the gradient norm."""

    holders: tuple[tuple[int, str], ...]


def stage_ties(stages: Sequence[nn.Module]) -> tuple[Tie, ...]:
    """The weights that more than one stage holds (the same ``nn.Parameter`` object)."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters(remove_duplicate=False):
            holders = seen.setdefault(id(p), [])
            if not any(h[0] == s for h in holders):
                holders.append((s, name))
    return tuple(Tie(tuple(h)) for h in seen.values() if len(h) > 1)


def check_ties(ties: Sequence[Tie], *, pp: int) -> None:
    """Every stage holding a tied weight must be on a different pipeline rank (stage ``s`` runs on
    rank ``s % pp``): two stages on one rank would hold the weight twice in one process."""
    for tie in ties:
        ranks = [s % pp for s, _ in tie.holders]
        if len(set(ranks)) < len(ranks):
            (a, name_a), (b, name_b) = tie.holders[0], tie.holders[1]
            raise ConfigError(
                f"parameter {name_a!r} (stage {a}) is tied to {name_b!r} (stage {b}), "
                f"and both stages run on pipeline rank {a % pp}",
                hint="use virtual_stages=1, untie the weights, or another pp",
            )


def split_model(
    model: nn.Module,
    num_stages: int,
    *,
    balance: Balance = "params",
    split_points: Sequence[int | str] | None = None,
    example_inputs: tuple[Any, ...] | None = None,
) -> list[nn.Module]:
    """All ``num_stages`` stage modules of ``model`` (they share its parameters; nothing is copied).

    No process-group work happens here, so every bad input is reported before any starts.
    """
    if isinstance(model, PipelineStages):
        if len(model) != num_stages:
            raise ConfigError(
                f"PipelineStages holds {len(model)} stages but the plan needs {num_stages} (pp x virtual_stages)",
                hint=f"use pp={len(model)}",
            )
        stages: list[nn.Module] = [
            SequentialStage(OrderedDict([(name, child)])) for name, child in model.named_children()
        ]
        for stage in stages:
            stage._keep_full_model(model)
        return stages
    trunk = find_trunk(model)
    n = len(trunk.units)
    if num_stages > n:
        where = f"the trunk {trunk.name!r}" if trunk.name else type(model).__name__
        raise ConfigError(
            f"{num_stages} pipeline stages (pp x virtual_stages) but {where} has only {n} blocks",
            hint=f"use pp<={n} (with virtual_stages=1), or a deeper model",
        )
    if split_points is not None:
        starts = _parse_split_points(split_points, trunk, num_stages)
    else:
        if balance == "flops":
            if example_inputs is None:
                raise ConfigError(
                    "balance='flops' needs an example batch to count FLOPs on",
                    hint="pass example_inputs=(x,) or use balance='params'",
                )
            costs, first, last = _flop_costs(model, trunk, example_inputs)
        elif balance == "params":
            costs = [float(_numel([m])) for _, m in trunk.units]
            dotted = trunk.name or ""
            path = [""] + [".".join(dotted.split(".")[:i]) for i in range(1, dotted.count(".") + 1)]
            own = sum(
                p.numel() for prefix in path for p in model.get_submodule(prefix)._parameters.values() if p is not None
            )
            first = float(_numel([model.get_submodule(n) for n in trunk.inputs]) + own)
            last = float(_numel([model.get_submodule(n) for n in trunk.outputs]))
        else:
            raise ConfigError(f"pipeline balance={balance!r} is unknown", hint="use 'params' or 'flops'")
        starts = balanced_cuts(costs, num_stages, first_extra=first, last_extra=last)
    bounds = list(zip(starts, starts[1:] + [n]))
    if trunk.name is None:
        stages = [SequentialStage(OrderedDict(trunk.units[a:b])) for a, b in bounds]
        for stage in stages:
            stage._keep_full_model(model)
    else:
        stages = [
            TrunkStage(model, trunk, a, b, is_first=s == 0, is_last=s == num_stages - 1)
            for s, (a, b) in enumerate(bounds)
        ]
    return stages


def stage_summary(stages: Sequence[nn.Module]) -> list[str]:
    """One line per stage: what it holds and its parameter count (for logs and examples)."""
    lines = []
    for s, stage in enumerate(stages):
        if isinstance(stage, TrunkStage):
            keys = list(stage.get_submodule(stage._trunk_name)._modules)
            trunk = f"{stage._trunk_name}[{keys[0]}..{keys[-1]}]"
            names = (
                [n for n in stage._owned if n in stage._owned_inputs]
                + [trunk]
                + [n for n in stage._owned if n not in stage._owned_inputs]
            )
        else:
            names = [name for name, _ in stage.named_children()]
        lines.append(f"stage {s}: {', '.join(names)} ({sum(p.numel() for p in stage.parameters()):,} params)")
    return lines
