"""The planner's front door: model source -> statistics, and ``auto_plan`` for the current world.

``auto_plan(model_or_spec, world_size=4, cluster="cpu", global_batch=32)`` returns the fastest plan
that fits, with its :class:`~shardwise.plan.cost.Estimate`; ``Plan.auto`` and
``Trainer(plan="auto")`` call it.
"""

from __future__ import annotations

import json
import os
import runpy
from dataclasses import dataclass
from typing import Any

from shardwise.errors import ConfigError
from shardwise.plan.cluster import ClusterSpec, resolve
from shardwise.plan.cost import Estimate
from shardwise.plan.plan import Plan
from shardwise.plan.search import SearchOptions, SearchResult, search
from shardwise.plan.stats import ModelStats, TransformerSpec, measure_module, preset, spec_from_gpt_config


def builtin_gpt_stats(*, seq: int | None = None, **overrides: Any) -> ModelStats:
    """Statistics of shardwise's built-in GPT (its default size unless overridden)."""
    try:
        from shardwise.models.gpt import GPTConfig
    except ImportError:  # the model package is optional for dry runs
        return preset("gpt").stats(seq=seq)
    return spec_from_gpt_config(GPTConfig(**overrides)).stats(seq=seq)


def spec_from_text(text: str) -> TransformerSpec:
    """``--model-spec``: inline JSON or the path of a JSON file."""
    if not text.lstrip().startswith("{") and os.path.exists(text):
        with open(text) as fh:
            text = fh.read()
    return TransformerSpec.from_json(text)


def stats_from_script(path: str, *, seq: int | None = None) -> ModelStats:
    """``--script file.py``: the file defines ``MODEL_SPEC`` (a dict), or ``build_model()`` and
    ``example_input(device)`` (one sample's input), measured on the meta device."""
    if not os.path.exists(path):
        raise ConfigError(f"--script {path!r} does not exist", hint="give the path of a Python file")
    namespace = runpy.run_path(path, run_name="shardwise_plan")
    if "MODEL_SPEC" in namespace:
        return TransformerSpec.from_dict(dict(namespace["MODEL_SPEC"]), name=os.path.basename(path)).stats(seq=seq)
    if "build_model" not in namespace or "example_input" not in namespace:
        raise ConfigError(f"--script {path} defines neither MODEL_SPEC nor build_model() + example_input(device)",
                          hint="add MODEL_SPEC = {...} or both functions")
    return measure_module(namespace["build_model"], namespace["example_input"], seq=seq or int(namespace.get("SEQ", 1)),
                          name=os.path.basename(path))


def stats_of(model_or_spec: Any, *, seq: int | None = None) -> ModelStats:
    """Statistics of a ModelStats, TransformerSpec, spec dict/JSON text, preset name or nn.Module."""
    if isinstance(model_or_spec, ModelStats):
        return model_or_spec
    if isinstance(model_or_spec, TransformerSpec):
        return model_or_spec.stats(seq=seq)
    if isinstance(model_or_spec, dict):
        return TransformerSpec.from_dict(model_or_spec).stats(seq=seq)
    if isinstance(model_or_spec, str):
        if model_or_spec.lstrip().startswith("{"):
            return TransformerSpec.from_json(model_or_spec).stats(seq=seq)
        return builtin_gpt_stats(seq=seq) if model_or_spec == "gpt" else preset(model_or_spec).stats(seq=seq)
    config = getattr(model_or_spec, "config", None)
    if config is not None and all(hasattr(config, k) for k in ("layers", "hidden", "heads", "vocab_size", "seq_len")):
        return spec_from_gpt_config(config).stats(seq=seq)
    return _measure_instance(model_or_spec, seq=seq)


def _measure_instance(model: Any, *, seq: int | None) -> ModelStats:
    """A live nn.Module: count on a meta-device copy (the module itself is not run)."""
    import copy

    import torch

    if seq is None:
        raise ConfigError("planning an arbitrary nn.Module needs seq= (the input length per sample; 1 for non-sequence inputs)")
    meta = copy.deepcopy(model).to("meta")
    first = next(meta.parameters(), None)
    is_tokens = isinstance(getattr(meta, "tok_emb", None) or first, torch.nn.Embedding)

    def example(device: str) -> torch.Tensor:
        if is_tokens:
            return torch.zeros(1, seq, dtype=torch.long, device=device)
        in_features = getattr(first, "shape", (1, 1))[-1]
        return torch.zeros(1, in_features, device=device)

    return measure_module(lambda: meta, example, seq=seq, name=type(model).__name__)


