"""The cost model's terms for LoRA and QLoRA: a frozen (possibly 4-bit) base with trainable adapters.

:func:`with_lora` marks a model's statistics (``ModelStats.lora``, a :class:`LoraStats`); the
estimate then changes in three places:

- **model states** (:func:`lora_state_bytes`): only the adapters have gradients (``G`` bytes) and
  optimizer states (``K``), sharded by ZeRO as usual; the frozen base has parameters only, ``P``
  bytes (fp32: 4) or with ``base="nf4"`` the quantized share of it at
  :data:`NF4_BYTES` = 0.5 + 1/64 + 2/(64 * 256) bytes per weight (4-bit codes, one 8-bit scaler per block of
  64, one 16-bit factor per group of 256 scalers; torchao's layout), sharded by ZeRO-3 like any
  parameter; embeddings, norms and the LM head stay at ``P``;
- **compute** (:func:`lora_microbatch`): per frozen matmul, backward computes the input gradient
  only (the weight-gradient GEMM is skipped): about 2 forward costs instead of 3 for the GEMM share
  ``g`` of the time (``bwd' = bwd (1 - g/2)``); each adapted layer adds its two thin GEMMs, ``r
  (in + out)`` multiply-adds per token against the base's ``in out``: the adapters' share ``a`` of
  the block's matmul parameters, forward and twice in backward; with NF4 every forward and
  backward first dequantizes the weights (read 4.13 bits, write and read the compute copy:
  ``(NF4_BYTES + 2 c)`` bytes per weight at the memory bandwidth, ``c`` the compute element size);
- **communication** is left as for the whole model: an over-estimate of the data-parallel
  reduction, which at run time carries the adapters' gradients only (ZeRO-3's all-gathers do
  carry the frozen base, 4-bit with NF4, which the model counts at the policy's bytes).

``r``, the targets' share of the block's matmul parameters and the base are what :func:`with_lora`
needs; the CLI (``shardwise plan --lora.r 16 [--lora.base nf4]``) takes every projection of a
block as a target (the family defaults).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from shardwise.errors import ConfigError

NF4_BYTES = 0.5 + 1 / 64 + 2 / (64 * 256)


@dataclass(frozen=True)
class LoraStats:
    """Per block: adapter parameters, the frozen matmul parameters they sit beside, and the base."""

    r: int
    adapter_params_per_block: float
    matmul_params_per_block: float
    base: str = "fp32"  # or "nf4"

    @property
    def adapter_share(self) -> float:
        """``a``: adapter parameters per base matmul parameter (and multiply-adds per token)."""
        return self.adapter_params_per_block / max(1.0, self.matmul_params_per_block)


def with_lora(stats: Any, *, r: int, base: str = "fp32") -> Any:
    """``stats`` with adapters of rank ``r`` on every projection of each block (q, k, v, o and the
    MLP's), read from its shape: ``r (in + out)`` adapter parameters per ``in x out`` matmul."""
    if r < 1:
        raise ConfigError(f"lora r={r} must be at least 1", hint="for example --lora.r 16")
    if base not in ("fp32", "nf4"):
        raise ConfigError(f"lora base={base!r} is unknown", hint="use fp32 or nf4")
    h = stats.hidden or int(math.sqrt(stats.params_per_block / 12))
    f = stats.ffn or 4 * h
    kv = stats.kv_hidden or h
    shapes = [(h, h), (h, kv), (h, kv), (h, h)] + [(h, f), (f, h)] + ([(h, f)] if stats.gated_mlp else [])
    adapter = sum(r * (i + o) for i, o in shapes)
    matmul = sum(i * o for i, o in shapes)
    return replace(
        stats,
        lora=LoraStats(r=r, adapter_params_per_block=float(adapter), matmul_params_per_block=float(matmul), base=base),
    )


def trainable_share(stats: Any) -> float:
    """``s``: the trainable parameters' share of the model's (1 without adapters)."""
    lora = stats.lora
    if lora is None:
        return 1.0
    return (
        stats.blocks
        * lora.adapter_params_per_block
        / max(1.0, stats.params_total + stats.blocks * lora.adapter_params_per_block)
    )


def lora_state_bytes(stats: Any, policy: Any, *, stage_params: float, zero: int, shard: int) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer states of a LoRA model's stage with
    ``stage_params`` base parameters on this rank (module doc)."""
    lora = stats.lora
    n = max(1, shard)
    layers = stage_params / max(1.0, stats.params_total) * stats.blocks  # this rank's share of the blocks
    adapters = layers * lora.adapter_params_per_block
    matmul = min(stage_params, layers * lora.matmul_params_per_block)
    frozen_bytes = (
        (matmul * NF4_BYTES + (stage_params - matmul) * policy.param)
        if lora.base == "nf4"
        else stage_params * policy.param
    )
    shard_params = zero >= 3 or (zero == 2 and policy.zero2_shards_params)
    return {
        "params": (frozen_bytes + adapters * policy.param) / (n if shard_params else 1),
        "grads": policy.grad * adapters / (n if zero >= 2 else 1),
        "optimizer": policy.optimizer * adapters / (n if zero >= 1 else 1),
    }


def lora_microbatch(stats: Any, mb: Any, cluster: Any, *, stage_params: float, compute_bytes: float) -> Any:
    """One microbatch's forward and backward time with a frozen base and adapters (module doc)."""
    lora = stats.lora
    gemm = mb.parts.get("gemm", 0.6 * mb.total) / max(mb.total, 1e-30)  # the GEMM share of the time
    a = lora.adapter_share
    fwd = mb.fwd * (1 + a * gemm)
    bwd = mb.bwd * (1 - gemm / 2) + 2 * a * gemm * mb.fwd
    parts = dict(mb.parts)
    if lora.base == "nf4":
        layers = stage_params / max(1.0, stats.params_total) * stats.blocks
        weights = layers * lora.matmul_params_per_block
        bw = cluster.memory_bw * getattr(cluster, "memory_efficiency", 1.0)
        dequant = weights * (NF4_BYTES + 2 * compute_bytes) / bw
        fwd, bwd = fwd + dequant, bwd + dequant
        parts["dequantize"] = 2 * dequant
    parts["adapters"] = a * gemm * 3 * mb.fwd
    return replace(mb, fwd=fwd, bwd=bwd, parts=parts)
