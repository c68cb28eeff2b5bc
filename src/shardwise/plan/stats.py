"""Model statistics for the planner, without running the model at full size.

The cost model needs, per repeated block and for the parts outside the blocks (embeddings, final
norm, LM head):

- parameters (what ZeRO shards and what data parallelism all-reduces),
- forward FLOPs per sample (training costs 3x: backward is twice the forward),
- activation bytes per sample that backward keeps (what pipeline schedules multiply by the number
  of in-flight microbatches, and what recomputation trades for FLOPs),
- the bytes of the activation that crosses a block boundary (pipeline point-to-point traffic and
  the tensor-parallel all-reduce volume).

Two sources:

- :func:`transformer_stats` of a :class:`~shardwise.shape.TransformerShape` (``{"layers", "hidden",
  "heads", "vocab", "seq"}``; ``TransformerSpec`` is the same class): closed forms, so a
  model of hundreds of billions of parameters is described in microseconds. Activation bytes follow
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 1-2,
  term by term: per layer and sample at 16-bit, the attention block keeps its input (``2 s h``),
  q, k, v (``2 s h (1 + 2 kv/h)``) and the input of the output projection (``2 s h``); the MLP its
  input (``2 s h``) and both sides of the activation function (``2 x 2 s f``); the two LayerNorms
  their inputs (``4 s h``). Eager attention adds the softmax output (``2 a s^2``), dropout adds
  1-byte masks (``2 s h``, and ``a s^2`` on the scores) and the dropped-out scores (``2 a s^2``).
  With ``attention="eager", dropout=True`` and ``ffn = 4h`` this is the paper's ``s h (34 + 5 a s / h)``;
  the default (``attention="fused"``: PyTorch's ``scaled_dot_product_attention`` / FlashAttention,
  which keep no ``s^2`` tensor; no dropout) is ``32 s h``. The ``s^2`` part is what selective
  recomputation drops.
- any ``nn.Module``, measured on the ``meta`` device by :mod:`shardwise.auto.measure` (torch lives
  there; this module imports none).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from shardwise.errors import ConfigError
from shardwise.shape import TransformerShape


@dataclass(frozen=True)
class ModelStats:
    """What the cost model knows about a model. Per-sample figures are for one sequence of ``seq``.

    ``act_bytes_*`` are for 16-bit activations (scale by ``bytes/2`` for fp32); ``tp_divides``
    lists the sizes a tensor-parallel degree must divide (heads, hidden, FFN, KV heads); empty
    means the model cannot be tensor-parallelized automatically.
    """

    name: str
    blocks: int
    params_per_block: int
    params_embed: int  # first pipeline stage: token (+ position) embeddings
    params_head: int  # last pipeline stage: final norm + LM head (0 if tied; then embed counts it)
    flops_per_block: float  # forward FLOPs per sample
    flops_head: float  # forward FLOPs per sample of the parts outside the blocks
    attn_flops_per_block: float  # the s^2 part of flops_per_block (recomputed by "selective")
    act_bytes_per_block: float  # saved for backward, per sample, 16-bit, no TP
    attn_act_bytes_per_block: float  # the part selective recomputation drops
    boundary_bytes: float  # one block's input per sample, 16-bit
    logits_bytes: float  # per sample, 16-bit (the loss keeps an fp32 copy: the cost model adds it)
    seq: int
    hidden: int = 0
    heads: int = 0
    vocab: int = 0
    tied_embeddings: bool = False
    tp_divides: tuple[int, ...] = ()
    # Parameters that tensor parallelism replicates instead of sharding (norms, biases after a
    # rowwise layer, position embeddings), per block and in the embedding / head parts.
    replicated_per_block: int = 0
    replicated_embed: int = 0
    replicated_head: int = 0
    # Parameter *tensors* (not elements): optimizers that communicate per tensor (ZeRO-1's
    # ZeroRedundancyOptimizer broadcasts each parameter from its owner) pay a latency per tensor.
    tensors_per_block: int = 16
    tensors_outer: int = 6
    # Mixed precision under torch.autocast keeps some saved tensors at fp32 or twice: the elements per
    # block and sample of the fp32 residual stream that the LayerNorms save (2 s h), and how many
    # 16-bit copies of the normalized input the q/k/v projections save (3 when they are separate
    # Linear layers, each casting its own; 1 when fused).
    residual_elems_per_block: float = 0.0
    qkv_input_copies: int = 1
    # The layer's shape, for the compute model's GEMM shapes and the per-tensor activation policies
    # (0 / defaults: unknown, e.g. a measured nn.Module; the model then treats a block as h x h GEMMs).
    ffn: int = 0
    kv_hidden: int = 0  # key/value width: kv_heads * head_dim
    gated_mlp: bool = False  # SwiGLU-style MLP: gate and up projections (3 h f parameters)
    attention: str = "fused"
    dropout: bool = False
    rotary: bool = False
    context: int = 0  # keys per query when a sample is a slice of a longer sequence (context parallelism); 0: seq
    # Mixture of experts: experts per MoE layer, experts per token, each expert's inner size, and
    # the experts' weights per block (all experts; expert parallelism splits them, not tp).
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    expert_params_per_block: int = 0
    # LoRA adapters on a frozen (possibly 4-bit) base: shardwise.plan.adapters.LoraStats, or None
    lora: Any = None

    @property
    def params_total(self) -> int:
        return self.blocks * self.params_per_block + self.params_embed + self.params_head

    @property
    def flops_per_sample(self) -> float:
        """Forward FLOPs of one sample (multiply by 3 for a training step)."""
        return self.blocks * self.flops_per_block + self.flops_head

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["tp_divides"] = list(self.tp_divides)
        out["params_total"] = self.params_total
        return out


TransformerSpec = TransformerShape  # the planner's name for the same value


def transformer_stats(
    shape: TransformerShape, *, seq: int | None = None, gated_mlp: bool | None = None, context: int | None = None
) -> ModelStats:
    """Closed-form statistics of ``shape`` at ``seq`` tokens per sample (default: its ``seq_len``;
    see the module doc for the sources). ``gated_mlp``: a SwiGLU MLP (Llama: gate, up and down
    projections, ``3 h f`` weights; the MLP keeps gate, up, ``silu(gate)`` and their product,
    ``4 f`` elements per token, where GELU keeps ``2 f``); default: the shape's own ``gated_mlp``
    field if it has one, else False. ``context``: the keys each query attends to, when a sample is
    a slice of a longer sequence (context parallelism: ``seq = S / cp`` tokens per rank attending
    to all ``S``); default ``seq``."""
    s = seq or shape.seq_len
    h, a, f, v = shape.hidden, shape.heads, shape.ffn_, shape.vocab_size
    gated = bool(getattr(shape, "gated_mlp", False)) if gated_mlp is None else gated_mlp
    kv = h // a * shape.kv_heads_
    b = 1 if shape.bias else 0
    e, k, fe = shape.experts, shape.top_k if shape.experts else 0, shape.expert_ffn_
    attn, mlp, expert_params = _block_params(shape, kv=kv, gated=gated)
    per_block = attn + mlp + 4 * h  # two LayerNorms (weight + bias)
    embed = v * h + (shape.seq_len * h if shape.learned_positions else 0)
    head = 2 * h + (0 if shape.tied_embeddings else v * h + b * v)
    # Forward FLOPs per sample: 2 per multiply-add of every weight matrix, plus q k^T and a v.
    if e:  # a token passes through its top_k experts and the router only
        matmul_params = attn - b * (h + 2 * kv + h) + k * (3 if gated else 2) * h * fe + h * e
    else:
        matmul_params = attn - b * (h + 2 * kv + h) + mlp - b * ((2 if gated else 1) * f + h)
    ctx = context or s
    attn_flops = 2 * 2 * s * ctx * h
    block_flops = 2 * s * matmul_params + attn_flops
    head_flops = 2 * s * h * v
    act, scores = _activation_bytes(shape, s=s, ctx=ctx, kv=kv, gated=gated, top_k=k)
    drop = 1 if shape.dropout > 0 else 0
    return ModelStats(
        name=shape.name or "transformer",
        blocks=shape.layers,
        params_per_block=per_block,
        params_embed=embed,
        params_head=head,
        flops_per_block=float(block_flops),
        flops_head=float(head_flops),
        attn_flops_per_block=float(attn_flops),
        act_bytes_per_block=float(act),
        attn_act_bytes_per_block=float(scores),
        boundary_bytes=float(2 * s * h),
        logits_bytes=float(2 * s * v),
        seq=s,
        hidden=h,
        heads=a,
        vocab=v,
        tied_embeddings=shape.tied_embeddings,
        tp_divides=(a, h, f, shape.kv_heads_),
        replicated_per_block=4 * h + b * 2 * h,  # LayerNorms, o_proj and fc_out biases
        replicated_embed=shape.seq_len * h if shape.learned_positions else 0,
        replicated_head=2 * h,
        # two LayerNorms (weight + bias) and six weight matrices, with biases when bias=True;
        # token (+ position) embeddings, final norm, LM head (+ bias) unless tied
        tensors_per_block=(4 + 6 + 6 * b + (1 + b if gated else 0))
        if not e
        else (4 + 4 + 4 * b + 3 + (1 if gated else 0)),
        tensors_outer=1 + int(shape.learned_positions) + 2 + (0 if shape.tied_embeddings else 1 + b),
        residual_elems_per_block=float(2 * s * h),
        qkv_input_copies=3 if shape.separate_qkv else 1,
        ffn=f,
        kv_hidden=kv,
        gated_mlp=gated,
        attention=shape.attention,
        dropout=drop > 0,
        rotary=not shape.learned_positions,
        context=ctx if ctx != s else 0,
        experts=e,
        top_k=k,
        expert_ffn=fe if e else 0,
        expert_params_per_block=expert_params,
    )


def _block_params(shape: TransformerShape, *, kv: int, gated: bool) -> tuple[int, int, int]:
    """(attention, MLP, experts) parameters of one block: q, k, v and the output projection (with
    biases when ``shape.bias``); the MLP (or the experts and the router of an MoE layer); the
    experts' bias-free 3-D weights (0 without experts)."""
    h, f = shape.hidden, shape.ffn_
    b = 1 if shape.bias else 0
    attn = h * h + 2 * h * kv + h * h + b * (h + 2 * kv + h)
    e, fe = shape.experts, shape.expert_ffn_
    expert_params = e * (3 if gated else 2) * h * fe  # bias-free expert weights, as 3-D tensors
    mlp = (
        (3 if gated else 2) * h * f + b * ((2 if gated else 1) * f + h) if not e else expert_params + h * e
    )  # + router
    return attn, mlp, expert_params


