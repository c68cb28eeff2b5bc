"""Compose the parallel techniques of a :class:`~shardwise.plan.Plan` on one device mesh.

The order is fixed, and each step depends on the previous one:

1. **pipeline split** first: it decides which layers this rank owns; everything after works on the
   local stage only;
2. **tensor parallel** next: it replaces weights by DTensors sharded over the ``tp`` mesh, which
   activation checkpointing, compile and FSDP must see;
3. **activation checkpointing** wraps the (TP-sharded) blocks, so recomputation replays the TP
   collectives too;
4. **compile** (optional) traces the checkpointed, TP-sharded blocks;
5. **FSDP or DDP** last: data-parallel wrapping must see the final parameters (FSDP shards the TP
   DTensors again over ``dp_shard``, making 2-D DTensors; DDP registers hooks on the final params).

Each technique lives in its own module as ``apply_x(model, mesh, *, options) -> model``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.annotate import annotated_plan
from shardwise.parallel.checkpointing import apply_checkpointing
from shardwise.parallel.cp import ContextParallel, check_context_parallel, takes_attention_mask
from shardwise.parallel.ddp import DDPOptions, apply_ddp
from shardwise.parallel.ep import ExpertMeshes, apply_ep, build_expert_meshes, check_expert_parallel
from shardwise.parallel.fsdp import FSDPOptions, apply_expert_units, apply_fsdp, apply_replicate, build_optimizer, find_blocks
from shardwise.parallel.mesh import Meshes
from shardwise.parallel.pipeline import PipelineOptions, build_pipeline, check_pipeline
from shardwise.parallel.tp import TPOptions, TPPlan, apply_tp, derive_tp_plan, validate_tp
from shardwise.layout import Plan
from shardwise.plan.support import runtime_conflict


class PipelineRunner(Protocol):
    """Runs one optimizer step's forward and backward over all microbatches of a pipeline."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward + backward of the batch; returns the batch's mean (unscaled) loss on every rank."""
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
    extras: dict[str, Any] = field(default_factory=dict)
    context_parallel: ContextParallel | None = None

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
        build the optimizer through here rather than from ``parameters()`` directly."""
        zero1 = self.plan.zero == 1 and self.plan.shard > 1
        return build_optimizer(self.parameters(), factory,
                               zero_group=self.meshes.shard.get_group() if zero1 else None, **defaults)

    def set_loss_scale(self, loss_scale: float) -> None:
        """Tell modules with an ``aux_loss_scale`` (MoE load-balancing losses, which reach their
        router through the output, :mod:`shardwise.models.moe`) what the step's loss is multiplied by
        before backward (``1/accumulation`` times the fp16 loss scale); a pipeline also divides each
        microbatch's loss by the number of microbatches."""
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

    @contextlib.contextmanager
    def step_context(self) -> Iterator[None]:
        """Where a step's forward, loss and backward must run: torch's ``loss_parallel()`` when the LM
        head's logits stay vocabulary-sharded (TPOptions.loss_parallel), and context parallel's
        split attention (recomputation in backward included). A no-op otherwise."""
        with contextlib.ExitStack() as stack:
            if self.extras.get("loss_parallel"):
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            if self.context_parallel is not None:
                stack.enter_context(self.context_parallel.split_attention())
            yield

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Turn the data-parallel gradient reduction off for non-boundary accumulation micro-steps.

        DDP: ``no_sync()`` (gradients accumulate locally, the all-reduce happens on the boundary
        step). FSDP2: ``set_requires_gradient_sync(False)`` (no reduce-scatter until the boundary).
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
        for m in fsdp_modules:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in fsdp_modules:
                m.set_requires_gradient_sync(True, recurse=False)


