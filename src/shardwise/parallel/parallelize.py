"""Compose the parallel techniques of a :class:`~shardwise.plan.Plan` on one device mesh.

The order is fixed, and each step depends on the previous one:

1. **pipeline split** first: it decides which layers this rank owns; everything after works on the
   local stage only;
1b. **FP8 conversion** (``precision="fp8"``, :mod:`shardwise.parallel.fp8`): each stage's Linear
   layers become torchao's ``Float8Linear``, which TP's float8 styles and FSDP's FP8 all-gather
   must see;
2. **tensor parallel** next: it replaces weights by DTensors sharded over the ``tp`` mesh, which
   activation checkpointing, compile and FSDP must see;
3. **activation checkpointing** wraps the (TP-sharded) blocks, so recomputation replays the TP
   collectives too;
4. **compile** (optional, :mod:`shardwise.parallel.compile`) traces each checkpointed, TP-sharded
   block (torchtitan's order); FSDP's hooks stay outside the graphs;
5. **FSDP or DDP** last: data-parallel wrapping must see the final parameters (FSDP shards the TP
   DTensors again over ``dp_shard``, making 2-D DTensors; DDP registers hooks on the final params).

Each technique lives in its own module as ``apply_x(model, mesh, *, options) -> model``.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.chunked_loss import ChunkedLoss, install_chunked_head
from shardwise.parallel.checkpointing import apply_checkpointing
from shardwise.parallel.compile import apply_compile
from shardwise.parallel.cp import ContextParallel, takes_attention_mask, takes_position_ids
from shardwise.parallel.ddp import DDPOptions, apply_ddp
from shardwise.parallel.ep import ExpertMeshes, apply_ep, build_expert_meshes
from shardwise.parallel.fp8 import Fp8Options, apply_fp8, compute_precision, precompute_scales_before_forward
from shardwise.parallel.fsdp import FSDPOptions, apply_expert_units, apply_fsdp, apply_replicate, build_optimizer
from shardwise.parallel.mesh import Meshes
from shardwise.parallel.pipeline.schedule import PipelineOptions, build_pipeline
from shardwise.parallel import micro_step
from shardwise.parallel.micro_step import MicroBatch, StepLoss
from shardwise.parallel.reduction import LossReduction, TokenShare
from shardwise.parallel.tp.apply import apply_tp
from shardwise.parallel.tp.styles import TPOptions, TPStyles
from shardwise.parallel.validation import validate
from shardwise.layout import Plan

if TYPE_CHECKING:
    from shardwise.checkpoint.hf_load import LoadStats  # set by the loader, a layer above


class PipelineRunner(Protocol):
    """Runs one optimizer step's forward and backward over all microbatches of a pipeline."""

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        loss_scale: float = 1.0,
        tokens: TokenShare | None = None,
        **model_kwargs: Any,
    ) -> torch.Tensor:
        """Forward + backward of the batch; returns the batch's mean (unscaled) loss on every rank
        (with ``tokens``: the mean over its valid targets, each microbatch weighted by its share)."""
        ...