def cluster_of(cluster: ClusterSpec | str, *, world_size: int, devices_per_node: int | None = None) -> ClusterSpec:
    if isinstance(cluster, ClusterSpec):
        return cluster.with_devices(world_size, devices_per_node or min(cluster.devices_per_node, world_size))
    return resolve(cluster, devices=world_size, devices_per_node=devices_per_node)


@dataclass(frozen=True)
class AutoPlan:
    plan: Plan
    estimate: Estimate
    result: SearchResult

    def summary(self) -> str:
        e = self.estimate
        return (f"auto plan: {self.plan}  (predicted {e.step_time_s * 1e3:.1f} ms/step, "
                f"{e.memory_total / 2**30:.2f} GiB/device, MFU {100 * e.mfu:.1f}%)\n  why: {self.result.explanation}")

    def to_json(self) -> str:
        return json.dumps({"plan": self.plan.to_dict(), "prediction": self.estimate.to_json(),
                           "explanation": self.result.explanation}, indent=2)

    def save(self, path: str) -> None:
        """Write the chosen plan with its predictions (what a run directory keeps as auto_plan.json)."""
        with open(path, "w") as fh:
            fh.write(self.to_json() + "\n")


def auto_plan(model_or_spec: Any, *, world_size: int, cluster: ClusterSpec | str = "cpu", global_batch: int,
              seq: int | None = None, precision: str | None = None, devices_per_node: int | None = None,
              options: SearchOptions | None = None) -> AutoPlan:
    """The fastest plan that fits ``world_size`` devices of ``cluster`` (raises ConfigError if none)."""
    spec = cluster_of(cluster, world_size=world_size, devices_per_node=devices_per_node)
    stats = stats_of(model_or_spec, seq=seq)
    opts = options or SearchOptions(precision=precision or ("fp32" if spec.device_type == "cpu" else "bf16"))
    if precision and options is not None:
        opts = SearchOptions(**{**opts.__dict__, "precision": precision})
    result = search(stats, spec, global_batch=global_batch, options=opts)
    best = result.best
    return AutoPlan(plan=best.plan, estimate=best, result=result)


def cluster_for_device(device_type: str, *, world_size: int, device_name: str = "", memory_bytes: float | None = None) -> ClusterSpec:
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


def plan_for_trainer(model: Any, *, world_size: int, global_batch: int, precision: str = "fp32", device_type: str = "cpu",
                     device_name: str = "", memory_bytes: float | None = None, cluster: ClusterSpec | str | None = None,
                     pipeline: bool = False) -> AutoPlan:
    """``Trainer(plan="auto")``: the fastest plan for ``model`` on the current world that the
    parallel layer accepts (checked with :func:`shardwise.parallel.parallelize.validate`, no
    communication). The trainer accumulates gradients itself, so without pipelining the plan uses
    one microbatch per step; pass ``pipeline=True`` once the trainer drives pipeline schedules.
    The cluster is ``cluster``, else the spec named by the ``SHARDWISE_CLUSTER`` environment
    variable (a ``shardwise calibrate`` file or a preset name), else the device's preset."""
    from shardwise.parallel.parallelize import validate

    # A spec file from `shardwise calibrate` (or a preset name) named by SHARDWISE_CLUSTER replaces
    # the device's preset, so a trainer plans with this machine's measured figures.
    cluster = cluster if cluster is not None else (os.environ.get("SHARDWISE_CLUSTER") or None)
    spec = (cluster_of(cluster, world_size=world_size) if cluster is not None
            else cluster_for_device(device_type, world_size=world_size, device_name=device_name, memory_bytes=memory_bytes))

    def supported(plan: Plan) -> bool:
        if plan.pp > 1 and not pipeline:
            return False
        if plan.pp == 1 and plan.microbatches > 1:
            return False
        try:  # refuses e.g. zero=1 with tp or pp (ZeroRedundancyOptimizer over DTensor parameters)
            validate(model, plan)
        except ConfigError:
            return False
        return True

    options = SearchOptions(precision=precision, supported=supported, sequence_parallel=False)
    return auto_plan(model, world_size=world_size, cluster=spec, global_batch=global_batch, options=options)
