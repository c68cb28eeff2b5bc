"""One homogeneous cluster as the planner sees it: :class:`ClusterSpec` (devices, peaks, links, the
achievable fractions and calibrated tables) and its JSON spec files; the presets are in
:mod:`shardwise.plan.cluster`.

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
"""

from __future__ import annotations

import json
import math
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
        factor = {
            "all_reduce": 2 * (group - 1) / group,
            "all_gather": (group - 1) / group,
            "reduce_scatter": (group - 1) / group,
            "all_to_all": (group - 1) / group,
        }.get(op, 1.0)
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