@dataclass
class ParallelModel:
    """What :func:`parallelize` returns.

    ``module`` is what this rank runs and what the optimizer's parameters come from: the wrapped
    model, or with pipeline parallelism the local stage module(s). ``pipeline`` is set when
    ``plan.pp > 1``; then a training step goes through ``pipeline.step`` instead of ``module(x)``.
    """

    module: nn.Module
    plan: Plan
    meshes: Meshes
    pipeline: PipelineRunner | None = None
    context_parallel: ContextParallel | None = None
    lm_head: nn.Module | None = None  # plan.chunked_loss: the head the loss applies chunk by chunk
    tp_styles: TPStyles | None = None  # the tensor-parallel styles applied (None without tp)
    loss_parallel: bool = False  # the LM head's logits stay vocabulary-sharded into the loss (TPOptions.loss_parallel)
    load: LoadStats | None = None  # loaded from a Hugging Face directory: what this rank read (checkpoint.hf_load)
    lora_config: dict[str, Any] | None = None  # its PEFT adapters' config (checkpoints' base reference, exports)
    _aux_scale: float | None = field(default=None, repr=False)  # what set_loss_scale last set

    def forward_backward(
        self,
        micro_batches: Sequence[MicroBatch],
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        device: torch.device | str,
        reduction: LossReduction = LossReduction(),
        loss_scale: float = 1.0,
        precision: str | None = None,
        load: Callable[[MicroBatch], MicroBatch] | None = None,
    ) -> StepLoss:
        """Forward and backward of one optimizer step's micro-batches, weighted so that the reduced
        gradient is one process's; returns the step's loss share (a device tensor) and weights. The one
        micro-step of the Trainer, ``prepare()`` and ``shardwise verify``:
        :func:`shardwise.parallel.micro_step.forward_backward` states the math and communication."""
        return micro_step.forward_backward(self, micro_batches, loss_fn=loss_fn, reduction=reduction, device=device,
                                           loss_scale=loss_scale, precision=precision, load=load)

    @property
    def extras(self) -> dict[str, Any]:
        """Deprecated (read the typed fields): ``tp_styles`` (as ``"tp_plan"``), ``loss_parallel``, ``load``
        and ``lora_config`` as a dict of those that are set, as ``extras`` used to hold them."""
        found = {"tp_plan": self.tp_styles, "loss_parallel": self.loss_parallel if self.tp_styles is not None else None,
                 "load": self.load, "lora_config": self.lora_config}
        return {k: v for k, v in found.items() if v is not None}

    @property
    def tp_plan(self) -> TPStyles | None:
        """Deprecated: :attr:`tp_styles`."""
        warnings.warn(
            "ParallelModel.tp_plan is deprecated: use ParallelModel.tp_styles", DeprecationWarning, stacklevel=2
        )
        return self.tp_styles

    def loss_for(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
        """The loss to call on ``module``'s outputs: :func:`training_loss` of ``loss_fn`` for this
        plan (the Trainer's step and evaluation call it; the pipeline's is set by
        :func:`parallelize`). Call it on the ``loss_fn`` of your own loop."""
        return training_loss(loss_fn, self.plan, head=self.lm_head)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def tied_copies(self) -> list[nn.Parameter]:
        """Parameters that are this rank's second copy of a weight another pipeline stage also
        holds (tied embeddings): trained like the others, but left out of the gradient norm."""
        copies = getattr(self.pipeline, "tied_copies", None)
        return copies() if copies is not None else []

    def build_optimizer(self, factory: Callable[..., torch.optim.Optimizer], **defaults: Any) -> torch.optim.Optimizer:
        """``factory(self.parameters(), **defaults)``; ``factory`` is an optimizer class or a
        callable taking the parameters (``lambda p: AdamW(p, lr=1e-3)``). With ZeRO-1 it is wrapped
        in ``ZeroRedundancyOptimizer`` over ``dp_shard`` (each rank keeps ~1/shard of the state), so
        build the optimizer through here rather than from ``parameters()`` directly.

        Only trainable parameters go in (``requires_grad``): a frozen base (LoRA) gets no optimizer
        state, and ZeRO-1 partitions (and broadcasts) only the trainable ones."""
        zero1 = self.plan.zero == 1 and self.plan.shard > 1
        trainable = [p for p in self.parameters() if p.requires_grad]
        if not trainable:
            raise ConfigError("the model has no trainable parameters (every parameter has requires_grad=False)",
                              hint="unfreeze some parameters, or add LoRA adapters (peft.get_peft_model)")
        return build_optimizer(trainable, factory,
                               zero_group=self.meshes.shard.get_group() if zero1 else None, **defaults)

    def set_loss_scale(self, loss_scale: float) -> None:
        """Tell modules with an ``aux_loss_scale`` (MoE load-balancing losses, which reach their
        router through the output, :mod:`shardwise.models.moe`) what the step's loss is multiplied by
        before backward (``1/accumulation`` times the fp16 loss scale); a pipeline also divides each
        microbatch's loss by the number of microbatches."""
        if loss_scale == self._aux_scale:  # it walks every module: only when the scale changes
            return
        self._aux_scale = loss_scale
        factor = loss_scale / (self.plan.microbatches if self.pipeline is not None else 1)
        for module in self.module.modules():
            if hasattr(module, "aux_loss_scale"):
                module.aux_loss_scale = factor

    def shard_batch(self, inputs: Any, targets: Any) -> tuple[Any, Any, dict[str, Any]]:
        """What this rank feeds the model: ``(inputs, targets, keyword arguments)``. The batch as it
        is, except under context parallelism: this rank's zig-zag chunks of the sequence and their
        ``position_ids`` (:mod:`shardwise.parallel.cp`)."""
        if self.context_parallel is None:
            return inputs, targets, {}
        return self.context_parallel.shard_batch(inputs, targets)

    def local_targets(self, targets: Any) -> Any:
        """The targets as this rank's loss sees them (its context-parallel chunks; the batch's
        targets otherwise), for counting valid targets before a step (:mod:`shardwise.parallel.reduction`)."""
        return targets if self.context_parallel is None else self.context_parallel.local_targets(targets)

    @contextlib.contextmanager
    def step_context(self) -> Iterator[None]:
        """Where a step's forward, loss and backward must run: torch's ``loss_parallel()`` when the LM
        head's logits stay vocabulary-sharded (TPOptions.loss_parallel), and context parallel's
        split attention (recomputation in backward included). A no-op otherwise."""
        with contextlib.ExitStack() as stack:
            if self.loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            if self.context_parallel is not None:
                stack.enter_context(self.context_parallel.split_attention())
            yield

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Turn the data-parallel gradient reduction off for non-boundary accumulation micro-steps.

        DDP: ``no_sync()`` (gradients accumulate locally, the all-reduce happens on the boundary
        step). FSDP2: ``set_requires_gradient_sync(False)`` (no reduce-scatter until the boundary:
        each rank holds the unsharded gradients of its units until then).

        ``plan.sharded_accumulation`` (ZeRO-2/3): every micro-batch reduce-scatters its gradients
        into the sharded gradient, so no unsharded gradient outlives its unit's backward; under
        HSDP the all-reduce across replicas waits for the boundary (``set_requires_all_reduce``:
        FSDP2 sums the reduce-scattered shards meanwhile). ``k`` reduce-scatters per step instead
        of 1, the same sum: exact.
        """
        if enabled:
            yield
            return
        module = self.module
        if hasattr(module, "no_sync"):
            with module.no_sync():
                yield
            return
        fsdp_modules = [m for m in module.modules() if hasattr(m, "set_requires_gradient_sync")]
        sharded = self.plan.sharded_accumulation
        if sharded and not self.plan.hsdp_enabled:
            yield
            return
        for m in fsdp_modules:
            if sharded:
                m.set_requires_all_reduce(False, recurse=False)
            else:
                m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in fsdp_modules:
                m.set_requires_gradient_sync(True, recurse=False)


class _AutocastLoss:
    """``loss_fn`` under ``torch.autocast`` (see :func:`training_loss`)."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], dtype: torch.dtype) -> None:
        self.loss_fn, self.dtype = loss_fn, dtype

    def __call__(self, output: Any, targets: Any) -> torch.Tensor:
        device = targets.device.type if isinstance(targets, torch.Tensor) else "cpu"
        with torch.autocast(device, dtype=self.dtype):
            return self.loss_fn(output, targets)


def training_loss(
    loss_fn: Callable[[Any, Any], torch.Tensor], plan: Plan, *, head: nn.Module | None
) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` as ``plan`` runs it: with ``chunked_loss`` a
    :class:`~shardwise.parallel.chunked_loss.ChunkedLoss` over ``head`` (the model returns the
    head's input while training; the loss applies the head and ``loss_fn``'s cross-entropy chunk by
    chunk); with ``params16`` under autocast (the model runs without it, in its 16-bit parameters'
    dtype, so its 16-bit logits reach the loss; autocast computes the cross-entropy in fp32, as
    torchtitan's loss upcasts them). Idempotent."""
    if isinstance(loss_fn, (ChunkedLoss, _AutocastLoss)):
        return loss_fn
    if plan.chunked_loss and head is not None:
        loss_fn = ChunkedLoss(head, loss_fn)
    if plan.params16:
        loss_fn = _AutocastLoss(loss_fn, torch.float16 if plan.precision == "fp16" else torch.bfloat16)
    return loss_fn


def parallelize(
    model: nn.Module,
    plan: Plan,
    meshes: Meshes,
    *,
    ddp: DDPOptions | None = None,
    tp: TPOptions | None = None,
    fsdp: FSDPOptions | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    pipeline: PipelineOptions | None = None,
    fp8: Fp8Options | None = None,
) -> ParallelModel:
    """Apply ``plan`` to ``model`` (in place) in the fixed order described in the module doc.

    With ``plan.pp > 1``: ``loss_fn(output, target)`` (mean over its microbatch) runs on the last
    stage; it can also be set later as ``pm.pipeline.loss_fn``. ``pipeline`` says where to cut.
    ``fp8``: how ``precision="fp8"`` converts (:class:`~shardwise.parallel.fp8.Fp8Options`).
    """
    tp_styles = validate(model, plan, tp=tp, pipeline=pipeline)
    # Before the split (the last stage keeps the head object) and before TP (which gives a chunked
    # head its own style): the head passes its input through while training, the loss applies it.
    head = install_chunked_head(model) if plan.chunked_loss else None
    if loss_fn is not None:
        loss_fn = training_loss(loss_fn, plan, head=head)
    cp = (
        ContextParallel(
            meshes.cp, pass_attention_mask=takes_attention_mask(model), pass_position_ids=takes_position_ids(model)
        )
        if plan.cp_enabled
        else None
    )
    experts = build_expert_meshes(plan, meshes.root) if plan.ep_enabled else None
    local = {
        "tp_styles": tp_styles,
        "ddp": ddp,
        "tp": tp,
        "fsdp": fsdp,
        "context_parallel": cp,
        "experts": experts,
        "fp8": fp8,
    }
    runner = None
    if plan.pp_enabled:
        # Step 1: the split; the TP styles (derived on the whole model, names kept) and steps 2-5
        # then apply to each local stage.
        module, runner = build_pipeline(
            model, plan, meshes.pp, loss_fn=loss_fn, options=pipeline,
            wrap_stage=lambda stage: apply_local(stage, plan, meshes, **local),
        )
    else:
        module = apply_local(model, plan, meshes, **local)
    if cp is not None:
        cp.hook_models(module)  # positions and mask for Hugging Face models inside any wrapper (shardwise.parallel.cp)
    return ParallelModel(
        module=module,
        plan=plan,
        meshes=meshes,
        pipeline=runner,
        context_parallel=cp,
        lm_head=head,
        tp_styles=tp_styles,
        loss_parallel=tp_styles is not None and (tp or TPOptions()).loss_parallel,
    )


def apply_local(
    model: nn.Module,
    plan: Plan,
    meshes: Meshes,
    *,
    tp_styles: TPStyles | None,
    ddp: DDPOptions | None = None,
    tp: TPOptions | None = None,
    fsdp: FSDPOptions | None = None,
    context_parallel: ContextParallel | None = None,
    experts: ExpertMeshes | None = None,
    fp8: Fp8Options | None = None,
) -> nn.Module:
    """Steps 1b-5 of the module doc on one module (the whole model, or one pipeline stage)."""
    if plan.precision == "fp8":
        apply_fp8(model, recipe=plan.fp8_recipe, options=fp8, device=meshes.root.device_type, fsdp=plan.zero >= 2)
    if tp_styles is not None:
        apply_tp(model, meshes.tp, styles=tp_styles, sequence_parallel=plan.sequence_parallel,
                 loss_parallel=(tp or TPOptions()).loss_parallel)
    # Expert parallel shards the experts' weights like TP shards linear layers: before
    # recomputation (which replays the all-to-alls) and before data-parallel wrapping.
    expert_units = apply_ep(model, experts.ep) if experts is not None else []
    # a recomputed block must split its attention as its forward did
    apply_checkpointing(model, mode=plan.recompute,
                        recompute_context=context_parallel.recompute_context if context_parallel is not None else None)
    if plan.compile:
        apply_compile(model, device_type=meshes.root.device_type)
    # The plan decides precision and offload; FSDPOptions only what it leaves open. Under fp8,
    # what is not converted computes in the FP8 options' high precision (bf16 unless told).
    sharding = {
        "precision": compute_precision(plan.precision, fp8),
        "cpu_offload": plan.cpu_offload,
        "options": fsdp or FSDPOptions(),
    }
    if plan.params16 and ddp is not None and ddp.comm_hook != "none":
        raise ConfigError(
            f"plan params16 runs data parallelism through FSDP2's replicate, which has no DDP comm hook "
            f"(comm_hook={ddp.comm_hook!r})",
            hint="drop params16, or the comm hook (gradients are reduced in fp32)",
        )
    if experts is not None:  # the experts first: their own units over the expert-data-parallel ranks
        apply_expert_units(expert_units, experts.edp, stage=plan.zero, **sharding)
    if plan.zero >= 2:
        # HSDP when both data-parallel degrees are > 1: shard inside a row, all-reduce across rows.
        # Context-parallel ranks hold the same weights: they are folded into the shard dimension.
        mesh = meshes.hsdp if plan.dp > 1 else meshes.shard
        apply_fsdp(model, mesh, stage=plan.zero, **sharding)
        if plan.precision == "fp8":  # FP8 all-gather: every weight's scale in one all-reduce per forward
            precompute_scales_before_forward(model)
        return model
    if plan.token_parallel_size > 1:
        if tp_styles is not None or plan.pp_enabled or experts is not None or plan.params16:
            # DDP cannot wrap DTensor parameters; FSDP2's replicate all-reduces them the same way.
            # Under pipelining DDP's reducer also miscounts the parameters (torch's metadata-
            # inference pass runs a backward outside no_sync), while replicate is supported there.
            # params16: replicate's mixed precision is torch's 16-bit storage for compute.
            return apply_replicate(model, meshes.tokens, **sharding)
        # ZeRO-1 keeps DDP's all-reduce; the optimizer-state sharding is in build_optimizer.
        return apply_ddp(model, meshes.tokens, options=ddp or DDPOptions())
    if plan.params16:
        # One token-parallel rank (one process, tp or pp alone): replicate over that one rank
        # communicates nothing and gives the same 16-bit compute copies of the fp32 masters.
        return apply_replicate(model, meshes.tokens, **sharding)
    return model
