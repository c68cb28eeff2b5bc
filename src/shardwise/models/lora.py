"""LoRA adapters (Hu et al. 2021) from ``peft``: the spec, the family defaults, adding them, and
what is an adapter.

A LoRA layer replaces ``y = W x`` (``W`` frozen, ``out x in``) by ``y = W x + (alpha / r) B A x``
with ``A`` (``r x in``) and ``B`` (``out x r``) trained. ``peft`` builds the layers: a targeted
``q_proj`` becomes a ``peft.tuners.lora.Linear`` holding ``q_proj.base_layer`` (the original
layer), ``q_proj.lora_A.default`` and ``q_proj.lora_B.default``. shardwise never re-implements
them; it only decides where they go (:mod:`shardwise.parallel.tp.adapters` for tensor parallel,
:mod:`shardwise.checkpoint.adapters` for checkpoints).

- :class:`LoRA`: the shardwise spec (``r``, ``alpha``, ``dropout``, ``targets``, ``base``) that
  the CLI's ``--lora.*`` keys fill; :meth:`LoRA.peft_config` turns it into ``peft.LoraConfig``.
  Without ``targets`` the family's attention and MLP projections are taken (:data:`FAMILY_TARGETS`).
- :func:`check_targets`: a target name that matches no layer is one line naming the layers it could
  have meant.
- :func:`add_adapters`: ``get_peft_model`` after ``torch.manual_seed(seed)``. On a model whose
  parameters are on the meta device (a :class:`~shardwise.checkpoint.hf_load.Pretrained` directory
  built before any rank reads its slices) ``peft`` would put the adapters on meta too and their
  initial values would be lost; during the call the targeted layers' weights are therefore
  zero-memory CPU stand-ins (one element expanded to the weight's shape), so the adapters are real,
  small CPU tensors equal to those one process gets from ``get_peft_model`` on the real model
  after the same seed.
- :func:`adapter_names`, :func:`is_lora_layer`, :func:`base_key`: which parameters are adapters,
  and the name a base parameter has in the original model's files
  (``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
  ``model.layers.0.self_attn.q_proj.weight``).

``peft`` is the optional extra ``shardwise[lora]``; this module imports it inside its functions only.
"""

from __future__ import annotations

import contextlib
import difflib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from shardwise.errors import ConfigError

# The attention and MLP projections of each family (the LoRA paper's and QLoRA's "all linear layers"
# of a block). Mixtral's experts are 3-D tensors that peft's LoRA layers do not wrap: attention only.
FAMILY_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "mistral": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qwen2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gemma": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "phi": ("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}
BASES = ("fp32", "nf4")
ADAPTER = "default"  # peft's adapter name


def require_peft() -> Any:
    """The ``peft`` module, or a ConfigError saying how to install it."""
    try:
        with quiet_torchao():
            import peft
    except ImportError:
        raise ConfigError("LoRA adapters need the 'peft' package", hint="pip install 'shardwise[lora]'") from None
    return peft


@contextlib.contextmanager
def quiet_torchao() -> Iterator[None]:
    """Importing torchao (peft does when it is installed) logs its optional GPU kernels failing to load
    on a CPU machine and a torch deprecation notice per enum: warnings about nothing this run uses."""
    import logging

    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@dataclass(frozen=True)
class LoRA:
    """What adapters to add: rank ``r``, scale ``alpha / r``, ``dropout`` on the adapter's input,
    the ``targets`` (leaf module names; None: the family's defaults) and how the frozen ``base`` is
    stored (``fp32``, or ``nf4``: QLoRA, 4-bit NormalFloat from torchao, :mod:`shardwise.models.nf4`).
    ``init_b_zero=False`` draws ``B`` at random too (the adapted model then differs from the base
    from the first step: for tests that must see the adapters' effect at once)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None
    base: str = "fp32"
    init_b_zero: bool = True

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ConfigError(f"lora.r={self.r} must be at least 1", hint="for example --lora.r 16")
        if self.alpha <= 0:
            raise ConfigError(f"lora.alpha={self.alpha} must be positive", hint="for example --lora.alpha 32 (twice r)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)", hint="for example --lora.dropout 0.05")
        if self.base not in BASES:
            raise ConfigError(f"lora.base={self.base!r} is unknown", hint=f"use one of {', '.join(BASES)}")
        if self.targets is not None and not self.targets:
            raise ConfigError(
                "lora.targets is empty", hint="name the layers, e.g. --lora.targets q_proj,v_proj, or omit it"
            )

    def targets_for(self, model: nn.Module) -> tuple[str, ...]:
        """``targets``, or the defaults of the model's family (``model.config.model_type``)."""
        if self.targets is not None:
            return self.targets
        family = str(getattr(getattr(model, "config", None), "model_type", "") or "")
        if family in FAMILY_TARGETS:
            return FAMILY_TARGETS[family]
        names = linear_names(model)
        raise ConfigError(f"no default LoRA targets for {family or type(model).__name__}",
                          hint=f"name them with lora.targets (its linear layers: {', '.join(names[:12]) or 'none'})")

    def peft_config(self, model: nn.Module) -> Any:
        """The ``peft.LoraConfig`` of this spec for ``model`` (targets checked first)."""
        targets = self.targets_for(model)
        check_targets(model, targets)
        peft = require_peft()
        return peft.LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(targets),
                               init_lora_weights=True if self.init_b_zero else False, bias="none")

    def to_dict(self) -> dict[str, Any]:
        return {
            "r": self.r,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets) if self.targets else None,
            "base": self.base,
            "init_b_zero": self.init_b_zero,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoRA:
        targets = data.get("targets")
        return cls(
            r=int(data.get("r", 16)),
            alpha=float(data.get("alpha", 32.0)),
            dropout=float(data.get("dropout", 0.0)),
            targets=tuple(targets) if targets else None,
            base=str(data.get("base", "fp32")),
            init_b_zero=bool(data.get("init_b_zero", True)),
        )


