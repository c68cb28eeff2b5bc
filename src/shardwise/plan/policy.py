"""How a training step is executed beyond the plan's degrees: the precision policy, what
``recompute="selective"`` keeps, the loss kernel and how gradients are accumulated and reduced.

The same :class:`~shardwise.layout.Plan` costs different memory and time in different runtimes.
:class:`RunPolicy` names those differences explicitly instead of hiding them in fitted factors:

- ``precision``: ``"autocast"`` is how shardwise's Trainer runs mixed precision
  (``torch.autocast`` over fp32 parameters): the residual stream stays fp32 (the LayerNorm inputs
  and a pipeline stage's input are saved in fp32), every microbatch's forward saves autocast's
  16-bit copy of each weight, separate q/k/v projections each save their own 16-bit copy of the
  normalized input, and the loss keeps an fp32 log-softmax beside the 16-bit logits and allocates
  a separate gradient for them. ``"16bit"`` is how Megatron-LM, torchtitan and llm-foundry run:
  16-bit parameters for compute (Megatron's fp16/bf16 module, FSDP's 16-bit all-gather) and
  16-bit activations throughout, so every saved tensor, pipeline send and tensor-parallel
  collective is 2 bytes per element. Under ``precision="fp32"`` plans both mean plain fp32.
- ``selective``: what ``recompute="selective"`` saves. ``"matmuls"`` is shardwise's own policy
  (:mod:`shardwise.parallel.checkpointing`: every matmul and attention output is saved, pointwise
  operators are recomputed); ``"op"`` is torchtitan's per-op selective checkpointing (the outputs of
  every *other* matmul and of attention are saved, the remaining matmuls and every pointwise
  operator recomputed); ``"attention"`` is Korthikanti et al. 2022's selective recomputation (all but
  the attention core: the ``s^2`` softmax/dropout tensors of eager attention are recomputed, which
  saves nothing with fused attention); ``"layer"`` is torchtitan's per-layer selective
  checkpointing (every second block fully recomputed, the others keep everything).
- ``fused_loss``: the cross-entropy computes its gradient in place of its fp32 copy of the logits
  (Megatron's vocab-parallel cross-entropy, fused CE kernels), so the logits cost 2 + 4 bytes per
  element once; otherwise (shardwise's ``F.cross_entropy`` under autocast) the 16-bit logits, the
  fp32 log-softmax and, at the start of backward, their gradients (as large again) coexist.
- ``sharded_grad_accumulation``: with ZeRO-2/3 and several microbatches, FSDP1/DeepSpeed
  reduce-scatter every microbatch into the sharded gradient; shardwise's FSDP2 path
  (``set_requires_gradient_sync(False)``) accumulates the unsharded gradient and reduce-scatters
  once (one more full-size gradient buffer in memory, ``m - 1`` fewer reduce-scatters).
- ``grad_reduce_overlap``: DDP/FSDP reduce gradients bucket by bucket while backward runs;
  Megatron-LM before 2023 all-reduced them after backward (nothing hidden).
- ``async_tp``: tensor-parallel collectives overlap the matmuls they feed (torchtitan's async TP);
  otherwise they are on the critical path.
- ``pp_scatter_gather``: each tensor-parallel rank sends only its ``1/t`` slice of a pipeline
  stage's output over its own NIC and the receiving stage all-gathers it over NVLink (Megatron-LM's
  scatter/gather optimization, Narayanan et al. 2021 sec. 4.1; with sequence parallelism the
  activation is already split); otherwise every TP rank sends the whole activation.
- ``zero3_unit``: what ZeRO-3 gathers at a time. ``"block"``: FSDP's unit, one transformer block
  (FSDP1/FSDP2 wrapping each block, as shardwise, torchtitan and llm-foundry do), the next one
  prefetched; ``"linear"``: DeepSpeed's per-module fetch, the largest weight matrix and the next.
- ``context_parallel``: ``c`` consecutive data-parallel ranks split each sequence (Liu et al.
  2023's ring attention; Llama 3's all-gathered keys and values): a sample of the model
  statistics is then a ``1/c`` slice attending to the whole sequence
  (``transformer_stats(..., seq=S/c, context=S)``), FSDP and the gradient reduction run over all
  data-parallel ranks, and every layer all-gathers the keys and values of its ``c`` slices in
  forward (reduce-scatters their gradients in backward), behind the attention it feeds.
- ``linear_dtype``: ``"fp8"`` runs the linear layers at the FP8 tensor-core rate (torchao float8
  training) plus the casts' memory traffic; ``""`` runs them in the plan's precision.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.errors import ConfigError

PRECISION_POLICIES = ("autocast", "16bit")
SELECTIVE_MODES = ("matmuls", "op", "attention", "layer")


@dataclass(frozen=True)
class RunPolicy:
    """How the step runs (see the module doc); ``RunPolicy()`` is shardwise's own Trainer."""

    precision: str = "autocast"
    selective: str = "matmuls"
    fused_loss: bool = False
    sharded_grad_accumulation: bool = False
    grad_reduce_overlap: bool = True
    async_tp: bool = False
    pp_scatter_gather: bool = False
    zero3_unit: str = "block"
    context_parallel: int = 1
    linear_dtype: str = ""

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_POLICIES:
            raise ConfigError(f"precision policy {self.precision!r} is unknown", hint="use autocast (shardwise's Trainer) or 16bit "
                              "(Megatron-LM, torchtitan, llm-foundry)")
        if self.selective not in SELECTIVE_MODES:
            raise ConfigError(f"selective recompute mode {self.selective!r} is unknown", hint=f"use one of {', '.join(SELECTIVE_MODES)}")
        if self.zero3_unit not in ("block", "linear"):
            raise ConfigError(f"zero3_unit {self.zero3_unit!r} is unknown", hint="use block (FSDP) or linear (DeepSpeed)")
        if isinstance(self.context_parallel, bool) or not isinstance(self.context_parallel, int) or self.context_parallel < 1:
            raise ConfigError(f"context_parallel={self.context_parallel!r} must be a positive integer", hint="1 without context parallelism")
        if self.linear_dtype not in ("", "fp8"):
            raise ConfigError(f"linear_dtype {self.linear_dtype!r} is unknown", hint='use "" (the plan\'s precision) or "fp8"')

    @classmethod
    def shardwise(cls) -> RunPolicy:
        """shardwise's Trainer: autocast over fp32 parameters, FSDP2, op-level selective policy."""
        return cls()

    @classmethod
    def sixteen_bit(cls, **overrides: object) -> RunPolicy:
        """Megatron-LM / torchtitan / llm-foundry: 16-bit activations, fused loss, sharded
        accumulation under ZeRO-2/3 (``overrides`` change single fields)."""
        base = {"precision": "16bit", "selective": "attention", "fused_loss": True, "sharded_grad_accumulation": True,
                "pp_scatter_gather": True}
        return cls(**{**base, **overrides})  # type: ignore[arg-type]

    @classmethod
    def named(cls, name: str) -> RunPolicy:
        """``--precision-policy``: ``autocast`` or ``16bit``."""
        if name == "autocast":
            return cls.shardwise()
        if name == "16bit":
            return cls.sixteen_bit()
        raise ConfigError(f"--precision-policy {name!r} is unknown", hint="use autocast (shardwise's Trainer) or 16bit")

    @property
    def autocast(self) -> bool:
        return self.precision == "autocast"


__all__ = ["PRECISION_POLICIES", "RunPolicy", "SELECTIVE_MODES"]
