"""Metrics that are exact under data parallelism, and throughput / MFU.

A metric is a function ``(outputs, targets) -> (sum, count)``: for accuracy the number of correct
predictions and the number of predictions. Ranks accumulate sums and counts locally; one
all-reduce (SUM, fp64) over the data-parallel mesh at the end gives ``global_sum / global_count``.
Averaging per-rank averages instead would weight a rank with 2 samples like a rank with 3 — wrong
whenever shards are uneven, which evaluation shards usually are.

Model FLOPs utilization (Chowdhery et al. 2022, PaLM appendix B)::

    MFU = achieved model FLOP/s / peak FLOP/s
        = flops_per_sample * samples_per_s / (peak_flops_per_device * num_devices)

where ``flops_per_sample`` counts forward + backward (about ``6 * params * tokens`` for a
transformer, without recomputation).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence, Union

import torch
import torch.distributed as dist

from shardwise.errors import ConfigError

MetricFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]]
MetricsArg = Union[None, Sequence[Union[str, MetricFn]], Mapping[str, Union[str, MetricFn]]]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Top-1 accuracy over the last (class) dimension: (correct, total). Works for (N, C) and (N, T, C)."""
    correct = (outputs.argmax(dim=-1) == targets).sum()
    return correct, targets.numel()


BUILTIN: dict[str, MetricFn] = {"accuracy": accuracy}


def resolve_metrics(metrics: MetricsArg) -> dict[str, MetricFn]:
    """``["accuracy"]`` or ``{"acc": fn}`` -> ``{name: fn}``; unknown names raise with the valid ones."""
    if metrics is None:
        return {}
    items = (
        metrics.items()
        if isinstance(metrics, Mapping)
        else [(m if isinstance(m, str) else m.__name__, m) for m in metrics]
    )
    out: dict[str, MetricFn] = {}
    for name, fn in items:
        if isinstance(fn, str):
            if fn not in BUILTIN:
                raise ConfigError(
                    f"unknown metric {fn!r}",
                    hint=f"use one of {', '.join(BUILTIN)} or pass a function (outputs, targets) -> (sum, count)",
                )
            fn = BUILTIN[fn]
        out[name] = fn
    return out


class SumCount:
    """Local sums and counts per metric name; :meth:`reduce` makes them global (one all-reduce)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}
        self._pending: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, total: torch.Tensor | float, count: int | float) -> None:
        # Tensors are kept on their device and summed once at the end: no host sync per batch.
        if isinstance(total, torch.Tensor):
            self._pending.setdefault(name, []).append(total.detach().double().reshape(()))
        else:
            self.sums[name] = self.sums.get(name, 0.0) + float(total)
        self.counts[name] = self.counts.get(name, 0.0) + float(count)
        self.sums.setdefault(name, 0.0)

    def reduce(self, group: dist.ProcessGroup | None, names: Sequence[str], device: torch.device) -> dict[str, float]:
        """``{name: global_sum / global_count}`` for ``names`` (the same order and keys on every rank).

        Communication: one all-reduce (SUM) of ``2 * len(names)`` fp64 values over ``group``.
        """
        values = []
        for name in names:
            pending = self._pending.get(name, [])
            local = self.sums.get(name, 0.0) + (torch.stack(pending).sum().item() if pending else 0.0)
            values += [local, self.counts.get(name, 0.0)]
        buf = torch.tensor(values, dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized() and (group is None or dist.get_world_size(group) > 1):
            dist.all_reduce(buf, group=group)
        out = {}
        for i, name in enumerate(names):
            total, count = buf[2 * i].item(), buf[2 * i + 1].item()
            out[name] = total / count if count else float("nan")
        return out


# Dense peak FLOP/s per device (no sparsity), from vendor data sheets, for MFU.
PEAK_FLOPS = {
    ("H200", "bf16"): 989e12,
    ("H100", "bf16"): 989e12,
    ("A100", "bf16"): 312e12,
    ("L40S", "bf16"): 362e12,
    ("A10", "bf16"): 125e12,
    ("V100", "fp16"): 125e12,
    ("H200", "fp32"): 67e12,
    ("H100", "fp32"): 67e12,
    ("A100", "fp32"): 19.5e12,
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak dense FLOP/s of one ``device`` at ``precision`` if known (fp16 = bf16 on these GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    key = (
        "bf16" if precision in ("bf16", "fp16", "fp8") else "fp32"
    )  # fp8: MFU against the bf16 peak (torchtitan's convention)
    for (gpu, prec), value in PEAK_FLOPS.items():
        if gpu in name and prec == key:
            return value
    if "V100" in name and key == "bf16":
        return PEAK_FLOPS[("V100", "fp16")]
    return None


def throughput(
    *,
    samples: int,
    seconds: float,
    tokens_per_sample: int | None,
    flops_per_sample: float | None,
    peak_flops_total: float | None,
) -> dict[str, float]:
    """samples/s, tokens/s and MFU (each only when its inputs are known)."""
    out: dict[str, float] = {}
    if seconds <= 0:
        return out
    rate = samples / seconds
    out["samples_per_s"] = rate
    if tokens_per_sample:
        out["tokens_per_s"] = rate * tokens_per_sample
    if flops_per_sample and peak_flops_total:
        out["mfu"] = rate * flops_per_sample / peak_flops_total
    return out
