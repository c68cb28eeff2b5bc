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

- :class:`TransformerSpec` (``{"layers", "hidden", "heads", "vocab", "seq"}``): closed forms, so a
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
- :func:`measure_module` for any ``nn.Module``: built on the ``meta`` device, parameters are counted
  per module, FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` and the saved-for-backward
  bytes from ``torch.autograd.graph.saved_tensors_hooks`` during one meta forward of one sample.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any, Callable

from shardwise.errors import ConfigError


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


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer by its shape (GPT-2/3 layout: learned positions, biases, GELU MLP).

    ``ffn`` defaults to ``4 * hidden``; ``kv_heads`` (grouped-query attention) to ``heads``.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0
    kv_heads: int = 0
    tied_embeddings: bool = False
    bias: bool = True
    learned_positions: bool = True
    attention: str = "fused"  # "fused" (SDPA / FlashAttention) or "eager" (keeps the s^2 softmax)
    dropout: bool = False
    separate_qkv: bool = False  # q, k, v as three Linear layers (shardwise's GPT) instead of one
    name: str = "transformer"

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "vocab", "seq"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model spec {key}={value!r} must be a positive integer", hint=f'e.g. "{key}": 8')
        for key in ("ffn", "kv_heads"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"model spec {key}={value!r} must be a non-negative integer", hint="leave it out for the default")
        if self.hidden % self.heads:
            raise ConfigError(f"model spec heads={self.heads} does not divide hidden={self.hidden}",
                              hint=f"use a hidden size that is a multiple of {self.heads}")
        if self.attention not in ("fused", "eager"):
            raise ConfigError(f"model spec attention={self.attention!r} is unknown",
                              hint='use "fused" (scaled_dot_product_attention / FlashAttention) or "eager"')
        if self.heads % self.kv_heads_:
            raise ConfigError(f"model spec kv_heads={self.kv_heads} does not divide heads={self.heads}",
                              hint="use a divisor of heads (or leave kv_heads out)")

    @property
    def ffn_(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_heads_(self) -> int:
        return self.kv_heads or self.heads

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, name: str = "transformer") -> TransformerSpec:
        known = {f.name for f in fields(cls)}
        aliases = {"n_layer": "layers", "num_layers": "layers", "n_embd": "hidden", "hidden_size": "hidden", "d_model": "hidden",
                   "n_head": "heads", "num_heads": "heads", "vocab_size": "vocab", "seq_len": "seq", "n_ctx": "seq",
                   "ffn_size": "ffn", "intermediate_size": "ffn", "num_kv_heads": "kv_heads", "tie_embeddings": "tied_embeddings"}
        values: dict[str, Any] = {"name": name}
        for key, value in data.items():
            key = aliases.get(key, key)
            if key not in known:
                raise ConfigError(f"model spec key {key!r} is unknown",
                                  hint="use layers, hidden, heads, vocab, seq, ffn, kv_heads, tied_embeddings, attention, dropout")
            values[key] = value
        missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in values]
        if missing:
            raise ConfigError(f"model spec is missing {missing[0]!r}", hint='e.g. {"layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200, "seq": 2048}')
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> TransformerSpec:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model spec is not JSON ({exc.msg} at column {exc.colno})", hint='e.g. {"layers": 2, "hidden": 64, ...}') from None
        if not isinstance(data, dict):
            raise ConfigError("model spec must be a JSON object", hint='e.g. {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 64}')
        return cls.from_dict(data)

    def stats(self, *, seq: int | None = None) -> ModelStats:
        """Closed-form statistics (see the module doc for the sources)."""
        s = seq or self.seq
        h, a, f, v = self.hidden, self.heads, self.ffn_, self.vocab
        kv = h // a * self.kv_heads_
        b = 1 if self.bias else 0
        attn = h * h + 2 * h * kv + h * h + b * (h + 2 * kv + h)
        mlp = 2 * h * f + b * (f + h)
        per_block = attn + mlp + 4 * h  # two LayerNorms (weight + bias)
        embed = v * h + (s * h if self.learned_positions else 0)
        head = 2 * h + (0 if self.tied_embeddings else v * h + b * v)
        # Forward FLOPs per sample: 2 per multiply-add of every weight matrix, plus q k^T and a v.
        matmul_params = attn - b * (h + 2 * kv + h) + mlp - b * (f + h)
        attn_flops = 2 * 2 * s * s * h
        block_flops = 2 * s * matmul_params + attn_flops
        head_flops = 2 * s * h * v
        # Korthikanti et al. 2022, eq. 1, term by term (16-bit activations, 1-byte dropout masks).
        drop = 1 if self.dropout else 0
        attn_act = s * h * (2 + 2 * (1 + 2 * kv / h) + 2 + drop)  # input, q k v, out-proj input, mask
        mlp_act = s * h * (2 + drop) + 2 * 2 * s * f  # input, mask; both sides of the activation
        norm_act = 4 * s * h
        scores = (2 + 3 * drop) * a * s * s if self.attention == "eager" else 0  # softmax (+ mask, dropped)
        act = attn_act + mlp_act + norm_act + scores
        return ModelStats(
            name=self.name, blocks=self.layers, params_per_block=per_block, params_embed=embed, params_head=head,
            flops_per_block=float(block_flops), flops_head=float(head_flops), attn_flops_per_block=float(attn_flops),
            act_bytes_per_block=float(act), attn_act_bytes_per_block=float(scores), boundary_bytes=float(2 * s * h),
            logits_bytes=float(2 * s * v), seq=s, hidden=h, heads=a, vocab=v, tied_embeddings=self.tied_embeddings,
            tp_divides=(a, h, f, self.kv_heads_),
            replicated_per_block=4 * h + b * 2 * h,  # LayerNorms, o_proj and fc_out biases
            replicated_embed=s * h if self.learned_positions else 0, replicated_head=2 * h,
            # two LayerNorms (weight + bias) and six weight matrices, with biases when bias=True;
            # token (+ position) embeddings, final norm, LM head (+ bias) unless tied
            tensors_per_block=4 + 6 + 6 * b,
            tensors_outer=1 + int(self.learned_positions) + 2 + (0 if self.tied_embeddings else 1 + b),
            residual_elems_per_block=float(2 * s * h), qkv_input_copies=3 if self.separate_qkv else 1,
        )


# Named shapes for dry runs. "gpt" is shardwise's built-in GPT at its default size.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt": {"layers": 4, "hidden": 128, "heads": 4, "vocab": 128, "seq": 128, "separate_qkv": True},
    "gpt2": {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "seq": 1024, "tied_embeddings": True},
    "gpt3-1.3b": {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 51200, "seq": 2048},
    "gpt3-13b": {"layers": 40, "hidden": 5120, "heads": 40, "vocab": 51200, "seq": 2048},
    "gpt3-175b": {"layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200, "seq": 2048},
}


def preset(name: str) -> TransformerSpec:
    if name not in PRESETS:
        raise ConfigError(f"--model {name!r} is not a known model", hint=f"use one of {', '.join(PRESETS)}, or --model-spec JSON")
    return TransformerSpec.from_dict(PRESETS[name], name=name)


def spec_from_gpt_config(config: Any) -> TransformerSpec:
    """The analytic spec of a :class:`shardwise.models.gpt.GPTConfig` (same parameter count)."""
    return TransformerSpec(layers=config.layers, hidden=config.hidden, heads=config.heads, vocab=config.vocab_size,
                           seq=config.seq_len, ffn=config.ffn_size, attention="fused", dropout=config.dropout > 0,
                           separate_qkv=True, name="gpt")


def measure_module(build: Callable[[], Any], example: Callable[[Any], Any], *, seq: int = 1, name: str = "model") -> ModelStats:
    """Statistics of any model, measured on the ``meta`` device (nothing is allocated).

    ``build()`` returns the ``nn.Module`` (it is called under ``torch.device("meta")``);
    ``example(device)`` returns the input of one sample. The repeated blocks are the longest
    ``nn.ModuleList``/``nn.Sequential`` whose children all have the same type; everything else
    counts as the embedding (before the blocks) or head (after) part, split by parameter order.
    """
    import torch
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build()
    blocks = _find_blocks(model) or [model]  # no repeated blocks: the whole model is one block
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    names = [n for n, _ in model.named_parameters()]
    first_block = next((i for i, (_, p) in enumerate(model.named_parameters()) if id(p) in in_blocks), len(names))
    embed = sum(p.numel() for i, (_, p) in enumerate(model.named_parameters()) if id(p) not in in_blocks and i < first_block)
    head = sum(p.numel() for i, (_, p) in enumerate(model.named_parameters()) if id(p) not in in_blocks and i >= first_block)

    state = {"active": None, "saved": {}, "boundary": 0}

    def pre(module: nn.Module, args: tuple) -> None:
        state["active"] = id(module)
        if isinstance(args[0], torch.Tensor) and not state["boundary"]:
            state["boundary"] = args[0].numel() * 2  # counted at 16-bit like the analytic path

    def post(module: nn.Module, args: tuple, out: Any) -> None:
        state["active"] = None

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = state["active"]
        scale = 2 / t.element_size() if t.is_floating_point() else 1  # normalize to 16-bit
        state["saved"][key] = state["saved"].get(key, 0.0) + t.numel() * t.element_size() * scale
        return t

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))]
    counter = FlopCounterMode(display=False)
    logits_bytes = 0
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
            out = model(example("meta"))
            if isinstance(out, torch.Tensor):
                logits_bytes = out.numel() * 2
    finally:
        for h in handles:
            h.remove()
    total_flops = counter.get_total_flops()
    flops_by_module = counter.get_flop_counts()
    n = max(1, len(blocks))
    block_saved = sum(v for k, v in state["saved"].items() if k is not None) / n
    block_flops = 0.0
    if blocks[0] is model:
        block_flops = float(total_flops)
    else:
        for key, counts in flops_by_module.items():
            if key.count(".") == _block_depth(model, blocks):
                block_flops = max(block_flops, float(sum(counts.values())))
    block_flops = block_flops or total_flops / n
    heads = int(getattr(getattr(model, "config", None), "heads", 0) or 0)
    hidden = int(getattr(getattr(model, "config", None), "hidden", 0) or 0)
    divides = (heads, hidden) if heads and hidden else ()
    return ModelStats(
        name=name, blocks=len(blocks), params_per_block=max(block_params, default=0), params_embed=embed, params_head=head,
        flops_per_block=block_flops, flops_head=max(0.0, total_flops - block_flops * len(blocks)), attn_flops_per_block=0.0,
        act_bytes_per_block=block_saved, attn_act_bytes_per_block=0.0, boundary_bytes=float(state["boundary"]),
        logits_bytes=float(logits_bytes), seq=seq, hidden=hidden, heads=heads,
        vocab=int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0), tp_divides=divides,
    )


def _find_blocks(model: Any) -> list[Any]:
    from torch import nn

    best: list[Any] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            if len(children) > max(1, len(best)) and len({type(c) for c in children}) == 1:
                best = children
    return best


def _block_depth(model: Any, blocks: list[Any]) -> int:
    """Dots in a block's qualified name as FlopCounterMode reports it (``Global`` prefix aside)."""
    for name, module in model.named_modules():
        if blocks and module is blocks[0]:
            return name.count(".") + 1  # FlopCounterMode names are "<ModelClass>.<path>"
    return -1


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["ModelStats", "PRESETS", "TransformerSpec", "ceil_div", "human_count", "measure_module", "preset",
           "spec_from_gpt_config"]