def _activation_bytes(
    shape: TransformerShape, *, s: int, ctx: int, kv: int, gated: bool, top_k: int
) -> tuple[float, float]:
    """(all, eager attention's ``s^2`` part) bytes one block keeps for backward per sample at
    16 bits: Korthikanti et al. 2022, eq. 1, term by term (1-byte dropout masks)."""
    h, a, f, k, fe = shape.hidden, shape.heads, shape.ffn_, top_k, shape.expert_ffn_
    drop = 1 if shape.dropout > 0 else 0
    attn_act = s * h * (2 + 2 * (1 + 2 * kv / h) + 2 + drop)  # input, q k v, out-proj input, mask
    mlp_act = s * h * (2 + drop) + (4 if gated else 2) * 2 * s * f  # input, mask; both sides of the activation
    if shape.experts:  # the routed rows (sent, received and returned: 3 k h) and k experts' activations
        mlp_act = s * h * (2 + drop) + 3 * 2 * s * k * h + (4 if gated else 2) * 2 * s * k * fe
    norm_act = 4 * s * h
    scores = (2 + 3 * drop) * a * s * ctx if shape.attention == "eager" else 0  # softmax (+ mask, dropped)
    return attn_act + mlp_act + norm_act + scores, scores


def slice_stats(stats: ModelStats, cp: int) -> ModelStats:
    """The statistics of one context-parallel slice: ``seq / cp`` tokens of a sample attending to
    all ``seq`` keys. Every per-sample figure is per token (attention: per query over the whole
    context), so each scales by ``1 / cp``; parameters do not change."""
    if cp <= 1:
        return stats
    if stats.seq % cp:
        raise ConfigError(
            f"cp={cp} does not divide the sequence length {stats.seq}", hint="use a cp that divides the sequence"
        )
    scale = 1.0 / cp
    return replace(
        stats,
        seq=stats.seq // cp,
        context=stats.context or stats.seq,
        flops_per_block=stats.flops_per_block * scale,
        flops_head=stats.flops_head * scale,
        attn_flops_per_block=stats.attn_flops_per_block * scale,
        act_bytes_per_block=stats.act_bytes_per_block * scale,
        attn_act_bytes_per_block=stats.attn_act_bytes_per_block * scale,
        boundary_bytes=stats.boundary_bytes * scale,
        logits_bytes=stats.logits_bytes * scale,
        residual_elems_per_block=stats.residual_elems_per_block * scale,
    )


# Named shapes for dry runs. "gpt" is shardwise's built-in GPT at its default size.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt": {"layers": 4, "hidden": 128, "heads": 4, "vocab": 128, "seq": 128, "separate_qkv": True},
    "gpt2": {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "seq": 1024, "tied_embeddings": True},
    "gpt3-1.3b": {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 51200, "seq": 2048},
    "gpt3-13b": {"layers": 40, "hidden": 5120, "heads": 40, "vocab": 51200, "seq": 2048},
    "gpt3-175b": {"layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200, "seq": 2048},
}


def preset(name: str) -> TransformerShape:
    if name not in PRESETS:
        raise ConfigError(
            f"--model {name!r} is not a known model", hint=f"use one of {', '.join(PRESETS)}, or --model-spec JSON"
        )
    return TransformerShape.from_dict(PRESETS[name], name=name)


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "ModelStats",
    "PRESETS",
    "TransformerShape",
    "TransformerSpec",
    "ceil_div",
    "human_count",
    "preset",
    "slice_stats",
    "transformer_stats",
]
