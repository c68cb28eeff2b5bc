"""Pipeline parallelism through ``torch.distributed.pipelining``.

The model is cut into ``S = pp * virtual_stages`` stages (:mod:`shardwise.parallel.pipeline_split`);
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
broadcast of the scalar loss over the ``pp`` group so every rank reports it.

Loss and gradient scale. The schedule computes ``loss_fn(output_mb, target_mb)`` on the last
stage for each microbatch ``mb``; backward runs on ``loss_fn(...) * loss_scale / m`` (we tell the
schedule ``scale_grads=False`` and scale the loss instead, so gradients that accumulate over
several steps are not divided again). With a mean-reducing loss and equal microbatches the
gradient is exactly that of ``loss_scale * loss_fn(model(x), y)`` on the whole batch, and the
reported loss ``mean_mb loss_fn(...)`` equals the single-process loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS

from shardwise.errors import ConfigError
from shardwise.parallel.pipeline_split import Balance, split_model
from shardwise.layout import Plan

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PipelineOptions:
    """Where to cut the model (see :func:`~shardwise.parallel.pipeline_split.split_model`)."""

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
            f"batch of {batch_size} samples per data-parallel rank does not split into {microbatches} equal microbatches",
            hint=f"use a batch size that is a multiple of {microbatches} (e.g. {lower} or {lower + microbatches}), or microbatches that divide {batch_size}",
        )


def check_pipeline(model: nn.Module, plan: Plan, *, options: PipelineOptions | None = None) -> None:
    """Raise the split's ConfigErrors (too many stages, tied weights, bad split points) with no
    communication, so they surface before any process-group work."""
    if plan.pp_enabled:
        options = options or PipelineOptions()
        split_model(model, plan.pp * plan.virtual_stages, balance=options.balance, split_points=options.split_points,
                    example_inputs=options.example_inputs)


def stage_device(pp_mesh: DeviceMesh) -> torch.device:
    """The device the stages run on: this process's accelerator, or the CPU."""
    if pp_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(pp_mesh.device_type)


def split_for_rank(model: nn.Module, pp_mesh: DeviceMesh, *, plan: Plan, options: PipelineOptions | None = None) -> list[tuple[int, nn.Module]]:
    """This rank's ``(stage index, stage module)`` pairs, cut from ``model`` per ``plan``."""
    options = options or PipelineOptions()
    stages = split_model(
        model,
        plan.pp * plan.virtual_stages,
        balance=options.balance,
        split_points=options.split_points,
        example_inputs=options.example_inputs,
    )
    return [(i, stages[i]) for i in local_stage_indices(pp_mesh.get_local_rank(), plan.pp, plan.virtual_stages)]


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
    ) -> None:
        self.plan = plan
        self.loss_fn = loss_fn
        self._group = pp_mesh.get_group()
        self._device = torch.device(device)
        num_stages = plan.pp * plan.virtual_stages
        self.stages = [PipelineStage(module, index, num_stages, self._device, group=self._group) for index, module in modules]
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self._losses: list[torch.Tensor] = []
        self._scale = 1.0
        self._eval_schedule: Any = None
        self._shapes_key: tuple | None = None
        m = plan.microbatches
        if plan.schedule == "gpipe":
            self._schedule: Any = ScheduleGPipe(self.stages[0], m, loss_fn=self._stage_loss, scale_grads=False)
        elif plan.schedule == "1f1b":
            self._schedule = Schedule1F1B(self.stages[0], m, loss_fn=self._stage_loss, scale_grads=False)
        elif plan.schedule == "interleaved_1f1b":
            self._schedule = ScheduleInterleaved1F1B(self.stages, m, loss_fn=self._stage_loss, scale_grads=False)
        else:
            raise ConfigError(f"pipeline schedule {plan.schedule!r} is not available", hint="use gpipe, 1f1b or interleaved_1f1b")

    def _stage_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is None:
            raise ConfigError("the pipeline has no loss function", hint="pass loss_fn= to parallelize (or set pm.pipeline.loss_fn)")
        loss = self.loss_fn(output, target)
        self._losses.append(loss.detach())
        return loss * (self._scale / self.plan.microbatches)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, loss_scale: float = 1.0, **model_kwargs: Any) -> torch.Tensor:
        """Forward + backward of the batch through the pipeline; the mean unscaled loss on every rank.

        Every rank passes the same ``inputs``/``targets`` (those of its data-parallel group); only
        the first stage reads the inputs (and ``model_kwargs``, e.g. context parallel's
        ``position_ids``, split into microbatches along dim 0 like the inputs) and only the last the
        targets.
        """
        check_microbatches(int(inputs.shape[0]), self.plan.microbatches)
        self._prepare(self._schedule, inputs)
        self._losses, self._scale = [], float(loss_scale)
        args = (inputs.to(self._device),) if self.has_first else ()
        kwargs = {k: v.to(self._device) for k, v in model_kwargs.items()} if self.has_first else {}
        target = targets.to(self._device) if self.has_last else None
        self._schedule.step(*args, target=target, return_outputs=False, **kwargs)
        if self.has_last:
            # The last m calls are the microbatches; on the first step the schedule also calls the
            # loss once before them, on a metadata-inference output.
            loss = torch.stack([_plain(x) for x in self._losses[-self.plan.microbatches :]]).mean().to(torch.float32)
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
        if self._eval_schedule is None:
            if len(self.stages) == 1:
                self._eval_schedule = ScheduleGPipe(self.stages[0], 1, loss_fn=self._stage_loss, scale_grads=False)
            else:
                self._eval_schedule = ScheduleLoopedBFS(self.stages, 1, loss_fn=self._stage_loss, scale_grads=False)
        self._prepare(self._eval_schedule, inputs)
        self._losses, self._scale = [], 1.0
        args = (inputs.to(self._device),) if self.has_first else ()
        kwargs = {k: v.to(self._device) for k, v in model_kwargs.items()} if self.has_first else {}
        target = targets.to(self._device) if self.has_last else None
        self._eval_schedule.eval(*args, target=target, **kwargs)
        loss = _plain(self._losses[-1]).float() if self.has_last else torch.zeros((), dtype=torch.float32, device=self._device)
        dist.broadcast(loss, group=self._group, group_src=self.plan.pp - 1)
        return loss

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
            for flag in ("_stage_forward_initialized", "_stage_backward_initialized", "_stages_forward_initialized", "_stages_backward_initialized"):
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
    pairs = [(index, wrap_stage(module)) for index, module in split_for_rank(model, pp_mesh, plan=plan, options=options)]
    runner = PipelineSchedule(pairs, pp_mesh, plan=plan, loss_fn=loss_fn, device=device or stage_device(pp_mesh))
    module = pairs[0][1] if len(pairs) == 1 else LocalStages(m for _, m in pairs)
    return module, runner


class LocalStages(nn.ModuleList):
    """This rank's stages with ``virtual_stages > 1`` (what the optimizer and checkpoints see)."""

    def init_weights(self, seed: int = 0) -> None:
        """All local stages share the whole meta model, so one stage's init covers them all."""
        self[0].init_weights(seed)
