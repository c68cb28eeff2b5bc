"""Pipeline stage modules: a slice of a model's trunk that runs through the model's own ``forward``.

A model with a *trunk* (a ``ModuleList``/``Sequential`` of repeated blocks, at any depth: a GPT's
``blocks``, a Hugging Face ``model.layers`` or ``transformer.h``) is cut into stages that each own
a contiguous range ``[start, stop)`` of the blocks. A :class:`TrunkStage` runs the *model's own*
``forward`` code, not a re-implementation of it, on a *view* of the model:

- the trunk is replaced by a list of the same length whose entries before ``start`` are skipped
  (their output is never used), whose entries ``start..stop-1`` are this stage's blocks, and whose
  last owned entry stops the forward on every stage but the last (its output is the hidden state
  sent to the next stage);
- on every stage but the first, the first owned block gets the hidden state received from the
  previous stage instead of what the model computed, and the modules with parameters that run
  before the trunk (embeddings) are replaced by stand-ins that return that hidden state, detached
  (the code around them still runs, but its result is dropped);
- so everything else the blocks receive — rotary position embeddings, position ids, attention
  masks, per-layer mask choices — is recomputed on each stage by the model's code from the
  batch's inputs, which every stage gets (``stage_inputs=``, torch's schedules pass keyword
  arguments to every stage). Only the hidden state crosses a stage boundary: one activation
  forward and its gradient backward per microbatch, as for a plain ``Sequential``.

Parameter ownership keeps the original names: modules with parameters registered before the
trunk (at each level of the path down to it) belong to the first stage, those registered after it
to the last stage, the blocks to their stage; modules without parameters (rotary embeddings,
dropout) and all buffers are shared by every stage. A module registered after the trunk but called
before it would be missing on the first stage; that is reported by name when it is called.

What a model must look like: its blocks return the hidden state (a tensor, or a tuple whose first
element it is) and take it as their first positional argument or as ``hidden_states=``; anything
else a block needs is computed from the inputs in the model's ``forward`` and must not depend on
parameters (it is recomputed without gradient on later stages); the last stage's output is the
model's output, or its ``logits`` (Hugging Face ``ModelOutput``), or its first element.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Mapping

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.replay import replay_reset_parameters


class _StageDone(Exception):
    """Raised by the stage's last block to stop the model's forward there."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("stage done")
        self.hidden = hidden


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
                hint="build the model on the meta device (shardwise.parallel.init.parallelize_on_meta) "
                "to initialize stages",
            )
        if callable(getattr(model, "init_weights", None)):
            model.init_weights(seed)
        else:
            replay_reset_parameters(model, seed=seed)


class SequentialStage(_StageInit, nn.Sequential):
    """A stage of an ``nn.Sequential`` (or :class:`PipelineStages`) model: its units, names kept."""


# -- the pieces of a forward view ------------------------------------------------------------------
def _shell(module: nn.Module) -> nn.Module:
    """``module``'s class and plain attributes without its modules, tensors or hooks."""
    shell = copy.copy(module)
    shell.__dict__ = {k: (type(v)() if "hooks" in k and isinstance(v, dict) else v) for k, v in module.__dict__.items()}
    shell.__dict__.update(_modules={}, _parameters={}, _buffers={})
    return shell


def _hidden_of(out: Any, where: str) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ConfigError(
        f"pipeline block {where} returned {type(out).__name__}; a stage boundary needs the hidden state tensor",
        hint="make the blocks return the hidden state (or a tuple starting with it), or use pp=1",
    )


def output_tensor(out: Any) -> torch.Tensor:
    """The tensor a last stage returns: the output itself, its ``logits``, or its first element."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, Mapping) and out:
        out = list(out.values())
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ConfigError(f"the model returned {type(out).__name__}; the last pipeline stage needs a tensor for the loss",
                      hint="return the logits (a tensor, a ModelOutput with .logits, or a tuple starting with them)")


class _Skip(nn.Module):
    """A block owned by an earlier stage: runs nothing; its output is never used."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()), None)


class _Run(nn.Module):
    """One of this stage's blocks, optionally fed the received hidden state, optionally the last."""

    def __init__(self, block: nn.Module, name: str, *, received: torch.Tensor | None, last: bool) -> None:
        super().__init__()
        self.block, self._name, self._received, self._last = block, name, received, last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._received is not None:
            if args:
                args = (self._received, *args[1:])
            elif "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": self._received}
            else:
                raise ConfigError(f"pipeline block {self._name} got no positional hidden state and no hidden_states=",
                                  hint="pass the hidden state to each block positionally, or use pp=1")
        out = self.block(*args, **kwargs)
        if self._last:
            raise _StageDone(_hidden_of(out, self._name))
        return out