def validate(model: nn.Module, plan: Plan, *, tp: TPOptions | None = None, pipeline: PipelineOptions | None = None) -> TPPlan | None:
    """Check ``plan`` against ``model`` without any communication; return the TP plan to apply.

    Call it before building meshes so bad input fails before any process-group work
    (:func:`parallelize` calls it again first thing).
    """
    conflict = runtime_conflict(plan)  # e.g. zero=1 with tp or pp
    if conflict is not None:
        raise conflict
    check_pipeline(model, plan, options=pipeline)  # too many stages, tied weights across stages, ...
    check_context_parallel(model, plan.cp)  # attention inside torch modules, no position_ids
    check_expert_parallel(model, plan.ep)  # no MoE layers, ep not dividing the experts
    if not plan.tp_enabled:
        return None
    options = tp or TPOptions()
    if options.plan is not None:
        tp_plan = TPPlan.of(options.plan)
    else:
        tp_plan = annotated_plan(model, tp=plan.tp) or derive_tp_plan(model, tp=plan.tp)
    if plan.ep_enabled:
        # Expert parallel owns the experts' tensors (split by expert over ep): TP leaves them whole,
        # so the tp ranks of one expert-parallel rank hold, and compute, the same experts.
        tp_plan = TPPlan(tuple((pattern, style) for pattern, style in tp_plan.entries if style != "experts"))
    validate_tp(model, tp_plan, tp=plan.tp)
    styles = set(tp_plan.as_dict().values())
    if plan.sequence_parallel and not {"sequence_parallel", "attention_input"} <= styles:
        # Rowwise outputs would be left sequence-sharded with nothing to gather them back.
        raise ConfigError(
            f"plan {plan}: sequence parallel needs norm ('sequence_parallel') and 'attention_input' entries in the TP plan",
            hint="use the derived plan (no annotations), add those entries, or drop sp",
        )
    return tp_plan


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
) -> ParallelModel:
    """Apply ``plan`` to ``model`` (in place) in the fixed order described in the module doc.

    With ``plan.pp > 1``: ``loss_fn(output, target)`` (mean over its microbatch) runs on the last
    stage; it can also be set later as ``pm.pipeline.loss_fn``. ``pipeline`` says where to cut.
    """
    tp_plan = validate(model, plan, tp=tp, pipeline=pipeline)
    cp = ContextParallel(meshes.cp, pass_attention_mask=takes_attention_mask(model)) if plan.cp_enabled else None
    experts = build_expert_meshes(plan, meshes.root) if plan.ep_enabled else None
    local = {"tp_plan": tp_plan, "ddp": ddp, "tp": tp, "fsdp": fsdp, "context_parallel": cp, "experts": experts}
    runner = None
    if plan.pp_enabled:
        # Step 1: the split; the TP plan (derived on the whole model, names kept) and steps 2-5
        # then apply to each local stage.
        module, runner = build_pipeline(
            model, plan, meshes.pp, loss_fn=loss_fn, options=pipeline,
            wrap_stage=lambda stage: apply_local(stage, plan, meshes, **local),
        )
    else:
        module = apply_local(model, plan, meshes, **local)
    extras: dict[str, Any] = {}
    if tp_plan is not None:
        extras.update(tp_plan=tp_plan, loss_parallel=(tp or TPOptions()).loss_parallel)
    return ParallelModel(module=module, plan=plan, meshes=meshes, pipeline=runner, extras=extras, context_parallel=cp)


def apply_local(
    model: nn.Module,
    plan: Plan,
    meshes: Meshes,
    *,
    tp_plan: TPPlan | None,
    ddp: DDPOptions | None = None,
    tp: TPOptions | None = None,
    fsdp: FSDPOptions | None = None,
    context_parallel: ContextParallel | None = None,
    experts: ExpertMeshes | None = None,
) -> nn.Module:
    """Steps 2-5 of the module doc on one module (the whole model, or one pipeline stage)."""
    if tp_plan is not None:
        apply_tp(model, meshes.tp, plan=tp_plan, sequence_parallel=plan.sequence_parallel,
                 loss_parallel=(tp or TPOptions()).loss_parallel)
    # Expert parallel shards the experts' weights like TP shards linear layers: before
    # recomputation (which replays the all-to-alls) and before data-parallel wrapping.
    expert_units = apply_ep(model, experts.ep) if experts is not None else []
    # a recomputed block must split its attention as its forward did
    apply_checkpointing(model, mode=plan.recompute,
                        recompute_context=context_parallel.recompute_context if context_parallel is not None else None)
    if plan.compile:
        for block in find_blocks(model) or [model]:
            block.compile()
    # The plan decides precision and offload; FSDPOptions only what it leaves open.
    sharding = {"precision": plan.precision, "cpu_offload": plan.cpu_offload, "options": fsdp or FSDPOptions()}
    if experts is not None:  # the experts first: their own units over the expert-data-parallel ranks
        apply_expert_units(expert_units, experts.edp, stage=plan.zero, **sharding)
    if plan.zero >= 2:
        # HSDP when both data-parallel degrees are > 1: shard inside a row, all-reduce across rows.
        # Context-parallel ranks hold the same weights: they are folded into the shard dimension.
        mesh = meshes.hsdp if plan.dp > 1 else meshes.shard
        return apply_fsdp(model, mesh, stage=plan.zero, **sharding)
    if plan.token_parallel_size > 1:
        if tp_plan is not None or plan.pp_enabled or experts is not None:
            # DDP cannot wrap DTensor parameters; FSDP2's replicate all-reduces them the same way.
            # Under pipelining DDP's reducer also miscounts the parameters (torch's metadata-
            # inference pass runs a backward outside no_sync), while replicate is supported there.
            return apply_replicate(model, meshes.tokens, **sharding)
        # ZeRO-1 keeps DDP's all-reduce; the optimizer-state sharding is in build_optimizer.
        return apply_ddp(model, meshes.tokens, options=ddp or DDPOptions())
    return model
