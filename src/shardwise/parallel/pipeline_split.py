"""Cut a single-device model into pipeline stages, without tracing it.

Three ways to say where the cuts go:

- **explicit stages**: :class:`PipelineStages` ``(stage1, stage2, ...)`` — each child is one stage,
  as in MindSpore's ``PipelineCell(SequentialCell([stage1, stage2]), micro_size)``;
- **explicit split points**: indices (or names such as ``"blocks.4"``) of the trunk units where a
  new stage begins, as in ``torch.distributed.pipelining``'s ``SplitPoint.BEGINNING``;
- **automatic**: the model's *trunk* is found and cut into ``S`` contiguous groups that minimise
  the most expensive stage (cost = parameter count, or forward FLOPs measured on an example batch).

The trunk is either the whole model when it is an ``nn.Sequential`` (each child is a unit), or the
largest ``nn.ModuleList``/``nn.Sequential`` child holding >= 2 modules of one type (the repeated
blocks). Children registered before the trunk form the *input section* (embeddings; they run on
the first stage), children registered after it the *output section* (final norm, head; they run,
in registration order, on the last stage). The input section runs through the model's own
``forward``: the stage calls ``type(model).forward`` on a view of the model whose trunk raises as
soon as its first block is reached, and takes the tensor handed to that block as the stage's
hidden state. So ``x = drop(tok_emb(idx) + pos_emb(arange(T)))`` needs no declaration — but every
trunk block must take and return one tensor.

Stage modules keep the original parameter names (``blocks.3.attn.qkv.weight`` stays that), so a
tensor-parallel plan written for the whole model applies to a stage unchanged, and the union of the
stages' ``state_dict`` equals the model's.

Balancing: with unit costs ``c_1..c_n`` and extra costs ``a`` (input section, stage 0) and ``b``
(output section, last stage), choose cut points ``0 = k_0 < k_1 < ... < k_S = n`` minimising
``max_s (sum_{k_{s-1} < i <= k_s} c_i + [s=1] a + [s=S] b)`` — the classic linear-partition
dynamic programme, O(S n^2) — with ties broken by the smaller sum of squared stage costs.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.replay import replay_reset_parameters

Balance = Literal["params", "flops"]


class PipelineStages(nn.Sequential):
    """User-declared stages: ``PipelineStages(stage1, stage2)``; child ``i`` becomes stage ``i``.

    Run as a whole on one process it is the plain composition ``stage_S(... stage_1(x))``, which is
    what the single-process reference computes.
    """


@dataclass(frozen=True)
class Trunk:
    """Where the repeated part of a model is, and what surrounds it."""

    name: str | None  # attribute of the trunk container; None: the model itself is the trunk
    units: tuple[tuple[str, nn.Module], ...]  # (name inside the trunk, module), in order
    inputs: tuple[str, ...]  # children before the trunk (run on the first stage)
    outputs: tuple[str, ...]  # children after the trunk (run on the last stage, in order)


def find_trunk(model: nn.Module) -> Trunk:
    """Locate the sequential trunk of ``model`` (see the module doc) or raise a ConfigError."""
    if isinstance(model, nn.Sequential):
        return Trunk(name=None, units=tuple(model.named_children()), inputs=(), outputs=())
    children = list(model.named_children())
    best: tuple[int, int] | None = None  # (numel, index)
    for i, (_, child) in enumerate(children):
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) >= 2:
            if len({type(m) for m in child}) == 1:
                numel = sum(p.numel() for p in child.parameters())
                if best is None or numel > best[0]:
                    best = (numel, i)
    if best is None:
        raise ConfigError(
            f"cannot find a sequential trunk in {type(model).__name__} (no nn.Sequential, and no ModuleList of repeated blocks)",
            hint="wrap the stages in shardwise.PipelineStages(stage1, stage2, ...) or use pp=1",
        )
    index = best[1]
    name, container = children[index]
    return Trunk(
        name=name,
        units=tuple(container.named_children()),
        inputs=tuple(n for n, _ in children[:index]),
        outputs=tuple(n for n, _ in children[index + 1 :]),
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


def balanced_cuts(costs: Sequence[float], num_stages: int, *, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
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
                raise ConfigError(f"split point {point!r} is not a unit of the trunk", hint=f"use e.g. {(trunk.name + '.') if trunk.name else ''}{names[len(names) // 2]}")
            index = names.index(tail)
        starts.append(index)
    if len(starts) != num_stages:
        raise ConfigError(f"{len(points)} split points make {len(starts)} stages but the plan needs {num_stages}", hint=f"give {num_stages - 1} split points")
    if any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= len(names):
        raise ConfigError(f"split points {list(points)} must be increasing and inside 1..{len(names) - 1}", hint="every stage needs at least one unit")
    return starts


# -- stage modules --------------------------------------------------------------------------------
class _TrunkReached(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("trunk reached")
        self.hidden = hidden


class _Catch(nn.Module):
    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise _TrunkReached(hidden)


class _StageInit:
    """``init_weights(seed)`` for a stage cut from a model built on the meta device.

    The stage keeps a reference to the whole (meta) model, which costs no memory: its parameters
    are this stage's materialized ones plus shapes without storage for the other stages'. Running
    the whole model's initialization then draws every tensor in the single-process order and
    writes only the local ones (a copy into a meta tensor does nothing), so each stage gets exactly
    the values one process would have. Models split off the meta device are already initialized.
    """

    def _keep_full_model(self, model: nn.Module) -> None:
        if any(p.is_meta for p in model.parameters()):
            object.__setattr__(self, "_full_model", model)  # not a submodule

    def init_weights(self, seed: int = 0) -> None:
        model = self.__dict__.get("_full_model")
        if model is None:
            raise ConfigError(
                "this pipeline stage was cut from an initialized model; there is nothing to re-initialize",
                hint="build the model on the meta device (shardwise.parallel.init.parallelize_on_meta) to initialize stages",
            )
        if callable(getattr(model, "init_weights", None)):
            model.init_weights(seed)
        else:
            replay_reset_parameters(model, seed=seed)


class SequentialStage(_StageInit, nn.Sequential):
    """A stage of an ``nn.Sequential`` (or :class:`PipelineStages`) model: its units, names kept."""


class TrunkStage(_StageInit, nn.Module):
    """One stage of a model with an input section, a trunk and an output section.

    Forward: (first stage) the model's own forward up to the trunk -> the owned trunk units in order
    -> (last stage) the output-section modules in registration order.
    """

    def __init__(self, model: nn.Module, trunk: Trunk, start: int, stop: int, *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self._trunk_name = trunk.name or "trunk"
        self._input_names = trunk.inputs if is_first else ()
        self._output_names = trunk.outputs if is_last else ()
        self._root_param_names: tuple[str, ...] = ()
        if is_first:
            for name in trunk.inputs:
                self.add_module(name, getattr(model, name))
            # Parameters and buffers held directly by the root belong to the input section.
            self._root_param_names = tuple(model._parameters)
            for name, p in model._parameters.items():
                self.register_parameter(name, p)
            for name, b in model._buffers.items():
                self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
            # A shell of the model: its class and plain attributes, none of its modules or tensors
            # (so it keeps no other stage's parameters alive).
            template = copy.copy(model)
            template.__dict__ = dict(model.__dict__, _modules={}, _parameters={}, _buffers={})
            template._forward_hooks, template._forward_pre_hooks = OrderedDict(), OrderedDict()
            object.__setattr__(self, "_template", template)  # not a submodule: holds no parameters
        self.add_module(self._trunk_name, nn.Sequential(OrderedDict(trunk.units[start:stop])))
        for name in self._output_names:
            self.add_module(name, getattr(model, name))
        self._keep_full_model(model)

    def _run_input_section(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        view = copy.copy(self._template)
        view._modules = {name: self._modules[name] for name in self._input_names}
        view._modules[self._trunk_name] = nn.ModuleList([_Catch()])
        view._parameters = {name: self._parameters[name] for name in self._root_param_names}
        view._buffers = dict(self._buffers)
        try:
            type(self._template).forward(view, *inputs, **kwargs)
        except _TrunkReached as reached:
            return reached.hidden
        raise ConfigError(
            f"{type(self._template).__name__}.forward returned without calling the trunk {self._trunk_name!r}",
            hint="pass explicit stages with shardwise.PipelineStages(...)",
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        """``kwargs`` (e.g. ``position_ids``) reach the model's own forward on the first stage."""
        hidden = self._run_input_section(*inputs, **kwargs) if self.is_first else inputs[0]
        for unit in self._modules[self._trunk_name]:
            hidden = unit(hidden)
        for name in self._output_names:
            hidden = self._modules[name](hidden)
        return hidden