class _Echo(nn.Module):
    """Stands in for an embedding on a later stage: returns the received hidden state, detached."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self._value = value

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._value


class _Missing(nn.Module):
    def __init__(self, name: str, trunk: str) -> None:
        super().__init__()
        self._name, self._trunk = name, trunk

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"{self._name} is registered after the trunk {self._trunk!r} but the model calls it before the trunk's "
            "end; the pipeline gives it to the last stage only",
            hint="register it before the trunk in __init__, or pass explicit stages with shardwise.PipelineStages",
        )


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


class TrunkStage(_StageInit, nn.Module):
    """Stage ``[start, stop)`` of the trunk of ``model`` (see the module doc).

    ``forward(*inputs, **model_kwargs)`` on the first stage; ``forward(hidden, stage_inputs=inputs,
    **model_kwargs)`` on the others (the inputs of the same microbatch, from which the model
    recomputes what its blocks need).
    """

    def __init__(self, model: nn.Module, trunk: Any, start: int, stop: int, *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self._trunk_name: str = trunk.name
        parts = trunk.name.split(".")
        self._levels: list[tuple[str, nn.Module, list[tuple[str, str]]]] = []  # (prefix, shell, [(child, kind)])
        self._owned: list[str] = []  # the input/output modules this stage holds, for summaries
        self._owned_inputs: list[str] = []
        self._foreign: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}  # the first stage's direct parameters
        units = trunk.units
        container: nn.Module = self
        for depth in range(len(parts)):
            prefix = ".".join(parts[:depth])
            original = model.get_submodule(prefix) if prefix else model
            below = parts[depth]
            names = list(original._modules)
            kinds: list[tuple[str, str]] = []
            for name in names:
                child = original._modules[name]
                if child is None:
                    continue
                if name == below:
                    kind = "trunk" if depth == len(parts) - 1 else "path"
                elif not _has_params(child):
                    kind = "shared"
                else:
                    kind = "input" if names.index(name) < names.index(below) else "output"
                kinds.append((name, kind))
                if kind == "path":
                    container.add_module(name, nn.Module())
                elif kind == "trunk":  # held under the original indices (``layers.3``)
                    container.add_module(name, nn.Sequential(OrderedDict(units[start:stop])))
                elif kind == "shared" or (kind == "input" and is_first) or (kind == "output" and is_last):
                    container.add_module(name, child)
                    if kind != "shared":
                        self._owned.append(f"{prefix}.{name}" if prefix else name)
                        if kind == "input":
                            self._owned_inputs.append(self._owned[-1])
            # Parameters held directly by the model (or a module on the way to the trunk) belong
            # to the first stage; buffers are shared by every stage.
            own = {name: p for name, p in original._parameters.items() if p is not None}
            if is_first:
                for name, p in own.items():
                    container.register_parameter(name, p)
            else:
                self._foreign[prefix] = {name: (p.shape, p.dtype) for name, p in own.items()}
            for name, b in original._buffers.items():
                if b is not None:
                    container.register_buffer(name, b, persistent=name not in original._non_persistent_buffers_set)
            self._levels.append((prefix, _shell(original), kinds))
            if depth < len(parts) - 1:
                container = container._modules[below]
        object.__setattr__(
            self, "_trunk_shell_is_sequential", isinstance(model.get_submodule(trunk.name), nn.Sequential)
        )
        self._range, self._count = (start, stop), len(units)
        self._unit_names = tuple(n for n, _ in units)
        self._keep_full_model(model)

    # -- the view -----------------------------------------------------------------------------
    def _trunk_view(self, blocks: nn.Module, received: torch.Tensor | None) -> nn.Module:
        start, stop = self._range
        owned = list(blocks._modules.values())
        entries: list[nn.Module] = [_Skip() for _ in range(start)]
        for i, block in enumerate(owned):
            name = f"{self._trunk_name}.{self._unit_names[start + i]}"
            entries.append(_Run(block, name, received=received if i == 0 and not self.is_first else None,
                                last=i == len(owned) - 1 and not self.is_last))
        return nn.Sequential(*entries) if self._trunk_shell_is_sequential else nn.ModuleList(entries)

    def _view(self, depth: int, received: torch.Tensor | None, device: torch.device) -> nn.Module:
        prefix, shell, kinds = self._levels[depth]
        held = self.get_submodule(prefix) if prefix else self
        view = copy.copy(shell)
        view.__dict__ = dict(shell.__dict__)
        modules: dict[str, nn.Module] = {}
        for name, kind in kinds:
            if kind == "path":
                modules[name] = self._view(depth + 1, received, device)
            elif kind == "trunk":
                modules[name] = self._trunk_view(held._modules[name], received)
            elif kind == "shared" or (kind == "input" and self.is_first) or (kind == "output" and self.is_last):
                modules[name] = held._modules[name]
            elif kind == "input":
                assert received is not None
                modules[name] = _Echo(received.detach())
            else:
                modules[name] = _Missing(f"{prefix + '.' if prefix else ''}{name}", self._trunk_name)
        view.__dict__.update(_modules=modules, _buffers=dict(held._buffers))
        if self.is_first:
            view.__dict__["_parameters"] = dict(held._parameters)
        else:  # the first stage owns them; their use before the trunk is dropped here
            view.__dict__["_parameters"] = {n: torch.zeros(shape, dtype=dtype, device=device)
                                            for n, (shape, dtype) in self._foreign.get(prefix, {}).items()}
        return view

    def forward(self, *args: Any, stage_inputs: Any = None, **model_kwargs: Any) -> torch.Tensor:
        """``model_kwargs`` (context parallel's ``position_ids``) reach the model's own forward on
        every stage, like the inputs."""
        if self.is_first:
            inputs, received = args, None
        else:
            if stage_inputs is None:
                raise ConfigError(
                    f"pipeline stage with blocks {self._range[0]}..{self._range[1] - 1} needs the batch's inputs",
                    hint="call it as stage(hidden, stage_inputs=inputs) (the pipeline schedule does)",
                )
            received = args[0]
            inputs = stage_inputs if isinstance(stage_inputs, tuple) else (stage_inputs,)
        device = (
            received.device
            if received is not None
            else next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
        )
        root = self._view(0, received, device)
        try:
            out = root.forward(*inputs, **model_kwargs)
        except _StageDone as done:
            return done.hidden
        if not self.is_last:
            raise ConfigError(
                f"{type(root).__name__}.forward returned before its block "
                f"{self._trunk_name}.{self._unit_names[self._range[1] - 1]}",
                hint="pass explicit stages with shardwise.PipelineStages(...)",
            )
        return output_tensor(out)
