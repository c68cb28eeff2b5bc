"""What the planner knows about the hardware: the presets and :func:`resolve` (a preset name or a
JSON spec file -> :class:`~shardwise.plan.cluster_spec.ClusterSpec`, which models the links).

Presets come from the vendors' published figures (dense, no sparsity). The achievable fractions
are physical properties, each with its source: the bus bandwidth nccl-tests reach over the link
peak (0.8), a large GEMM's fraction of the tensor-core peak (``gemm_efficiency``), FlashAttention's
(``attention_efficiency``), a streaming kernel's fraction of HBM bandwidth (``memory_efficiency``)
and how much data-parallel traffic hides behind compute (``overlap``: a collective that overlaps
still slows the kernels it shares the SMs and HBM with). ``shardwise calibrate`` replaces them by
this machine's measurements.
"""

from __future__ import annotations

import os
from dataclasses import replace

from shardwise.errors import ConfigError
from shardwise.plan.cluster_spec import GB, GIB, ClusterSpec

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


def _gpu(
    name: str,
    *,
    memory_gb: float,
    fp32: float,
    bf16: float,
    tf32: float,
    nvlink: float,
    ib: float,
    hbm: float,
    gemm: float,
    attention: float,
    overlap: float,
    fp8: float = 0.0,
) -> ClusterSpec:
    # fp8: the dense FP8 tensor-core peak (H100 SXM datasheet: 1,979 TFLOP/s); 0 on chips without FP8
    # nvlink/ib in GB/s per direction per GPU; nccl-tests reach ~80% of it as bus bandwidth.
    peaks = {"fp32": fp32 * 1e12, "tf32": tf32 * 1e12, "bf16": bf16 * 1e12, "fp16": bf16 * 1e12}
    if fp8:
        peaks["fp8"] = fp8 * 1e12
    return ClusterSpec(
        name=name,
        devices=8,
        devices_per_node=8,
        memory_bytes=memory_gb * GB,
        peak_flops=peaks,
        achievable_fraction=gemm,
        intra_bw=0.8 * nvlink * GB,
        intra_latency_s=8e-6,
        inter_bw=0.8 * ib * GB,
        inter_latency_s=15e-6,
        memory_bw=hbm * GB,
        overlap=overlap,
        device_type="cuda",
        kernel_overhead_s=8e-6,
        gemm_efficiency=gemm,
        attention_efficiency=attention,
        memory_efficiency=MEMORY_EFFICIENCY,
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
        raise ConfigError(
            f"--device-type {device_type!r} is neither a preset nor a spec file",
            hint=f"use one of {', '.join(PRESETS)} or a file from `shardwise calibrate --out FILE`",
        )
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


__all__ = [
    "ALIASES",
    "A100",
    "ClusterSpec",
    "FP8_RELATIVE_EFFICIENCY",
    "GB",
    "GIB",
    "H100",
    "MEMORY_EFFICIENCY",
    "PRESETS",
    "resolve",
]
