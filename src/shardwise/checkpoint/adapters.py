"""Adapter checkpoints: what a LoRA run saves, and the frozen base it must be resumed against.

A model with peft LoRA layers checkpoints only its trainable parameters (the adapters), their
optimizer state and the training state; the frozen base is not written (``StateDictOptions(
ignore_frozen_params=True)`` for every ``get_state_dict``/``set_state_dict`` of the
:class:`~shardwise.checkpoint.manager.CheckpointManager`). The adapters are saved like any
parameter: sharded DTensors through DCP (each rank writes its own shards, the save is atomic and
reshards on load), so a LoRA run saved under ``zero=3,tp=2`` on 4 ranks loads on 2 or on 1.

The base is referenced instead (:class:`BaseReference`, in every rank's small file):

- a Hugging Face directory (``Pretrained(dir, lora=...)``): its path and the SHA-256 of its
  ``*.safetensors`` files (read in 1 MiB blocks, once per process);
- a user's own model: the names and shapes of its frozen parameters and a float64 sum of each
  one's absolute values (gathered over the world, so pipeline stages see every name; compared
  with a relative tolerance of 1e-6, since the order of summation differs between layouts).

A resume against a different base is refused with one line, before any tensor is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

from shardwise.errors import ConfigError
from shardwise.models.lora import has_adapters, peft_model_of

ADAPTER_DIR = "adapter"  # inside a checkpoint directory: adapter_config.json, base.json


def lora_of(model: Any) -> tuple[str | None, dict[str, Any]] | None:
    """``(base directory, LoraConfig as a dict)`` of a LoRA run's model: a ``Pretrained`` directory
    with ``lora`` (its config dict is known once the meta model is built: empty here), or a peft
    model built in Python (no directory); None for a model without adapters."""
    lora = getattr(model, "lora", None)
    if isinstance(getattr(model, "path", None), str) and lora is not None:
        return os.path.abspath(model.path), {}
    if isinstance(model, nn.Module) and has_adapters(model):
        peft_model = peft_model_of(model)
        config = peft_model.peft_config.get("default") if peft_model is not None else None
        return None, (config.to_dict() if config is not None else {})
    return None


def state_options(model: nn.Module | None, *, loading: bool = False) -> StateDictOptions | None:
    """Adapter-only state dicts for a model with LoRA layers, torch's defaults otherwise. Loading
    is not strict there (the frozen base is absent on purpose); the manager has compared every
    saved name and shape with the model's before it loads."""
    if model is not None and has_adapters(model):
        return StateDictOptions(ignore_frozen_params=True, strict=not loading)
    return None


@lru_cache(maxsize=8)
def files_checksum(directory: str) -> str:
    """SHA-256 over a model directory's ``*.safetensors`` files (names and bytes, sorted by name)."""
    digest = hashlib.sha256()
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    for name in names:
        digest.update(name.encode())
        with open(os.path.join(directory, name), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def frozen_fingerprint(model: nn.Module) -> dict[str, list[float]]:
    """``{name: [numel, sum |w|]}`` of every frozen parameter, over the world (module doc)."""
    local: dict[str, list[float]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        name = name.removeprefix("module.")
        if isinstance(p, DTensor):
            value = p.to_local()
            if type(value) is not torch.Tensor:  # a quantized base: its size only
                local[name] = [float(p.numel()), 0.0]
                continue
            total = p.detach().abs().to(torch.float64).sum().full_tensor()
        elif type(p.data) is torch.Tensor:
            total = p.detach().abs().to(torch.float64).sum()
        else:
            local[name] = [float(p.numel()), 0.0]
            continue
        local[name] = [float(p.numel()), float(total)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        for part in everyone:
            local.update(part)
    return dict(sorted(local.items()))


@dataclass
class BaseReference:
    """The frozen base of a LoRA run, saved with every checkpoint (module doc); ``lora``: the
    adapters' peft config (``LoraConfig.to_dict()``) for exports."""

    model: nn.Module
    path: str | None = None
    lora: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        if self.path is not None:
            return {"path": os.path.abspath(self.path), "sha256": files_checksum(os.path.abspath(self.path))}
        return {"path": None, "fingerprint": frozen_fingerprint(self.model)}

    def state_dict(self) -> dict[str, Any]:
        return {**self.describe(), "lora": json.dumps(self.lora, default=_jsonable)}

    def check(self, saved: dict[str, Any] | None, *, where: str) -> None:
        """Refuse a checkpoint of adapters trained on another base (one line)."""
        if saved is None:
            raise ConfigError(f"checkpoint {where} holds no adapter base reference (it was not a LoRA run)",
                              hint="resume a LoRA run's checkpoint, or train without adapters")
        now = self.describe()
        if "sha256" in saved or "sha256" in now:
            if saved.get("sha256") != now.get("sha256"):
                raise ConfigError(
                    f"checkpoint {where} holds adapters trained on the base {saved.get('path')} "
                    f"(sha256 {str(saved.get('sha256'))[:12]}), not on {now.get('path')} "
                    f"(sha256 {str(now.get('sha256'))[:12]})",
                    hint="resume with the base model the adapters were trained on",
                )
            return
        mismatch = _fingerprint_mismatch(saved.get("fingerprint") or {}, now.get("fingerprint") or {})
        if mismatch:
            raise ConfigError(f"checkpoint {where} holds adapters trained on another base model: {mismatch}",
                              hint="resume with the base model the adapters were trained on")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check(state, where="(resumed)")


def _fingerprint_mismatch(saved: dict[str, list[float]], now: dict[str, list[float]]) -> str | None:
    if set(saved) != set(now):
        extra = sorted(set(saved) ^ set(now))
        return f"frozen parameter {extra[0]!r} is in only one of them"
    for name, (numel, total) in now.items():
        s_numel, s_total = saved[name]
        if s_numel != numel or abs(s_total - total) > 1e-6 * max(abs(s_total), abs(total), 1e-30):
            return f"frozen parameter {name!r} differs (sum |w| {s_total:.6g} saved, {total:.6g} now)"
    return None


def _jsonable(value: Any) -> Any:
    """JSON for the parts of a ``LoraConfig`` dict that are not: sets (sorted), enums (their value)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return getattr(value, "value", str(value))