def _adaptable(module: nn.Module) -> bool:
    """A layer peft's LoRA wraps: Linear, Embedding, or GPT-2's Conv1D (by name: no transformers import)."""
    return isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ == "Conv1D"


def linear_names(model: nn.Module) -> list[str]:
    """The distinct leaf names of the layers LoRA can target, in model order."""
    seen: dict[str, None] = {}
    for name, module in model.named_modules():
        if name and _adaptable(module) and not is_adapter_module(name):
            seen.setdefault(name.rsplit(".", 1)[-1], None)
    return list(seen)


def check_targets(model: nn.Module, targets: tuple[str, ...] | list[str]) -> None:
    """Raise one line for a target that names no adaptable layer, with the names it could have meant."""
    names = linear_names(model)
    for target in targets:
        if target not in names and not any(n.endswith("." + target) for n, _ in model.named_modules()):
            close = difflib.get_close_matches(target, names, n=3, cutoff=0.5)
            meant = f"did you mean {' or '.join(close)}? " if close else ""
            raise ConfigError(f"LoRA target {target!r} matches no layer of {type(model).__name__}",
                              hint=f"{meant}its layers: {', '.join(names)}")


def is_adapter_module(name: str) -> bool:
    """Whether a module or parameter name lies inside an adapter (``...lora_A.default.weight``)."""
    return any(atom.startswith("lora_") for atom in name.split("."))


def is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA layer: a ``base_layer`` with ``lora_A`` / ``lora_B`` module dicts."""
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and isinstance(
        getattr(module, "lora_B", None), nn.ModuleDict)


def see_through(module: nn.Module) -> nn.Module:
    """The layer a LoRA layer wraps (the module itself otherwise): what TP derivation looks at."""
    return module.base_layer if is_lora_layer(module) else module


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` (possibly wrapped) holds peft LoRA layers."""
    return any(is_lora_layer(m) for m in model.modules())


def adapter_names(model: nn.Module) -> list[str]:
    """The names of the model's trainable adapter parameters."""
    return [n for n, p in model.named_parameters() if is_adapter_module(n)]


def base_key(name: str) -> str:
    """The name a parameter of the wrapped model has in the original model (module doc)."""
    name = name.removeprefix("module.").removeprefix("base_model.model.")
    return ".".join(atom for atom in name.split(".") if atom != "base_layer")


def peft_model_of(model: nn.Module) -> nn.Module | None:
    """The ``peft.PeftModel`` inside ``model`` (itself, or under wrappers), if any."""
    for module in model.modules():
        if hasattr(module, "peft_config") and hasattr(module, "base_model"):
            return module
    return None


@contextlib.contextmanager
def _cpu_stand_ins(model: nn.Module) -> Iterator[None]:
    """Meta weights of adaptable layers as zero-memory CPU tensors for the duration (module doc)."""
    swapped: list[tuple[nn.Module, nn.Parameter]] = []
    for module in model.modules():
        weight = module._parameters.get("weight") if _adaptable(module) else None
        if weight is not None and weight.is_meta:
            stand_in = torch.zeros((), dtype=weight.dtype).expand(weight.shape)
            module._parameters["weight"] = nn.Parameter(stand_in, requires_grad=weight.requires_grad)
            swapped.append((module, weight))
    try:
        yield
    finally:
        for module, weight in swapped:
            weight.requires_grad_(module._parameters["weight"].requires_grad)  # peft froze the base
            module._parameters["weight"] = weight


def add_adapters(model: nn.Module, lora: LoRA | Any, *, seed: int = 0) -> nn.Module:
    """``peft.get_peft_model(model, config)`` after ``torch.manual_seed(seed)``; ``lora`` is a
    :class:`LoRA` or a ``peft.LoraConfig``. Works on a meta model too (module doc)."""
    peft = require_peft()
    config = lora.peft_config(model) if isinstance(lora, LoRA) else lora
    if (
        not isinstance(lora, LoRA)
        and getattr(config, "target_modules", None)
        and not isinstance(config.target_modules, str)
    ):
        check_targets(model, list(config.target_modules))
    meta = any(p.is_meta for p in model.parameters())
    torch.manual_seed(seed)
    with _cpu_stand_ins(model) if meta else contextlib.nullcontext():
        peft_model = peft.get_peft_model(model, config)
    return peft_model
