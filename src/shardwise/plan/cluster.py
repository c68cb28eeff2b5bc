"""What the planner knows about the hardware: :class:`ClusterSpec`, presets, JSON spec files.

Communication follows the alpha-beta model. A collective over ``n`` ranks moving ``B`` bytes takes::

    t = alpha * ceil(log2 n) + f(op, n) * B / busbw

with the nccl-tests bus factors ``f`` (all-reduce ``2(n-1)/n``, all-gather and reduce-scatter
``(n-1)/n``, point-to-point ``1``), so ``busbw`` is one number per link type whatever ``n``. A group
whose ranks all sit in one node uses the intra-node figures, any other group the inter-node ones
(the slowest link of a ring sets its speed).

Presets come from the vendors' published figures (dense, no sparsity); the achievable fractions
are typical measured values (large-GEMM efficiency, nccl-tests bus bandwidth over link peak).
``shardwise calibrate`` replaces them by this machine's measurements.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from shardwise.errors import ConfigError

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class ClusterSpec:
    """One homogeneous cluster. Bandwidths in bytes/s (bus bandwidth, per direction), times in s."""

    name: str
    devices: int
    devices_per_node: int
    memory_bytes: float
    peak_flops: dict[str, float]  # per device, by compute dtype: "fp32", "bf16", "fp16"
    achievable_fraction: float = 0.5  # of peak, for large matmuls in a real training step
    intra_bw: float = 100 * GB
    intra_latency_s: float = 10e-6
    inter_bw: float = 25 * GB
    inter_latency_s: float = 20e-6
    memory_bw: float = 1e12  # device memory bandwidth (the optimizer step is bound by it)
    overlap: float = 1.0  # fraction of data-parallel communication that can hide behind backward
    kernel_overhead_s: float = 5e-6  # fixed cost of one operator launch (eager PyTorch: Python + dispatch)
    dtensor_overhead_s: float = 20e-6  # extra cost of one DTensor operator (sharding propagation)
    # Measured fixed costs of parallel layers (``shardwise calibrate``; 0: estimate them from the
    # per-operator figures): per transformer layer forward + backward under tensor parallelism,
    # per FSDP unit and microbatch under ZeRO-3 / ZeRO-2 (hooks + collective latency), and per
    # microbatch slot of a pipeline schedule.
    tp_layer_overhead_s: float = 0.0
    zero3_unit_overhead_s: float = 0.0
    zero2_unit_overhead_s: float = 0.0
    pp_microbatch_overhead_s: float = 0.0  # per microbatch slot of a pipeline schedule (runtime + p2p latency)
    # The optimizer step (Adam, torch's default implementation for the device), measured: per
    # parameter tensor, per tensor when the parameters are DTensors (FSDP2, TP), per element.
    # 0: estimated from the memory bandwidth alone.
    optimizer_tensor_s: float = 0.0
    optimizer_dtensor_tensor_s: float = 0.0
    optimizer_param_s: float = 0.0
    oversubscription: float = 1.0  # processes per compute unit: a lone busy process runs this much faster
    device_type: str = "cuda"
    measurements: dict[str, Any] = field(default_factory=dict)  # raw calibration tables, if any

    def __post_init__(self) -> None:
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise ConfigError(f"cluster devices={self.devices!r} must be a positive integer", hint="e.g. --devices 8")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ConfigError(f"cluster devices_per_node={self.devices_per_node!r} must be a positive integer", hint="e.g. --devices-per-node 8")
        if self.devices % self.devices_per_node and self.devices > self.devices_per_node:
            raise ConfigError(f"cluster devices={self.devices} is not a multiple of devices_per_node={self.devices_per_node}",
                              hint="use whole nodes")
        if self.memory_bytes <= 0:
            raise ConfigError(f"cluster memory_bytes={self.memory_bytes} must be positive")
        for key in ("intra_bw", "inter_bw", "memory_bw"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"cluster {key}={getattr(self, key)} must be positive")
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ConfigError("cluster peak_flops must map dtypes to positive FLOP/s", hint='e.g. {"fp32": 1e12}')
        if self.oversubscription < 1:
            raise ConfigError(f"cluster oversubscription={self.oversubscription} must be >= 1", hint="1 when every process has its own device")
        if not 0 < self.achievable_fraction <= 1 or not 0 <= self.overlap <= 1:
            raise ConfigError(f"cluster achievable_fraction={self.achievable_fraction} and overlap={self.overlap} must lie in (0, 1]")

    @property
    def nodes(self) -> int:
        return max(1, self.devices // self.devices_per_node)

    def flops(self, precision: str) -> float:
        """Achievable FLOP/s of one device for a compute dtype (fp32 falls back if one is missing)."""
        peak = self.peak_flops.get(precision) or self.peak_flops.get("fp32") or max(self.peak_flops.values())
        return peak * self.achievable_fraction

    def matmul_flops(self, precision: str, dim: float) -> float:
        """Achievable FLOP/s for a matmul of geometric-mean dimension ``dim``.

        Calibrated specs keep a table of FLOP/s by matrix size; small matmuls reach a smaller
        fraction of the peak, so the figure is interpolated (log-linearly) in that table. Presets
        have no table and use ``flops(precision)`` for every size.
        """
        found = _interpolate(self._table("matmul_flops", precision), dim)
        return found if found is not None else self.flops(precision)

    def block_flops(self, precision: str, dim: float, *, recompute: bool = False) -> float | None:
        """Achieved FLOP/s of a whole transformer layer, forward + backward (matmuls, attention,
        norms, activation functions, autograd), for the layer's GEMM dimension ``dim``; measured by
        ``shardwise calibrate`` on the built-in GPT's block. ``recompute``: under full activation
        recomputation, in model FLOPs (the replay's cost shows as a lower rate). None without a
        calibration (or without the recompute table)."""
        if recompute:
            tables = self.measurements.get("block_flops", {})
            return _interpolate(tables.get(f"{precision}+recompute") or tables.get("fp32+recompute") or {}, dim)
        return _interpolate(self._table("block_flops", precision), dim)

    def _table(self, key: str, precision: str) -> dict[str, float]:
        tables = self.measurements.get(key, {})
        return tables.get(precision) or tables.get("fp32") or {}

    def peak(self, precision: str) -> float:
        return self.peak_flops.get(precision) or self.peak_flops.get("fp32") or max(self.peak_flops.values())

    def with_devices(self, devices: int, devices_per_node: int | None = None) -> ClusterSpec:
        per_node = devices_per_node or min(self.devices_per_node, devices)
        return replace(self, devices=devices, devices_per_node=per_node)

    def collective_time(self, op: str, nbytes: float, group: int, *, stride: int = 1, latency: bool = True) -> float:
        """Seconds for one collective of ``nbytes`` (the full buffer) over ``group`` ranks spaced
        ``stride`` apart in rank order (intra-node iff the group's span fits in one node);
        ``latency=False``: the bandwidth term alone (when a measured fixed cost covers the latency)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        intra = group * stride <= self.devices_per_node
        bw, lat = (self.intra_bw, self.intra_latency_s) if intra else (self.inter_bw, self.inter_latency_s)
        factor = {"all_reduce": 2 * (group - 1) / group, "all_gather": (group - 1) / group,
                  "reduce_scatter": (group - 1) / group}.get(op, 1.0)
        return (lat * math.ceil(math.log2(group)) if latency else 0.0) + factor * nbytes / bw

    def collective_latency(self, op: str, group: int, *, stride: int = 1) -> float:
        """Seconds of one tiny collective: the calibrated fit's intercept for ``op`` when the spec
        has one (``measurements["fits"]``), else ``latency * ceil(log2 group)``."""
        if group <= 1:
            return 0.0
        fit = self.measurements.get("fits", {}).get(op)
        if fit and group * stride <= self.devices_per_node:
            return float(fit["alpha_s"])
        return self.collective_time(op, 1.0, group, stride=stride)

    def p2p_time(self, nbytes: float, *, intra: bool) -> float:
        bw, lat = (self.intra_bw, self.intra_latency_s) if intra else (self.inter_bw, self.inter_latency_s)
        return lat + nbytes / bw

    # -- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"shardwise_cluster": 1, **asdict(self)}

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2)
            fh.write("\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterSpec:
        data = dict(data)
        data.pop("shardwise_cluster", None)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"cluster spec key {unknown[0]!r} is unknown", hint=f"valid keys: {', '.join(sorted(known))}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"cluster spec is incomplete ({exc})", hint="write it with `shardwise calibrate --out FILE`") from None

    @classmethod
    def load(cls, path: str) -> ClusterSpec:
        try:
            with open(path) as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"cluster spec file {path!r} does not exist", hint="use a preset name or run `shardwise calibrate --out FILE`") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"cluster spec file {path!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(data)


def _interpolate(table: dict[str, float], dim: float) -> float | None:
    """Log-linear interpolation in a ``{size: FLOP/s}`` table; below it throughput falls with size."""
    if not table:
        return None
    pts = sorted((float(k), float(v)) for k, v in table.items())
    if dim <= pts[0][0]:
        return pts[0][1] * max(dim / pts[0][0], 0.05)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if dim <= x1:
            w = (math.log(dim) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]


def _gpu(name: str, *, memory_gb: float, fp32: float, bf16: float, tf32: float, nvlink: float, ib: float, hbm: float) -> ClusterSpec:
    # nvlink/ib in GB/s per direction per GPU; nccl-tests reach ~80% of it as bus bandwidth.
    return ClusterSpec(
        name=name, devices=8, devices_per_node=8, memory_bytes=memory_gb * GB,
        peak_flops={"fp32": fp32 * 1e12, "tf32": tf32 * 1e12, "bf16": bf16 * 1e12, "fp16": bf16 * 1e12},
        achievable_fraction=0.55, intra_bw=0.8 * nvlink * GB, intra_latency_s=8e-6, inter_bw=0.8 * ib * GB,
        inter_latency_s=15e-6, memory_bw=hbm * GB, overlap=1.0, device_type="cuda",
    )


# Sources: NVIDIA A100 Tensor Core GPU datasheet (2021): 19.5 TFLOPS FP32, 156 TF32, 312 BF16/FP16 dense;
# 1,555 GB/s (40 GB) / 2,039 GB/s (80 GB SXM) HBM; NVLink 600 GB/s bidirectional = 300 per direction.
# DGX A100: 8x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU.
# NVIDIA H100 Tensor Core GPU datasheet (SXM5): 67 TFLOPS FP32, 495 TF32, 989 BF16/FP16 dense;
# 3.35 TB/s HBM3; NVLink 900 GB/s bidirectional = 450 per direction. DGX H100: 8x 400 Gb/s NDR = 50 GB/s per GPU.
# NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
PRESETS: dict[str, ClusterSpec] = {
    "a100-40gb": _gpu("a100-40gb", memory_gb=40, fp32=19.5, tf32=156, bf16=312, nvlink=300, ib=25, hbm=1555),
    "a100-80gb": _gpu("a100-80gb", memory_gb=80, fp32=19.5, tf32=156, bf16=312, nvlink=300, ib=25, hbm=2039),
    "h100": _gpu("h100", memory_gb=80, fp32=67, tf32=495, bf16=989, nvlink=450, ib=50, hbm=3350),
    "h200": _gpu("h200", memory_gb=141, fp32=67, tf32=495, bf16=989, nvlink=450, ib=50, hbm=4800),
    # A generic CPU process (one core of a current x86 server, Gloo on loopback): order-of-magnitude
    # figures, the fixed costs of parallel layers and Adam from `shardwise calibrate` on a 2-core VM
    # (4 processes, 2 per core), halved to one process per core. `Trainer(plan="auto")` measures the
    # machine instead (shardwise.calibrate.machine). CPU collectives compete with compute for the cores,
    # so nothing overlaps.
    "cpu": ClusterSpec(name="cpu", devices=2, devices_per_node=2, memory_bytes=8 * GIB, peak_flops={"fp32": 50e9, "bf16": 25e9},
                       achievable_fraction=1.0, intra_bw=2 * GB, intra_latency_s=200e-6, inter_bw=1 * GB, inter_latency_s=400e-6,
                       memory_bw=10 * GB, overlap=0.0, kernel_overhead_s=10e-6, dtensor_overhead_s=40e-6,
                       tp_layer_overhead_s=20e-3, zero3_unit_overhead_s=6e-3, zero2_unit_overhead_s=5e-3, pp_microbatch_overhead_s=3.5e-3,
                       optimizer_tensor_s=25e-6, optimizer_dtensor_tensor_s=150e-6, optimizer_param_s=6e-9, device_type="cpu"),
}
ALIASES = {"h100-80gb": "h100", "h200-141gb": "h200", "a100": "a100-80gb"}


def resolve(device_type: str, *, devices: int | None = None, devices_per_node: int | None = None) -> ClusterSpec:
    """A preset name or a spec file path -> spec, with the device counts overridden when given."""
    key = ALIASES.get(device_type.lower(), device_type.lower())
    if key in PRESETS:
        spec = PRESETS[key]
    elif os.path.exists(device_type) or device_type.endswith(".json"):
        spec = ClusterSpec.load(device_type)
    else:
        raise ConfigError(f"--device-type {device_type!r} is neither a preset nor a spec file",
                          hint=f"use one of {', '.join(PRESETS)} or a file from `shardwise calibrate --out FILE`")
    if devices is not None:
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ConfigError(f"devices={devices!r} must be a positive integer", hint="e.g. --devices 8")
        per_node = devices_per_node or min(spec.devices_per_node, devices)
        if per_node < 1:
            raise ConfigError(f"devices_per_node={per_node} must be a positive integer", hint="e.g. --devices-per-node 8")
        spec = replace(spec, devices=devices, devices_per_node=per_node)
    elif devices_per_node is not None:
        spec = replace(spec, devices_per_node=devices_per_node)
    return spec
