"""Pipeline parallelism through ``torch.distributed.pipelining``.

The model is cut into ``S = pp * virtual_stages`` stages (:mod:`shardwise.parallel.pipeline.split`);
pipeline rank ``r`` owns stages ``r, r + pp, r + 2 pp, ...`` (the *looped* layout that
interleaved 1F1B expects; with ``virtual_stages = 1`` simply stage ``r``). Each local stage module
becomes a :class:`torch.distributed.pipelining.PipelineStage` on the ``pp`` mesh's process group,
and one schedule drives them:

- ``gpipe`` — all forwards, then all backwards (Huang et al. 2019): activations of all ``m``
  microbatches are alive at once;
- ``1f1b`` — after a warm-up of ``p - 1 - r`` forwards, alternate one forward and one backward
  (PipeDream-Flush, Narayanan et al. 2021): at most ``p`` microbatches' activations per rank;
- ``interleaved_1f1b`` — ``v`` virtual stages per rank (Megatron-LM, Narayanan et al. 2021).

Idle ("bubble") fraction of a rank with ``m`` equal microbatches: ``(p - 1) / (m + p - 1)`` for
GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` for interleaved 1F1B.

Communication: per microbatch, one point-to-point send/recv of the activation forward and of its
gradient backward across each stage boundary (``2 (S - 1) m`` messages per step); plus one
broadcast of the scalar loss over the ``pp`` group so every rank reports it. Trunk stages also get
the microbatch's inputs as a keyword argument (torch's schedules split keyword arguments into
microbatches and hand them to every stage; no communication), from which the model's own forward
recomputes what its blocks need. A weight held by two stages (tied embeddings) costs one more
all-reduce of its gradient between their ranks per step (:mod:`shardwise.parallel.pipeline.ties`).

Loss and gradient scale. The schedule computes ``loss_fn(output_mb, target_mb)`` on the last
stage for each microbatch ``mb``; backward runs on ``loss_fn(...) * loss_scale / m`` (we tell the
schedule ``scale_grads=False`` and scale the loss instead, so gradients that accumulate over
several steps are not divided again). With a mean-reducing loss and equal microbatches the
gradient is exactly that of ``loss_scale * loss_fn(model(x), y)`` on the whole batch, and the
reported loss ``mean_mb loss_fn(...)`` equals the single-process loss. Under token reduction
(``tokens=``, :mod:`shardwise.parallel.reduction`) microbatch ``mb`` weighs
``loss_scale * n_mb * D / N`` instead (``n_mb`` its valid targets, counted on the last stage from
the target it is handed), and the reported loss is the mean over the batch's valid targets,
``sum_mb n_mb loss_mb / sum_mb n_mb``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardwise.errors import ConfigError
from shardwise.parallel.pipeline.split import Balance, Tie, check_ties, split_model, stage_ties
from shardwise.parallel.pipeline.stage import TrunkStage
from shardwise.parallel.pipeline.ties import TieSlot, grad_copy, sum_tied_grad, tie_slots
from shardwise.parallel.reduction import TokenShare
from shardwise.layout import Plan

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _pipelining() -> Any:
    """``torch.distributed.pipelining``, imported when a pipeline is built: it imports
    ``torch._dynamo`` (about 1.4 s of CPU per process), which a run without stages never needs."""
    import torch.distributed.pipelining as pipelining

    return pipelining


@dataclass(frozen=True)
class PipelineOptions:
    """Where to cut the model (see :func:`~shardwise.parallel.pipeline.split.split_model`)."""

    balance: Balance = "params"
    split_points: tuple[int | str, ...] | None = None
    example_inputs: tuple[Any, ...] | None = None  # needed by balance="flops"


def local_stage_indices(pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """The looped layout: rank ``r`` owns stages ``r, r + pp, ...``."""
    return [pp_rank + k * pp_size for k in range(virtual_stages)]


def check_microbatches(batch_size: int, microbatches: int) -> None:
    """Raise unless the (per data-parallel rank) batch splits into equal microbatches."""
    if batch_size % microbatches != 0 or batch_size < microbatches:
        lower = max(microbatches, batch_size - batch_size % microbatches)
        raise ConfigError(
            f"batch of {batch_size} samples per data-parallel rank does not split into "
            f"{microbatches} equal microbatches",
            hint=f"use a batch size that is a multiple of {microbatches} (e.g. {lower} or {lower + microbatches}), "
            f"or microbatches that divide {batch_size}",
        )


def check_pipeline(model: nn.Module, plan: Plan, *, options: PipelineOptions | None = None) -> None:
    """Raise the split's ConfigErrors (too many stages, tied holders on one rank, bad split points) with no
    communication, so they surface before any process-group work."""
    if plan.pp_enabled:
        options = options or PipelineOptions()
        stages = split_model(
            model,
            plan.pp * plan.virtual_stages,
            balance=options.balance,
            split_points=options.split_points,
            example_inputs=options.example_inputs,
        )
        check_ties(stage_ties(stages), pp=plan.pp)


def stage_device(pp_mesh: DeviceMesh) -> torch.device:
    """The device the stages run on: this process's accelerator, or the CPU."""
    if pp_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(pp_mesh.device_type)


