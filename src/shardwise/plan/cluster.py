"""What the planner knows about the hardware: :class:`ClusterSpec`, presets, JSON spec files.

Communication follows the alpha-beta model with the volume each link really carries. A collective
over ``n`` ranks moving ``B`` bytes (the full buffer) puts ``f(op, n) B`` on every rank's links, with
the nccl-tests bus factors ``f`` (all-reduce ``2(n-1)/n``, all-gather and reduce-scatter ``(n-1)/n``,
point-to-point ``1``; a ring and, for large messages, NCCL's double binary tree move the same). When
the group spans nodes, each ring (NCCL runs one per NIC) enters and leaves every node once, so a
node's ``g`` ranks of the group share ``g`` NICs for the node's ``f B``: the inter-node time is
``f B / (g inter_bw)`` beside the intra-node ``f B / intra_bw``, and the slower one sets the pace::

    t = alpha * ceil(log2 n) + f(op, n) * B * max(1 / intra_bw, 1 / (g * inter_bw))

(``g = 1``: a group with one rank per node, e.g. data parallelism across tensor-parallel nodes,
is limited by one NIC per rank). HSDP's two levels are two such collectives (a reduce-scatter
inside the shard group, an all-reduce of the shard across replicas).

Presets come from the vendors' published figures (dense, no sparsity). The achievable fractions
are physical properties, each with its source: the bus bandwidth nccl-tests reach over the link
peak (0.8), a large GEMM's fraction of the tensor-core peak (``gemm_efficiency``), FlashAttention's
(``attention_efficiency``), a streaming kernel's fraction of HBM bandwidth (``memory_efficiency``)
and how much data-parallel traffic hides behind compute (``overlap``: a collective that overlaps
still slows the kernels it shares the SMs and HBM with). ``shardwise calibrate`` replaces them by
this machine's measurements.
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
    overlap: float = 1.0  # fraction of overlappable (data-parallel, prefetched) communication that hides behind compute
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
    # Physical efficiencies of a preset's compute model (shardwise.plan.compute); 0: achievable_fraction.
    gemm_efficiency: float = 0.0  # a large GEMM's fraction of the tensor-core peak
    fp8_gemm_efficiency: float = 0.0  # an FP8 GEMM's fraction of the FP8 peak (0: gemm_efficiency)
    attention_efficiency: float = 0.0  # fused (Flash) attention's fraction of the peak, forward + backward
    memory_efficiency: float = 1.0  # a streaming kernel's fraction of memory_bw
    device_type: str = "cuda"
    measurements: dict[str, Any] = field(default_factory=dict)  # raw calibration tables, if any

    def __post_init__(self) -> None:
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise ConfigError(f"cluster devices={self.devices!r} must be a positive integer", hint="e.g. --devices 8")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ConfigError(
                f"cluster devices_per_node={self.devices_per_node!r} must be a positive integer",
                hint="e.g. --devices-per-node 8",
            )
        if self.devices % self.devices_per_node and self.devices > self.devices_per_node:
            raise ConfigError(
                f"cluster devices={self.devices} is not a multiple of devices_per_node={self.devices_per_node}",
                hint="use whole nodes",
            )
        if self.memory_bytes <= 0:
            raise ConfigError(f"cluster memory_bytes={self.memory_bytes} must be positive")
        for key in ("intra_bw", "inter_bw", "memory_bw"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"cluster {key}={getattr(self, key)} must be positive")
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ConfigError("cluster peak_flops must map dtypes to positive FLOP/s", hint='e.g. {"fp32": 1e12}')
        if self.oversubscription < 1:
            raise ConfigError(
                f"cluster oversubscription={self.oversubscription} must be >= 1",
                hint="1 when every process has its own device",
            )
        if not 0 < self.achievable_fraction <= 1 or not 0 <= self.overlap <= 1:
            raise ConfigError(
                f"cluster achievable_fraction={self.achievable_fraction} and overlap={self.overlap} must lie in (0, 1]"
            )
        for key in ("gemm_efficiency", "attention_efficiency", "fp8_gemm_efficiency"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(
                    f"cluster {key}={getattr(self, key)} must lie in [0, 1]", hint="0 means: use achievable_fraction"
                )
        if not 0 < self.memory_efficiency <= 1:
            raise ConfigError(f"cluster memory_efficiency={self.memory_efficiency} must lie in (0, 1]")

    @property
    def nodes(self) -> int:
        return max(1, self.devices // self.devices_per_node)

    @property
    def gemm_efficiency_(self) -> float:
        return self.gemm_efficiency or self.achievable_fraction

    @property
    def fp8_gemm_efficiency_(self) -> float:
        return self.fp8_gemm_efficiency or self.gemm_efficiency_

    @property
    def fp8_capable(self) -> bool:
        """Whether the device has FP8 tensor cores (an ``fp8`` peak): where the search considers
        ``precision="fp8"`` by default."""
        return "fp8" in self.peak_flops and self.device_type == "cuda"

    @property
    def attention_efficiency_(self) -> float:
        return self.attention_efficiency or self.gemm_efficiency_

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

    def ranks_per_node(self, group: int, stride: int) -> int:
        """How many ranks of a group of ``group`` ranks spaced ``stride`` apart share a node."""
        return max(1, min(group, self.devices_per_node // max(1, stride)))

    def collective_time(self, op: str, nbytes: float, group: int, *, stride: int = 1, latency: bool = True) -> float:
        """Seconds for one collective of ``nbytes`` (the full buffer) over ``group`` ranks spaced
        ``stride`` apart in rank order (see the module doc: the busier of the intra-node links and
        the node's NICs sets the pace); ``latency=False``: the bandwidth term alone (when a measured
        fixed cost covers the latency)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        factor = {"all_reduce": 2 * (group - 1) / group, "all_gather": (group - 1) / group,
                  "reduce_scatter": (group - 1) / group, "all_to_all": (group - 1) / group}.get(op, 1.0)
        volume = factor * nbytes
        if group * stride <= self.devices_per_node:
            return (
                self._latency(op, group, self.intra_latency_s, self.intra_latency_s) if latency else 0.0
            ) + volume / self.intra_bw
        g = self.ranks_per_node(group, stride)
        seconds = volume * max(1.0 / self.intra_bw if g > 1 else 0.0, 1.0 / (g * self.inter_bw))
        return (
            self._latency(op, group, self.intra_latency_s, self.inter_latency_s, nodes=max(1, group // g))
            if latency
            else 0.0
        ) + seconds

    @staticmethod
    def _latency(op: str, group: int, intra: float, inter: float, *, nodes: int = 1) -> float:
        """Latency of one collective: a ring all-gather or reduce-scatter takes ``n - 1`` steps (of
        which one per node crosses a NIC); an all-reduce (NCCL's tree for latency-bound sizes) and
        the others ``ceil(log2 n)``."""
        if op in ("all_gather", "reduce_scatter", "all_to_all"):  # n - 1 ring steps / pairwise exchanges
            hops_inter = nodes if nodes > 1 else 0
            return (group - 1 - hops_inter) * intra + hops_inter * inter
        return math.ceil(math.log2(group)) * (inter if nodes > 1 else intra)

    def link_share(self, group: int, *, stride: int = 1) -> float:
        """The data rate of a collective over ``group`` ranks spaced ``stride`` apart, as a share of
        the intra-node link's: 1 inside a node, ``g inter_bw / intra_bw`` (at most 1) across nodes
        with ``g`` of the group's ranks per node (what NCCL's kernels then take from compute)."""
        if group <= 1 or group * stride <= self.devices_per_node:
            return 1.0
        g = self.ranks_per_node(group, stride)
        return min(1.0, g * self.inter_bw / self.intra_bw)

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
            raise ConfigError(
                f"cluster spec key {unknown[0]!r} is unknown", hint=f"valid keys: {', '.join(sorted(known))}"
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(
                f"cluster spec is incomplete ({exc})", hint="write it with `shardwise calibrate --out FILE`"
            ) from None

    @classmethod
    def load(cls, path: str) -> ClusterSpec:
        try:
            with open(path) as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise ConfigError(
                f"cluster spec file {path!r} does not exist",
                hint="use a preset name or run `shardwise calibrate --out FILE`",
            ) from None
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


MEMORY_EFFICIENCY = 0.85  # STREAM-like copy kernels: ~1.3 of 1.555 TB/s on an A100-40GB, ~2.9 of 3.35 on an H100 SXM
# Per-chip efficiencies of the compute model (shardwise.plan.compute) and the overlap fraction
# (shardwise.plan.comm). A100: `gemm` and `attention` fitted on 107 published A100 runs of four
# sources under each run's framework policy, each source weighted once (`bench/planner_published.py
# --fit`); both earn their place in its leave-one-source-out cross-validation (held at their priors,
# the cross-validated error grows). `overlap` is not refitted in each fold (fitted, it traded off
# against the attention efficiency and the cross-validated error grew from 7.8% to 9.6%): it is the
# share of the compute a collective leaves to the kernels beside it (NCCL's 16 channels take one SM
# each of the A100's 108, and the ring's HBM traffic slows the memory-bound kernels), chosen once
# among 0.5, 0.7 and 0.85 by that cross-validation (docs/planner.md).
A100 = {"gemm": 0.75, "attention": 0.225, "overlap": 0.7}
# H100 / H200 (same compute die): no published H100 runs to fit here but three on a lower-power
# variant, so each figure is carried over from the A100 by a measured or published ratio:
# - gemm: the A100's training GEMM efficiency times the ratio of the two chips' best-GEMM fractions,
#   0.715 of 989 TFLOP/s measured here on an H200 (bench/results/gpu/calibrated_1gpu.json) over
#   ~0.85 of 312 on an A100 (cuBLAS, NVIDIA's published bf16 GEMM throughput): 0.70 x 0.84;
# - attention: FlashAttention-2 on an H100 (Shah et al. 2024, FlashAttention-3, sec. 1 and fig. 5-7:
#   ~35% of peak forward, ~25-29% backward): causal forward + backward ~0.25;
# - overlap: NCCL's channels beside the compute kernels, the A100's figure.
H100 = {"gemm": round(A100["gemm"] * 0.715 / 0.85, 3), "attention": 0.25, "overlap": A100["overlap"]}
# FP8 GEMMs (H100 / H200 / H800): 0.87 of the fraction of its peak a bf16 GEMM reaches. From
# torchao's published float8 microbenchmark on an H100 (torchao/float8/README.md: a linear of
# M, K, N = 4096, 8192, 16384 runs forward + backward 1.39x faster in float8 than in bf16, the
# casts included): with the casts' traffic of torchao's own roofline at the 2.4 TB/s of the H100
# variant it measured on, 1.39x leaves the FP8 GEMMs at 0.87 of bf16's fraction (the tensor cores
# at the power limit clock lower under FP8). The same model gives 0.74x for its small example
# (1024, 2048, 1024; measured 0.80x: leave it in bf16), tests/unit/test_cost_fp8.py.
FP8_RELATIVE_EFFICIENCY = 0.87


def _gpu(name: str, *, memory_gb: float, fp32: float, bf16: float, tf32: float, nvlink: float, ib: float, hbm: float,
         gemm: float, attention: float, overlap: float, fp8: float = 0.0) -> ClusterSpec:
    # fp8: the dense FP8 tensor-core peak (H100 SXM datasheet: 1,979 TFLOP/s); 0 on chips without FP8
    # nvlink/ib in GB/s per direction per GPU; nccl-tests reach ~80% of it as bus bandwidth.
    peaks = {"fp32": fp32 * 1e12, "tf32": tf32 * 1e12, "bf16": bf16 * 1e12, "fp16": bf16 * 1e12}
    if fp8:
        peaks["fp8"] = fp8 * 1e12
    return ClusterSpec(
        name=name, devices=8, devices_per_node=8, memory_bytes=memory_gb * GB, peak_flops=peaks,
        achievable_fraction=gemm, intra_bw=0.8 * nvlink * GB, intra_latency_s=8e-6, inter_bw=0.8 * ib * GB,
        inter_latency_s=15e-6, memory_bw=hbm * GB, overlap=overlap, device_type="cuda", kernel_overhead_s=8e-6,
        gemm_efficiency=gemm, attention_efficiency=attention, memory_efficiency=MEMORY_EFFICIENCY,
        fp8_gemm_efficiency=round(gemm * FP8_RELATIVE_EFFICIENCY, 3) if fp8 else 0.0,
    )


# Sources: NVIDIA A100 Tensor Core GPU datasheet (2021): 19.5 TFLOPS FP32, 156 TF32, 312 BF16/FP16 dense;
# 1,555 GB/s (40 GB) / 2,039 GB/s (80 GB SXM) HBM; NVLink 600 GB/s bidirectional = 300 per direction.
# DGX A100: 8x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU.
# NVIDIA H100 Tensor Core GPU datasheet (SXM5): 67 TFLOPS FP32, 495 TF32, 989 BF16/FP16 dense;
# 3.35 TB/s HBM3; NVLink 900 GB/s bidirectional = 450 per direction. DGX H100: 8x 400 Gb/s NDR = 50 GB/s per GPU.
# NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
# H800 / A800 (export variants): H100 / A100 compute with NVLink 400 GB/s bidirectional = 200 per direction.
# NVIDIA V100 datasheet (SXM2 32 GB): 15.7 TFLOPS FP32, 125 FP16 tensor (no BF16), 900 GB/s HBM2,
# NVLink 300 GB/s bidirectional = 150 per direction; DGX-1: 4x 100 Gb/s EDR for 8 GPUs = 6.25 GB/s per GPU.
# The A100's efficiencies stand in for the V100 (no published V100 runs here; no FlashAttention there).
PRESETS: dict[str, ClusterSpec] = {
    "a100-40gb": _gpu("a100-40gb", memory_gb=40, fp32=19.5, tf32=156, bf16=312, nvlink=300, ib=25, hbm=1555, **A100),
    "a100-80gb": _gpu("a100-80gb", memory_gb=80, fp32=19.5, tf32=156, bf16=312, nvlink=300, ib=25, hbm=2039, **A100),
    "h100": _gpu("h100", memory_gb=80, fp32=67, tf32=495, bf16=989, fp8=1979, nvlink=450, ib=50, hbm=3350, **H100),
    "h200": _gpu("h200", memory_gb=141, fp32=67, tf32=495, bf16=989, fp8=1979, nvlink=450, ib=50, hbm=4800, **H100),
    "h800": _gpu("h800", memory_gb=80, fp32=67, tf32=495, bf16=989, fp8=1979, nvlink=200, ib=50, hbm=3350, **H100),
    "a800": _gpu("a800", memory_gb=80, fp32=19.5, tf32=156, bf16=312, nvlink=200, ib=25, hbm=2039, **A100),
    "v100": _gpu("v100", memory_gb=32, fp32=15.7, tf32=15.7, bf16=125, nvlink=150, ib=6.25, hbm=900, **A100),
    # A generic CPU process (one core of a current x86 server, Gloo on loopback): order-of-magnitude
    # figures, the fixed costs of parallel layers and Adam from `shardwise calibrate` on a 2-core VM
    # (4 processes, 2 per core), halved to one process per core. `Trainer(plan="auto")` measures the
    # machine instead (shardwise.auto.machine). CPU collectives compete with compute for the cores,
    # so nothing overlaps.
    "cpu": ClusterSpec(
        name="cpu",
        devices=2,
        devices_per_node=2,
        memory_bytes=8 * GIB,
        peak_flops={"fp32": 50e9, "bf16": 25e9},
        achievable_fraction=1.0,
        intra_bw=2 * GB,
        intra_latency_s=200e-6,
        inter_bw=1 * GB,
        inter_latency_s=400e-6,
        memory_bw=10 * GB,
        overlap=0.0,
        kernel_overhead_s=10e-6,
        dtensor_overhead_s=40e-6,
        tp_layer_overhead_s=20e-3,
        zero3_unit_overhead_s=6e-3,
        zero2_unit_overhead_s=5e-3,
        pp_microbatch_overhead_s=3.5e-3,
        optimizer_tensor_s=25e-6,
        optimizer_dtensor_tensor_s=150e-6,
        optimizer_param_s=6e-9,
        device_type="cpu",
    ),
}
ALIASES = {
    "h100-80gb": "h100",
    "h200-141gb": "h200",
    "a100": "a100-80gb",
    "v100-32gb": "v100",
    "a800-80gb": "a800",
    "h800-80gb": "h800",
}


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
            raise ConfigError(
                f"devices_per_node={per_node} must be a positive integer", hint="e.g. --devices-per-node 8"
            )
        spec = replace(spec, devices=devices, devices_per_node=per_node)
    elif devices_per_node is not None:
        spec = replace(spec, devices_per_node=devices_per_node)
    return spec