def _check_no_shared_params(stages: Sequence[nn.Module]) -> None:
    owner: dict[int, tuple[int, str]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters(remove_duplicate=False):
            if id(p) in owner and owner[id(p)][0] != s:
                other, other_name = owner[id(p)]
                raise ConfigError(
                    f"parameter {other_name!r} (stage {other}) is shared with {name!r} (stage {s}); tied weights cannot cross pipeline stages",
                    hint="untie them (e.g. a separate lm_head weight) or use pp=1",
                )
            owner[id(p)] = (s, name)


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
            raise ConfigError(f"PipelineStages holds {len(model)} stages but the plan needs {num_stages} (pp x virtual_stages)", hint=f"use pp={len(model)}")
        stages: list[nn.Module] = [SequentialStage(OrderedDict([(name, child)])) for name, child in model.named_children()]
        for stage in stages:
            stage._keep_full_model(model)
        _check_no_shared_params(stages)
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
                raise ConfigError("balance='flops' needs an example batch to count FLOPs on", hint="pass example_inputs=(x,) or use balance='params'")
            costs, first, last = _flop_costs(model, trunk, example_inputs)
        elif balance == "params":
            costs = [float(_numel([m])) for _, m in trunk.units]
            first = float(_numel([getattr(model, n) for n in trunk.inputs])) + sum(p.numel() for p in model._parameters.values())
            last = float(_numel([getattr(model, n) for n in trunk.outputs]))
        else:
            raise ConfigError(f"pipeline balance={balance!r} is unknown", hint="use 'params' or 'flops'")
        starts = balanced_cuts(costs, num_stages, first_extra=first, last_extra=last)
    bounds = list(zip(starts, starts[1:] + [n]))
    if trunk.name is None:
        stages = [SequentialStage(OrderedDict(trunk.units[a:b])) for a, b in bounds]
        for stage in stages:
            stage._keep_full_model(model)
    else:
        stages = [TrunkStage(model, trunk, a, b, is_first=s == 0, is_last=s == num_stages - 1) for s, (a, b) in enumerate(bounds)]
    _check_no_shared_params(stages)
    return stages


def stage_summary(stages: Sequence[nn.Module]) -> list[str]:
    """One line per stage: what it holds and its parameter count (for logs and examples)."""
    lines = []
    for s, stage in enumerate(stages):
        parts = []
        for name, child in stage.named_children():
            if isinstance(stage, TrunkStage) and name == stage._trunk_name:
                keys = list(child._modules)
                parts.append(f"{name}[{keys[0]}..{keys[-1]}]")
            else:
                parts.append(name)
        lines.append(f"stage {s}: {', '.join(parts)} ({sum(p.numel() for p in stage.parameters()):,} params)")
    return lines