def split_for_rank(model: nn.Module, pp_mesh: DeviceMesh, *, plan: Plan, options: PipelineOptions | None = None
                   ) -> tuple[list[tuple[int, nn.Module]], tuple[Tie, ...]]:
    """This rank's ``(stage index, stage module)`` pairs, cut from ``model`` per ``plan``, and the
    weights that several stages hold (tied embeddings)."""
    options = options or PipelineOptions()
    stages = split_model(
        model,
        plan.pp * plan.virtual_stages,
        balance=options.balance,
        split_points=options.split_points,
        example_inputs=options.example_inputs,
    )
    ties = stage_ties(stages)
    check_ties(ties, pp=plan.pp)
    return [(i, stages[i]) for i in local_stage_indices(pp_mesh.get_local_rank(), plan.pp, plan.virtual_stages)], ties


class PipelineSchedule:
    """A :class:`~shardwise.parallel.parallelize.PipelineRunner` over a torch pipelining schedule.

    ``loss_fn(output, target)`` must reduce by the mean over its microbatch; set it at construction
    or later through the ``loss_fn`` attribute (before the first :meth:`step`).
    """

    def __init__(
        self,
        modules: Sequence[tuple[int, nn.Module]],
        pp_mesh: DeviceMesh,
        *,
        plan: Plan,
        loss_fn: LossFn | None = None,
        device: torch.device | str = "cpu",
        ties: Sequence[TieSlot] = (),
    ) -> None:
        self.plan = plan
        self.ties = tuple(ties)
        # Trunk stages recompute what their blocks need (rotary embeddings, masks) from the
        # batch's inputs: torch's schedules pass keyword arguments to every stage.
        self._pass_inputs = any(isinstance(module, TrunkStage) for _, module in modules)
        self.loss_fn = loss_fn
        self._group = pp_mesh.get_group()
        self._device = torch.device(device)
        num_stages = plan.pp * plan.virtual_stages
        if plan.sharded_accumulation:
            from shardwise.parallel.pipeline.accumulation import ShardedAccumulationStage as stage_class
        else:
            stage_class = _pipelining().PipelineStage
        self.stages = [
            stage_class(module, index, num_stages, self._device, group=self._group) for index, module in modules
        ]
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self._losses: list[torch.Tensor] = []
        self._counts: list[torch.Tensor] = []  # token reduction: valid targets of each microbatch
        self._scale = 1.0
        self._tokens: TokenShare | None = None
        self._eval_schedule: Any = None
        self._predict_schedule: Any = None
        self._shapes_key: tuple | None = None
        m = plan.microbatches
        if plan.schedule == "gpipe":
            self._schedule: Any = _pipelining().ScheduleGPipe(
                self.stages[0], m, loss_fn=self._stage_loss, scale_grads=False
            )
        elif plan.schedule == "1f1b":
            self._schedule = _pipelining().Schedule1F1B(self.stages[0], m, loss_fn=self._stage_loss, scale_grads=False)
        elif plan.schedule == "interleaved_1f1b":
            self._schedule = _pipelining().ScheduleInterleaved1F1B(
                self.stages, m, loss_fn=self._stage_loss, scale_grads=False
            )
        else:
            raise ConfigError(
                f"pipeline schedule {plan.schedule!r} is not available", hint="use gpipe, 1f1b or interleaved_1f1b"
            )

    def _stage_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is None:
            raise ConfigError(
                "the pipeline has no loss function", hint="pass loss_fn= to parallelize (or set pm.pipeline.loss_fn)"
            )
        loss = self.loss_fn(output, target)
        self._losses.append(loss.detach())
        if self._tokens is None:
            return loss * (self._scale / self.plan.microbatches)
        count = self._tokens.count(target)
        self._counts.append(count)
        return loss * (self._tokens.weight(count) * self._scale)

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        loss_scale: float = 1.0,
        tokens: TokenShare | None = None,
        **model_kwargs: Any,
    ) -> torch.Tensor:
        """Forward + backward of the batch through the pipeline; the mean unscaled loss on every rank.

        Every rank passes the same ``inputs``/``targets`` (those of its data-parallel group); only
        the first stage reads the inputs and only the last the targets. ``model_kwargs`` (context
        parallel's ``position_ids``) are split into microbatches along dim 0 like the inputs and
        reach the model's forward on every stage that runs it (see :meth:`_stage_kwargs`).
        ``tokens``: weigh each microbatch by its valid targets (module doc); the loss returned is
        then the mean over the batch's valid targets.
        """
        check_microbatches(int(inputs.shape[0]), self.plan.microbatches)
        self._prepare(self._schedule, inputs)
        self._losses, self._counts, self._scale, self._tokens = [], [], float(loss_scale), tokens
        args = (inputs.to(self._device),) if self.has_first else ()
        target = targets.to(self._device) if self.has_last else None
        before = [grad_copy(slot) for slot in self.ties]
        self._schedule.step(*args, target=target, return_outputs=False, **self._stage_kwargs(inputs, model_kwargs))
        for slot, grad in zip(self.ties, before):
            sum_tied_grad(slot, grad)
        if self.has_last:
            # The last m calls are the microbatches; on the first step the schedule also calls the
            # loss once before them, on a metadata-inference output.
            m = self.plan.microbatches
            losses = torch.stack([_plain(x) for x in self._losses[-m:]]).to(torch.float32)
            if tokens is None:
                loss = losses.mean()
            else:  # the token mean: microbatches without valid targets (a loss of 0/0) count nothing
                counts = torch.stack(self._counts[-m:]).to(losses.device)
                weighted = torch.where(counts > 0, losses * counts, torch.zeros_like(losses))
                loss = weighted.sum() / counts.sum().clamp_min(1)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self._device)
        # The last stage lives on the last pp rank (looped layout); share its loss with all.
        dist.broadcast(loss, group=self._group, group_src=self.plan.pp - 1)
        return loss


    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor, **model_kwargs: Any) -> torch.Tensor:
        """Forward only: the batch's mean loss on every rank (for evaluation).

        The whole batch goes through as one microbatch (no backward, so there is no bubble to
        hide), which makes any batch size work, the last partial batch of a split included.
        """
        return self.eval_outputs(inputs, targets, **model_kwargs)[0]

    @torch.no_grad()
    def eval_outputs(
        self, inputs: torch.Tensor, targets: torch.Tensor, **model_kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward only (as :meth:`eval_loss`): the mean loss on every rank, and the last stage's
        output (the logits) on the ranks that hold the last stage (None elsewhere)."""
        if self._eval_schedule is None:
            if len(self.stages) == 1:
                self._eval_schedule = _pipelining().ScheduleGPipe(
                    self.stages[0], 1, loss_fn=self._stage_loss, scale_grads=False
                )
            else:
                self._eval_schedule = _pipelining().ScheduleLoopedBFS(
                    self.stages, 1, loss_fn=self._stage_loss, scale_grads=False
                )
        self._prepare(self._eval_schedule, inputs)
        self._losses, self._scale = [], 1.0
        args = (inputs.to(self._device),) if self.has_first else ()
        target = targets.to(self._device) if self.has_last else None
        self._tokens = None
        output = self._eval_schedule.eval(*args, target=target, **self._stage_kwargs(inputs, model_kwargs))
        loss = (
            _plain(self._losses[-1]).float()
            if self.has_last
            else torch.zeros((), dtype=torch.float32, device=self._device)
        )
        dist.broadcast(loss, group=self._group, group_src=self.plan.pp - 1)
        return loss, (output if self.has_last else None)

    @torch.no_grad()
    def predict_outputs(self, inputs: torch.Tensor, **model_kwargs: Any) -> torch.Tensor | None:
        """Forward only, without targets or a loss: the last stage's output on the ranks that hold
        the last stage, None elsewhere (for ``Trainer.predict``). One microbatch, as in :meth:`eval_outputs`."""
        if self._predict_schedule is None:
            if len(self.stages) == 1:
                self._predict_schedule = _pipelining().ScheduleGPipe(self.stages[0], 1, loss_fn=None, scale_grads=False)
            else:
                self._predict_schedule = _pipelining().ScheduleLoopedBFS(
                    self.stages, 1, loss_fn=None, scale_grads=False
                )
        self._prepare(self._predict_schedule, inputs)
        args = (inputs.to(self._device),) if self.has_first else ()
        output = self._predict_schedule.eval(*args, **self._stage_kwargs(inputs, model_kwargs))
        return output if self.has_last else None

    def _stage_kwargs(self, inputs: torch.Tensor, model_kwargs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The keyword arguments of the schedule's call, which torch passes to every stage: the
        batch's inputs and ``model_kwargs`` for trunk stages (each runs the model's own forward);
        ``model_kwargs`` on the first stage only for explicit stages."""
        extra = {k: v.to(self._device) for k, v in model_kwargs.items()}
        if self._pass_inputs:
            return {"stage_inputs": inputs.to(self._device), **extra}
        return extra if self.has_first else {}

    def tied_copies(self) -> list[nn.Parameter]:
        """This rank's copies of tied weights that the gradient norm must not count again."""
        return [slot.module.get_parameter(slot.name) for slot in self.ties if not slot.counted]

    def _prepare(self, schedule: Any, inputs: torch.Tensor) -> None:
        """Make ``schedule`` re-infer the stages' send/receive shapes when they change.

        torch infers them once per schedule (and on a train/eval switch of the same schedule); the
        stages' buffers are shared by our training and evaluation schedules, and batches can change
        size, so the inference is redone whenever the schedule or the input shape changes. The
        shape is the same on every rank of the pp group (they share one data-parallel rank), so
        all of them redo it together.
        """
        key = (id(schedule), tuple(inputs.shape), torch.is_grad_enabled())
        if key != self._shapes_key:
            for flag in (
                "_stage_forward_initialized",
                "_stage_backward_initialized",
                "_stages_forward_initialized",
                "_stages_backward_initialized",
            ):
                if hasattr(schedule, flag):
                    setattr(schedule, flag, False)
            self._shapes_key = key


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the loss: under TP loss parallelism it is a (replicated) DTensor, which
    c10d's broadcast over the pp group cannot take."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def stage_modules(module: nn.Module) -> list[nn.Module]:
    """The stage modules of a :class:`ParallelModel.module` (a ModuleList when v > 1)."""
    return list(module) if isinstance(module, nn.ModuleList) else [module]


def build_pipeline(
    model: nn.Module,
    plan: Plan,
    pp_mesh: DeviceMesh,
    *,
    loss_fn: LossFn | None,
    options: PipelineOptions | None = None,
    wrap_stage: Callable[[nn.Module], nn.Module] = lambda m: m,
    device: torch.device | str | None = None,
) -> tuple[nn.Module, PipelineSchedule]:
    """Split ``model``, apply ``wrap_stage`` (TP, AC, FSDP/DDP, ...) to each local stage, build the schedule.

    Returns the module the optimizer takes its parameters from (the stage, or a ModuleList of the
    ``virtual_stages`` local stages) and the runner.
    """
    split, ties = split_for_rank(model, pp_mesh, plan=plan, options=options)
    pairs = [(index, wrap_stage(module)) for index, module in split]
    runner = PipelineSchedule(pairs, pp_mesh, plan=plan, loss_fn=loss_fn, device=device or stage_device(pp_mesh),
                              ties=tie_slots(ties, pairs, pp_mesh, plan=plan))
    module = pairs[0][1] if len(pairs) == 1 else LocalStages(m for _, m in pairs)
    return module, runner


class LocalStages(nn.ModuleList):
    """This rank's stages with ``virtual_stages > 1`` (what the optimizer and checkpoints see)."""

    def init_weights(self, seed: int = 0) -> None:
        """All local stages share the whole meta model, so one stage's init covers them all."""
        self[0].init_weights(seed)
