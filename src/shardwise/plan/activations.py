"""What one transformer layer keeps for backward under each recompute mode and precision policy
(:mod:`shardwise.plan.policy`), and what recomputation replays; :mod:`shardwise.plan.memory` adds the
model states, the logits and the buffers.

**What a layer keeps** (per token, Korthikanti et al. 2022 eq. 1 term by term, 16-bit): the block
input ``x`` and the second residual ``x2`` (the LayerNorm inputs), the normalized inputs ``n1``,
``n2`` of the q/k/v and first MLP projections, ``q, k, v``, the attention output ``o`` (the output
projection's input), the MLP's inner activations (GELU: its input and output, ``2 f``; SwiGLU: gate,
up, ``silu(gate)`` and the product, ``4 f``), 1-byte dropout masks and, with eager attention, the
``s^2`` softmax (+ its dropout mask and output). Without tensor parallelism that is the paper's
``s h (34 + 5 a s / h)`` (eager attention with dropout) or ``32 s h`` (fused attention, no dropout).
Tensor parallelism divides the sharded tensors (``q, k, v, o``, the MLP's inner activations, the
scores) by ``t``; the LayerNorm region (``x, n1, x2, n2`` and the masks) is divided only with
sequence parallelism (paper, table 2). The normalized inputs ``n1, n2`` of the column-parallel
layers only where the runtime saves their shard (``RunPolicy.sp_saves_shard``: Megatron-LM, which
all-gathers them again in backward); torch's DTensor sequence parallelism (shardwise, torchtitan)
all-gathers them in forward and the linear layers save the gathered, full-size tensor.

Recompute modes (``plan.recompute`` with the policy's ``selective``): ``full`` keeps only ``x``;
``attention`` (Korthikanti's selective) drops the ``s^2`` part; ``matmuls`` (shardwise's policy) keeps
``x`` and the outputs of every matmul and attention op; ``op`` (torchtitan's per-op SAC) keeps ``x``,
the attention output and every *other* matmul's output; ``layer`` recomputes every second block
fully. A recomputing mode also holds one replayed layer's activations during backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.plan.policy import RunPolicy
from shardwise.plan.stats import ModelStats


@dataclass(frozen=True)
class Saved:
    """One tensor a layer may keep for backward: elements per token, how tensor parallelism
    splits it, and which matmul (in forward order) or op produces it."""

    name: str
    elems: float
    # "residual" (fp32 under autocast), "norm" (LayerNorm region), "gathered" (a normalized input of
    # column-parallel layers), "sharded", "mask" (1 byte)
    kind: str
    matmul: int = 0  # 1-based position among the block's matmuls (0: not a matmul output)
    in_none: bool = True  # kept without recomputation
    attention: bool = False  # produced by the attention op (SDPA output)


def layer_tensors(stats: ModelStats, *, autocast: bool = False) -> list[Saved]:
    """The tensors of one block, per token (see the module doc); ``autocast``: separate q/k/v
    projections each keep their own 16-bit copy of the normalized input."""
    h, kv, f = stats.hidden, stats.kv_hidden or stats.hidden, stats.ffn or 4 * stats.hidden
    copies = stats.qkv_input_copies if autocast else 1
    out = [Saved("x", h, "residual"), Saved("n1", h * copies, "gathered")]
    if stats.qkv_input_copies > 1:  # separate q, k, v projections
        out += [Saved("q", h, "sharded", 1), Saved("k", kv, "sharded", 2), Saved("v", kv, "sharded", 3)]
        nxt = 4
    else:
        out += [Saved("qkv", h + 2 * kv, "sharded", 1)]
        nxt = 2
    out += [
        Saved("o", h, "sharded", attention=True),
        Saved("attn_out", h, "norm", nxt, in_none=False),
        Saved("x2", h, "residual"),
        Saved("n2", h, "norm" if stats.experts else "gathered"),
    ]
    nxt += 1
    if stats.experts:  # router logits, routed rows (sent, received, returned), the k experts' activations
        k, fe = stats.top_k, stats.expert_ffn
        out += [Saved("router", stats.experts, "norm", nxt), Saved("rows", 3 * k * h, "norm")]
        if stats.gated_mlp:
            out += [
                Saved("gate", k * fe, "norm", nxt + 1),
                Saved("up", k * fe, "norm", nxt + 2),
                Saved("act", 2 * k * fe, "norm"),
                Saved("mlp_out", h, "norm", nxt + 3, in_none=False),
            ]
        else:
            out += [
                Saved("fc1", k * fe, "norm", nxt + 1),
                Saved("act", k * fe, "norm"),
                Saved("mlp_out", h, "norm", nxt + 2, in_none=False),
            ]
    elif stats.gated_mlp:
        out += [
            Saved("gate", f, "sharded", nxt),
            Saved("up", f, "sharded", nxt + 1),
            Saved("act", f, "sharded"),
            Saved("prod", f, "sharded"),
            Saved("mlp_out", h, "norm", nxt + 2, in_none=False),
        ]
    else:
        out += [
            Saved("fc1", f, "sharded", nxt),
            Saved("act", f, "sharded"),
            Saved("mlp_out", h, "norm", nxt + 1, in_none=False),
        ]
    if stats.dropout:
        out += [Saved("masks", 2 * h, "mask")]  # residual dropouts after attention and MLP: 1 byte each
    return out


def _bytes(t: Saved, *, scale: float, autocast: bool, tp: int, sp: bool, sp_shards_inputs: bool = True) -> float:
    size = 4.0 if autocast and t.kind == "residual" else 2.0 * scale
    if t.kind == "mask":
        size = 1.0
    split = t.kind == "sharded" or (sp and (t.kind != "gathered" or sp_shards_inputs))
    return t.elems * size / (tp if split else 1)


def recompute_mode(plan: Plan, run: RunPolicy) -> str:
    """The cost model's recompute mode: none, full, or the policy's meaning of ``selective``."""
    return run.selective if plan.recompute == "selective" else plan.recompute


def layer_bytes(stats: ModelStats, plan: Plan, run: RunPolicy, *, mode: str | None = None) -> tuple[float, float]:
    """(kept, replayed): bytes one layer keeps per sample from forward to backward under ``mode``,
    and the transient bytes of one layer replayed during backward (0 without recomputation)."""
    mode = mode or recompute_mode(plan, run)
    t, sp = plan.tp, plan.sequence_parallel
    scale = 2.0 if plan.precision == "fp32" else 1.0
    autocast = run.autocast and plan.precision != "fp32"
    if not stats.ffn:  # a measured nn.Module: the saved bytes as measured (no per-tensor policies)
        return _measured_layer_bytes(stats, plan, mode, scale, 2.0 if autocast or scale > 1 else 1.0)
    tensors = layer_tensors(stats, autocast=autocast)
    s = stats.seq
    scores = stats.attn_act_bytes_per_block * scale / t  # eager attention's s^2 tensors (per sample)

    def total(keep: list[Saved]) -> float:
        return s * sum(
            _bytes(x, scale=scale, autocast=autocast, tp=t, sp=sp, sp_shards_inputs=run.sp_saves_shard) for x in keep
        )

    none = total([x for x in tensors if x.in_none]) + scores
    if mode == "none":
        return none, 0.0
    if mode == "layer":  # every second block fully recomputed: the average block
        full, replay = layer_bytes(stats, plan, run, mode="full")
        return (none + full) / 2, replay
    if mode == "full":
        return total([tensors[0]]), none
    if mode == "attention":
        return none - scores, scores
    if mode == "matmuls":  # every matmul output (eager attention: the bmm scores too) and attention's
        keep = [x for x in tensors if x.matmul or x.attention or x.name == "x"]
        bmm = stats.attn_act_bytes_per_block * (2 / 5 if stats.dropout else 1.0) * scale / t
        return total(keep) + bmm, none - total(keep)
    if mode == "op":  # torchtitan: every other matmul's output, attention's output, the block input
        keep = [x for x in tensors if (x.matmul % 2 == 1) or x.attention or x.name == "x"]
        return total(keep), none - total(keep)
    raise ConfigError(f"recompute mode {mode!r} is unknown", hint="use none, selective or full")


def _measured_layer_bytes(stats: ModelStats, plan: Plan, mode: str, scale: float, resid: float) -> tuple[float, float]:
    """A measured module's saved bytes (16-bit figures scaled to the plan's precision): TP divides
    all but the LayerNorm region (10 s h) unless sequence parallelism splits that too; full
    recomputation keeps the block input (fp32 under autocast: ``resid``) and replays the rest."""
    t = plan.tp

    def split(total: float) -> float:
        if t == 1 or plan.sequence_parallel:
            return total / t
        replicated = min(total, 5 * stats.boundary_bytes * scale)  # 10 s h: LayerNorm inputs and dropout masks
        return replicated + (total - replicated) / t

    none = split(stats.act_bytes_per_block * scale)
    if mode == "full":
        return stats.boundary_bytes * resid / (t if plan.sequence_parallel else 1), none
    if mode == "attention":
        return split((stats.act_bytes_per_block - stats.attn_act_bytes_per_block) * scale), 0.0
    return none, 0.0


__all__ = ["Saved", "layer_bytes", "layer_tensors", "recompute_mode"]
