"""How a training step is executed beyond the plan's degrees: the precision policy, what
``recompute="selective"`` keeps, the loss kernel and how gradients are accumulated and reduced.

The same :class:`~shardwise.layout.Plan` costs different memory and time in different runtimes.
:class:`RunPolicy` names those differences explicitly instead of hiding them in fitted factors.
``RunPolicy()`` is what shardwise's Trainer runs by default; three of its behaviours are also
**runtime options of the plan** (``Plan.params16``, ``Plan.chunked_loss``,
``Plan.sharded_accumulation``, and ``Plan.precision="fp8"``), which the search turns on like it
turns on recomputation. :meth:`RunPolicy.applied` folds a plan's options into the policy, so every
cost term reads one effective policy; a framework's policy (:meth:`RunPolicy.sixteen_bit`) has
them always on.

- ``precision``: ``"autocast"`` is how shardwise's Trainer runs mixed precision by default
  (``torch.autocast`` over fp32 parameters): the residual stream stays fp32 (the LayerNorm inputs
  and a pipeline stage's input are saved in fp32), every microbatch's forward saves autocast's
  16-bit copy of each weight, separate q/k/v projections each save their own 16-bit copy of the
  normalized input, and the loss keeps an fp32 log-softmax and allocates two fp32 gradients for it
  at the start of backward. ``"16bit"`` is ``Plan.params16`` (FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 sharded masters, 16-bit
  gathered parameters, no autocast) and how Megatron-LM, torchtitan and llm-foundry run: 16-bit
  activations throughout, so every saved tensor, pipeline send and tensor-parallel collective is 2
  bytes per element. Under ``precision="fp32"`` plans both mean plain fp32.
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
  element once; otherwise (shardwise's ``F.cross_entropy``, in fp32 under autocast) the fp32
  log-softmax is kept (the logits are freed once the loss is computed; on the last pipeline stage
  the schedule's forward cache holds them too) and, at the start of backward, ``nll_loss``'s and
  ``log_softmax``'s fp32 gradients coexist with it: 12 bytes per element at the peak.
- ``loss_parallel``: under tensor parallelism the logits stay split over the vocabulary and the
  cross-entropy is vocabulary-parallel (Megatron-LM, torchtitan's ``loss_parallel``); otherwise
  (shardwise's default TP styles) the LM head's output is all-gathered and every tensor-parallel rank
  holds and differentiates the whole ``[tokens, vocab]`` logits (the chunked loss is
  vocabulary-parallel either way).
- ``chunked_loss`` (``Plan.chunked_loss``): the LM head and the cross-entropy run per chunk of
  tokens (as many as make a chunk's logits the size of the head's input), each chunk's backward in
  the same pass, so only one chunk's logits and their gradient exist at a time, and the head's
  input gradient is kept for backward instead; the same FLOPs, a launch cost per chunk.
- ``sharded_grad_accumulation`` (``Plan.sharded_accumulation``): with ZeRO-2/3 and several
  microbatches, reduce-scatter every microbatch into the sharded gradient (FSDP1, DeepSpeed, and
  shardwise with the option); otherwise shardwise's FSDP2 path (``set_requires_gradient_sync(False)``)
  accumulates the unsharded gradient and reduce-scatters once (one more full-size gradient buffer
  in memory, ``m - 1`` fewer reduce-scatters).
- ``grad_reduce_overlap``: DDP/FSDP reduce gradients bucket by bucket while backward runs;
  Megatron-LM before 2023 all-reduced them after backward (nothing hidden).
- ``fused_softmax``: eager attention's scaling, causal mask and softmax run as one kernel
  (Megatron-LM's scaled-masked-softmax); otherwise (a model's own eager attention under shardwise)
  as separate torch operators, each a pass over the ``s^2`` scores. Irrelevant for fused attention.
- ``fused_grad_accumulation``: the weight-gradient GEMM adds into the fp32 accumulated gradient
  in its epilogue (Megatron-LM's ``gradient_accumulation_fusion``, 2022), so a microbatch after
  the first costs no separate pass over the gradients; otherwise (autograd's ``AccumulateGrad``,
  FSDP's unsharded accumulation, Megatron-LM 2021's ``main_grad.add_``) each one reads and writes
  them once more.
- ``async_tp``: tensor-parallel collectives overlap the matmuls they feed (torchtitan's async TP);
  otherwise they are on the critical path.
- ``pp_scatter_gather``: each tensor-parallel rank sends only its ``1/t`` slice of a pipeline
  stage's output over its own NIC and the receiving stage all-gathers it over NVLink (Megatron-LM's
  scatter/gather optimization, Narayanan et al. 2021 sec. 4.1; with sequence parallelism the
  activation is already split); otherwise every TP rank sends the whole activation.
- ``sp_saves_shard``: under sequence parallelism the column-parallel layers keep only their input's
  sequence shard for backward and all-gather it again there, behind the data-gradient GEMM
  (Megatron-LM, Korthikanti et al. 2022 sec. 4.2.2); otherwise (torch's DTensor sequence
  parallelism: shardwise, torchtitan) they keep the all-gathered, full-size input.
- ``zero3_unit``: what ZeRO-3 gathers at a time. ``"block"``: FSDP's unit, one transformer block
  (FSDP1/FSDP2 wrapping each block, as shardwise, torchtitan and llm-foundry do), the next one
  prefetched; ``"linear"``: DeepSpeed's per-module fetch, one module's weights at a time (a
  collective per module: q/k/v, output projection, the MLP's matrices and the norms), the next
  one prefetched.
- ``context_parallel``: ``c`` consecutive data-parallel ranks split each sequence (Liu et al.
  2023's ring attention; Llama 3's all-gathered keys and values): a sample of the model
  statistics is then a ``1/c`` slice attending to the whole sequence
  (``transformer_stats(..., seq=S/c, context=S)``), FSDP and the gradient reduction run over all
  data-parallel ranks, and every layer all-gathers the keys and values of its ``c`` slices in
  forward (reduce-scatters their gradients in backward), behind the attention it feeds.
- ``linear_dtype``: ``"fp8"`` (``Plan.precision="fp8"``) runs the linear layers of the blocks at
  the FP8 tensor-core rate (torchao float8 training, ``fp8_recipe`` tensorwise or rowwise) plus
  the casts' memory traffic; the LM head, the attention core and every layer whose shape is not a
  multiple of 16 stay in bf16. ``fp8_all_gather``: FSDP2 all-gathers those weights in FP8
  (torchao's ``enable_fsdp_float8_all_gather``, tensorwise only). ``""`` runs them in the plan's
  precision.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardwise.errors import ConfigError
from shardwise.layout import Plan

PRECISION_POLICIES = ("autocast", "16bit")
SELECTIVE_MODES = ("matmuls", "op", "attention", "layer")
FP8_RECIPES = ("tensorwise", "rowwise")


@dataclass(frozen=True)
class RunPolicy:
    """How the step runs (see the module doc); ``RunPolicy()`` is shardwise's own Trainer."""

    precision: str = "autocast"
    selective: str = "matmuls"
    fused_loss: bool = False
    loss_parallel: bool = False
    chunked_loss: bool = False
    sharded_grad_accumulation: bool = False
    grad_reduce_overlap: bool = True
    fused_grad_accumulation: bool = False
    fused_softmax: bool = False
    async_tp: bool = False
    pp_scatter_gather: bool = False
    sp_saves_shard: bool = False
    zero3_unit: str = "block"
    context_parallel: int = 1
    linear_dtype: str = ""
    fp8_recipe: str = "tensorwise"
    fp8_all_gather: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_POLICIES:
            raise ConfigError(
                f"precision policy {self.precision!r} is unknown",
                hint="use autocast (shardwise's Trainer) or 16bit (Megatron-LM, torchtitan, llm-foundry)",
            )
        if self.selective not in SELECTIVE_MODES:
            raise ConfigError(
                f"selective recompute mode {self.selective!r} is unknown",
                hint=f"use one of {', '.join(SELECTIVE_MODES)}",
            )
        if self.zero3_unit not in ("block", "linear"):
            raise ConfigError(
                f"zero3_unit {self.zero3_unit!r} is unknown", hint="use block (FSDP) or linear (DeepSpeed)"
            )
        if (
            isinstance(self.context_parallel, bool)
            or not isinstance(self.context_parallel, int)
            or self.context_parallel < 1
        ):
            raise ConfigError(
                f"context_parallel={self.context_parallel!r} must be a positive integer",
                hint="1 without context parallelism",
            )
        if self.linear_dtype not in ("", "fp8"):
            raise ConfigError(
                f"linear_dtype {self.linear_dtype!r} is unknown", hint='use "" (the plan\'s precision) or "fp8"'
            )
        if self.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(f"fp8_recipe {self.fp8_recipe!r} is unknown", hint=f"use one of {', '.join(FP8_RECIPES)}")

    @classmethod
    def shardwise(cls) -> RunPolicy:
        """shardwise's Trainer without its runtime options: autocast over fp32 parameters, FSDP2,
        its matmul-saving selective policy (the plan's options are folded in by :meth:`applied`)."""
        return cls()

    def applied(self, plan: Plan) -> RunPolicy:
        """This policy with ``plan``'s runtime options on (the policy every cost term reads):
        ``params16`` -> 16-bit parameters and activations, ``chunked_loss``,
        ``sharded_accumulation``, ``precision="fp8"`` -> FP8 linears of ``plan.fp8_recipe``."""
        changes: dict[str, Any] = {}
        if plan.params16 and self.precision != "16bit":
            changes["precision"] = "16bit"
        if plan.chunked_loss and not self.chunked_loss:
            changes["chunked_loss"] = True
        if plan.sharded_accumulation and not self.sharded_grad_accumulation:
            changes["sharded_grad_accumulation"] = True
        if plan.precision == "fp8":
            changes["linear_dtype"] = "fp8"
            changes["fp8_recipe"] = plan.fp8_recipe
        return replace(self, **changes) if changes else self

    @classmethod
    def sixteen_bit(cls, **overrides: object) -> RunPolicy:
        """Megatron-LM / torchtitan / llm-foundry: 16-bit activations, fused loss, sharded
        accumulation under ZeRO-2/3 (``overrides`` change single fields)."""
        base = {"precision": "16bit", "selective": "attention", "fused_loss": True, "sharded_grad_accumulation": True,
                "pp_scatter_gather": True, "fused_softmax": True, "loss_parallel": True}
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

    @property
    def fp8(self) -> bool:
        return self.linear_dtype == "fp8"


def compute_precision(precision: str) -> str:
    """The dtype of everything but the FP8 linears: ``bf16`` under ``precision="fp8"``."""
    return "bf16" if precision == "fp8" else precision


__all__ = ["FP8_RECIPES", "PRECISION_POLICIES", "RunPolicy", "SELECTIVE_MODES", "compute_precision"]
