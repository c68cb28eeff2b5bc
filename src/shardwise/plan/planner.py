"""The planner's front door: model source -> statistics, and ``auto_plan`` for a world size.

``auto_plan(model_or_spec, world_size=4, cluster="cpu", global_batch=32)`` returns the fastest plan
that fits, with its :class:`~shardwise.plan.cost.Estimate`. It is the one entry point of
auto-planning: ``Trainer(plan="auto")`` (:mod:`shardwise.auto`) and ``shardwise plan`` call it.
Torch-free, like the rest of :mod:`shardwise.plan`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from shardwise.errors import ConfigError
from shardwise.exports import renamed
from shardwise.layout import Plan
from shardwise.plan.cluster import ClusterSpec, resolve
from shardwise.plan.cost import Estimate
from shardwise.plan.search import SearchOptions, SearchResult, search
from shardwise.plan.stats import ModelStats, TransformerShape, preset, transformer_stats


GATED = ("gated_mlp", "swiglu")  # planner-only spec keys: a SwiGLU MLP (Llama's gate, up and down projections)
__getattr__ = renamed(__name__, {"AutoPlan": "AutoChoice"})  # the old name, deprecated


def spec_from_text(text: str) -> tuple[TransformerShape, bool]:
    """``--model-spec``: inline JSON or the path of a JSON file -> (shape, gated MLP). The planner
    also reads ``"gated_mlp": true`` (or ``"mlp": "swiglu"``), which the shape itself does not carry."""
    if not text.lstrip().startswith("{") and os.path.exists(text):
        if os.path.isdir(text):
            raise ConfigError(
                f"--model-spec {text!r} is a directory", hint="give inline JSON or the path of a JSON file"
            )
        with open(text) as fh:
            text = fh.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return TransformerShape.from_json(text), False  # the shape's own one-line error
    if not isinstance(data, dict):
        return TransformerShape.from_json(text), False
    gated = bool(data.pop("gated_mlp", False)) or str(data.pop("mlp", "")).lower() in GATED
    for key in GATED[1:]:
        gated = bool(data.pop(key, False)) or gated
    return TransformerShape.from_dict(data), gated


def stats_of(model_or_spec: Any, *, seq: int | None = None) -> ModelStats:
    """Statistics of a ModelStats, TransformerShape, spec dict or JSON text, preset name, or a model
    that carries its shape as ``.config`` (the built-in GPT). Any other ``nn.Module`` is measured
    on the meta device by :func:`shardwise.auto.measure.module_stats` (torch lives there)."""
    if isinstance(model_or_spec, ModelStats):
        return model_or_spec
    if isinstance(model_or_spec, TransformerShape):
        return transformer_stats(model_or_spec, seq=seq)
    if isinstance(model_or_spec, dict):
        return transformer_stats(TransformerShape.from_dict(model_or_spec), seq=seq)
    if isinstance(model_or_spec, str):
        if model_or_spec.lstrip().startswith("{"):
            return transformer_stats(TransformerShape.from_json(model_or_spec), seq=seq)
        return transformer_stats(preset(model_or_spec), seq=seq)
    config = getattr(model_or_spec, "config", None)
    if isinstance(config, TransformerShape):
        return transformer_stats(config, seq=seq)
    raise ConfigError(f"the planner cannot read the shape of a {type(model_or_spec).__name__}",
                      hint="pass its statistics: shardwise.auto.measure.module_stats(model, seq=...)")


def cluster_of(cluster: ClusterSpec | str, *, world_size: int, devices_per_node: int | None = None) -> ClusterSpec:
    if isinstance(cluster, ClusterSpec):
        return cluster.with_devices(world_size, devices_per_node or min(cluster.devices_per_node, world_size))
    return resolve(cluster, devices=world_size, devices_per_node=devices_per_node)


@dataclass(frozen=True)
class AutoChoice:
    """The planner's choice for ``plan="auto"``: the plan, its prediction, the ranked search it won,
    and (after certification) the parity certificate."""

    plan: Plan
    estimate: Estimate
    result: SearchResult
    certificate: dict[str, Any] | None = None  # Trainer(plan="auto"): the parity certificate (shardwise.auto.certify)

    def summary(self) -> str:
        e = self.estimate
        return (f"auto plan: {self.plan}  (predicted {e.step_time_s * 1e3:.1f} ms/step, "
                f"{e.memory_total / 2**30:.2f} GiB/device, MFU {100 * e.mfu:.1f}%)\n  why: {self.result.explanation}")

    def certified(self, plan: Plan, certificate: dict[str, Any]) -> AutoChoice:
        """This choice after certification: ``plan`` (one of the ranked plans: the first that
        passed) with its own prediction, and the certificate."""
        estimate = next((e for e in self.result.plans if e.plan == plan), self.estimate)
        return AutoChoice(plan=estimate.plan, estimate=estimate, result=self.result, certificate=certificate)

    def to_json(self) -> str:
        out: dict[str, Any] = {"plan": self.plan.to_dict(), "prediction": self.estimate.to_json(),
                               "explanation": self.result.explanation}
        if self.certificate is not None:
            out["certificate"] = self.certificate
        return json.dumps(out, indent=2)

    def save(self, path: str) -> None:
        """Write the chosen plan with its predictions (what a run directory keeps as auto_plan.json)."""
        with open(path, "w") as fh:
            fh.write(self.to_json() + "\n")


def auto_plan(model_or_spec: Any, *, world_size: int, cluster: ClusterSpec | str = "cpu", global_batch: int,
              seq: int | None = None, precision: str | None = None, devices_per_node: int | None = None,
              options: SearchOptions | None = None) -> AutoChoice:
    """The fastest plan that fits ``world_size`` devices of ``cluster`` (raises ConfigError if none).

    The search turns on shardwise's runtime options where they help (``params16``, ``chunked_loss``,
    ``sharded_accumulation``; :mod:`shardwise.plan.options`). Without a ``precision`` (and without
    ``options``) a device with FP8 tensor cores (:attr:`ClusterSpec.fp8_capable`: H100, H200, H800)
    is searched in bf16 and in ``precision="fp8"`` (torchao's float8 linears), a CPU in fp32, any
    other GPU in bf16."""
    spec = cluster_of(cluster, world_size=world_size, devices_per_node=devices_per_node)
    stats = stats_of(model_or_spec, seq=seq)
    default = "fp32" if spec.device_type == "cpu" else "bf16"
    opts = options or SearchOptions(precision=precision or default,
                                    precisions=("bf16", "fp8") if precision is None and spec.fp8_capable else ())
    if precision and options is not None:
        opts = SearchOptions(**{**opts.__dict__, "precision": precision, "precisions": ()})
    result = search(stats, spec, global_batch=global_batch, options=opts)
    best = result.best
    return AutoChoice(plan=best.plan, estimate=best, result=result)


def cluster_for_device(
    device_type: str, *, world_size: int, device_name: str = "", memory_bytes: float | None = None
) -> ClusterSpec:
    """A preset for the device this process runs on: the H100/H200/A100 presets by name, else the
    generic ``cpu`` preset (or ``h100`` figures with the device's own memory for other GPUs)."""
    name = device_name.lower()
    if device_type != "cuda":
        key = "cpu"
    elif "h200" in name:
        key = "h200"
    elif "h100" in name:
        key = "h100"
    elif "a100" in name:
        key = "a100-80gb" if (memory_bytes or 80e9) > 50e9 else "a100-40gb"
    else:
        key = "h100"
    spec = resolve(key, devices=world_size, devices_per_node=world_size if device_type != "cuda" else None)
    if memory_bytes and device_type == "cuda":
        from dataclasses import replace

        spec = replace(spec, memory_bytes=float(memory_bytes))
    return spec
