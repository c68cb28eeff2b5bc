"""Parity of a parallel layout against one process: the engine behind ``shardwise verify``.

:func:`parity_worker` runs on every rank of a ``plan.world_size`` world. It trains the workload
for ``steps`` optimizer steps twice from the same seed and on the same global batches:

- *reference*: one process's worth of math, locally on this rank (no communication), the whole
  global batch per step;
- *parallel*: ``parallelize(model, plan, meshes)``; each data-parallel rank takes its slice of the
  global batch (TP/PP peers take the same slice), optionally in ``accumulation`` micro-steps with
  the gradient reduction off until the boundary (``ParallelModel.gradient_sync``). With pipeline
  parallelism each micro-step is one ``pm.pipeline.step`` (forward and backward of all
  ``plan.microbatches`` pipeline microbatches; the loss computed on the last stage is broadcast to
  every rank of the ``pp`` group).

Each micro-step's loss is weighted as the Trainer weighs it (``Training.loss_reduction``,
:mod:`shardwise.parallel.reduction`): by default by its valid targets (``"tokens"``), against a
reference that takes the loss over the whole global batch, the built-in workload's targets carrying
ragged ``-100`` masks (:mod:`shardwise.verify.workloads`); ``"samples"`` weighs every micro-batch
the same.

It compares per-step loss (the parallel micro-batches' weighted losses summed and averaged over
the ranks that see different tokens: the global-batch mean), per-step global gradient norm (computed
over DTensor shards by :func:`shardwise.verify.grad_norm.reference_grad_norm`, and summed over the
pipeline stages) and the final weights (gathered with ``full_tensor()``; with pipelining each stage
compares its own parameters by their original names and the results are gathered over ``pp``). Loss and grad norm
are compared relatively; a weight tensor's
divergence is ``max|w - w_ref| / max(max|w_ref|, weight_floor)``: relative to the tensor's scale,
but never to a scale below ``weight_floor`` (0.01), because some parameters carry no signal at all:
the key projection's bias has an exactly-zero true gradient (softmax is shift-invariant), so its
values are accumulated rounding noise and any relative comparison of them is meaningless.

The default optimizer is SGD with momentum: its update is linear in the gradient, so float32
rounding differences stay at float32 size. Adam's update ``m / (sqrt(v) + eps)`` is invariant to
the gradient's scale, so it turns a rounding-noise gradient (like that key bias's) into full
``lr``-sized steps of random sign, and an entry whose gradient changes sign between steps (``m``
near zero) amplifies its float32 rounding as much. So with any optimizer but SGD (``"adamw"``, or the
user's own factory: certification runs the Trainer's) the weights pass at ``ADAPTIVE_WEIGHT_RTOL``
(1e-2 of the tensor's scale: a parameter the layout failed to update still fails it, by its
whole update), while loss and grad norm, which see every entry's update from the second step on,
keep ``rtol``. The report also carries each rank's parameter, gradient and optimizer-state bytes
(local shards) next to the single-process figures.

**What passes**: every divergence at most ``rtol`` (a NaN fails), and the reference trained: some
gradient was not zero and some weight moved. A layout whose gradients vanish on both sides compares
nothing, and a pair of zeros counts as infinitely far apart.

The parallel run steps with the Trainer's own micro-step
(:meth:`~shardwise.parallel.parallelize.ParallelModel.forward_backward`), so a defect there fails
parity here.

FP8 (plans with ``precision=fp8``): the reference converts its Linear layers with the same
recipe and :class:`~shardwise.parallel.fp8.Fp8Options` (``Training.fp8``) as the parallel run,
so both compute the same FP8 GEMMs, and everything not converted runs in fp32 on both sides (the
options' default here): the comparison then sees only what the layout changes. All runs of one
call share the reference, so they must share the recipe too.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardwise.errors import ConfigError
from shardwise.optim.factory import build_optimizer, reference_optimizer
from shardwise.parallel.fp8 import Fp8Options, apply_fp8
from shardwise.parallel.init import parallelize_on_meta
from shardwise.parallel.mesh import build_mesh
from shardwise.parallel.micro_step import MicroBatch
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.pipeline.schedule import stage_modules
from shardwise.parallel.reduction import IGNORE_INDEX, LossReduction, check_loss_reduction
from shardwise.parallel.tp.styles import TPOptions
from shardwise.layout import Plan
from shardwise.verify.grad_norm import reference_grad_norm
from shardwise.verify.report import ParityReport
from shardwise.verify.report import _rel  # noqa: F401 - the parity tests compare with it from here
from shardwise.verify.state_bytes import memory_bytes
from shardwise.verify.workloads import SMALL_GPT, GPTWorkload, ScriptWorkload, ragged_mask

__all__ = [
    "SMALL_GPT",
    "GPTWorkload",
    "ParityReport",
    "Run",
    "ScriptWorkload",
    "Training",
    "parity_worker",
    "ragged_mask",
    "run_parallel",
    "run_reference",
]


ADAPTIVE_WEIGHT_RTOL = 1e-2  # the weights' tolerance under an optimizer other than SGD (module doc)


# -- the worker --------------------------------------------------------------------------------
def _full(t: torch.Tensor) -> torch.Tensor:
    whole = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
    if callable(getattr(whole, "get_original_weight", None)):  # a 4-bit NF4 base (QLoRA): its dequantized values
        whole = whole.get_original_weight()
    return whole.float().cpu()


def _clean(name: str) -> str:
    return name.removeprefix("module.")


def _optimizer(name: str, lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ConfigError(
        f"optimizer {name!r} is unknown", hint="use adamw or sgd, or an optimizer factory (params -> optimizer)"
    )


@dataclass(frozen=True)
class Training:
    """What both runs share: steps, global batch, optimizer, seed, and how the parallel run weighs
    its micro-batches (``"tokens"`` or ``"samples"``). ``optimizer``: ``"sgd"`` (with momentum) or
    ``"adamw"`` at ``lr``, or the user's factory (``params -> optimizer``, like the Trainer's
    ``optimizer=``; ``lr`` is then the factory's own), called once per run on fresh parameters."""

    steps: int = 20
    global_batch: int = 8
    lr: float = 0.1
    seed: int = 0
    optimizer: str | Callable[[Any], torch.optim.Optimizer] = "sgd"
    weight_floor: float = 1e-2
    device: str = "cpu"  # where both runs compute (the device of the world's backend: "cuda" under NCCL)
    loss_reduction: str = "tokens"
    ignore_index: int = IGNORE_INDEX
    fp8: Fp8Options = Fp8Options(high_precision="fp32")  # how plans with precision=fp8 (and the reference) convert

    def __post_init__(self) -> None:
        check_loss_reduction(self.loss_reduction)
        if isinstance(self.optimizer, str):
            _optimizer(self.optimizer, self.lr)  # an unknown name fails here, before any run

    def optimizer_factory(self) -> Callable[[Any], torch.optim.Optimizer]:
        """``params -> optimizer`` for both runs."""
        return _optimizer(self.optimizer, self.lr) if isinstance(self.optimizer, str) else self.optimizer


@dataclass(frozen=True)
class Run:
    """One parallel configuration to check against the reference."""

    plan: str
    accumulation: int = 1
    meta_init: bool = False
    loss_parallel: bool = False

    @property
    def label(self) -> str:
        extras = [f"accumulation={self.accumulation}"] * (self.accumulation > 1) + ["meta_init"] * self.meta_init
        return str(Plan.parse(self.plan)) + "".join(f" +{e}" for e in extras + ["loss_parallel"] * self.loss_parallel)


@dataclass(frozen=True)
class _Reference:
    losses: tuple[float, ...]
    grad_norms: tuple[float, ...]
    weights: dict[str, torch.Tensor]  # every name, tied aliases included
    memory: dict[str, int]
    aliases: dict[str, tuple[str, ...]]  # each parameter's first name -> all its names
    moved: float = 0.0  # max over tensors of max|w_T - w_0| / max|w_0|: did the reference train at all
    linear: bool = True  # the optimizer is SGD, whose update is linear in the gradient (module doc)


def parity_worker(workload: Any, runs: Sequence[Run | str], training: Training = Training()) -> list[ParityReport]:
    """Train ``workload`` once as one process, then under each run's plan; compare (module doc).

    Runs on every rank of a world of the plans' size; the reference is computed once per call.
    """
    batches = [workload.batch(step, training.global_batch) for step in range(training.steps)]
    ref = run_reference(workload, batches, training, fp8_recipe=_fp8_recipe(runs))
    return [run_parallel(workload, run if isinstance(run, Run) else Run(run), batches, ref, training) for run in runs]


def _fp8_recipe(runs: Sequence[Run | str]) -> str | None:
    """The FP8 recipe every run uses (None: no FP8), or a ConfigError when they differ."""
    plans = [Plan.parse(run.plan if isinstance(run, Run) else run) for run in runs]
    recipes = {p.fp8_recipe if p.precision == "fp8" else None for p in plans}
    if len(recipes) > 1:
        raise ConfigError(
            f"parity runs mix FP8 recipes and precisions ({', '.join(sorted(str(r) for r in recipes))}): "
            "they share one reference",
            hint="check plans of one FP8 recipe (or none) per call",
        )
    return next(iter(recipes), None)


def run_reference(
    workload: Any, batches: list[Any], training: Training, *, fp8_recipe: str | None = None
) -> _Reference:
    """The single-process run, on this rank alone (no communication); ``fp8_recipe``: its Linear
    layers converted as the parallel runs' are (module doc)."""
    model = workload.build(training.seed).to(training.device)
    if fp8_recipe is not None:
        apply_fp8(model, recipe=fp8_recipe, options=training.fp8, device=training.device, log_it=False)
    batches = [_to(b, training.device) for b in batches]
    opt = reference_optimizer(model, training.optimizer_factory())
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    losses, norms = [], []
    memory: dict[str, int] = {}
    for step, (x, y) in enumerate(batches):
        loss = workload.loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])))
        opt.step()
        if step == len(batches) - 1:
            memory = memory_bytes(list(model.parameters()), opt)
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    # Every name of a tied weight (lm_head.weight and the embedding's): a pipeline stage holds it
    # under the name its own module uses.
    aliases: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    moved = max((float((p.detach() - initial[n]).abs().max() / initial[n].abs().max().clamp_min(1e-12))
                 for n, p in model.named_parameters() if n in initial and p.numel()), default=0.0)
    return _Reference(
        tuple(losses),
        tuple(norms),
        {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)},
        memory,
        {names[0]: tuple(names) for names in aliases.values()},
        moved=moved,
        linear=isinstance(opt, torch.optim.SGD),
    )




def run_parallel(workload: Any, run: Run, batches: list[Any], ref: _Reference, training: Training,
                 after_backward: Callable[[Any, Plan], None] | None = None) -> ParityReport:
    """``run`` on this world, compared with ``ref`` (collective: every rank of the plan's world).
    ``after_backward(pm, plan)`` runs after each step's backward, before the optimizer (the
    certification tests break a plan with it on purpose)."""
    with warnings.catch_warnings():
        # FSDP2 warns whenever the root returns a view (logits.view); the loss never edits it in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        return _parallel(workload, run, [_to(b, training.device) for b in batches], ref, training, after_backward)


def _to(batch: Any, device: str) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _parallel(workload: Any, run: Run, batches: list[Any], ref: _Reference, training: Training,
              after_backward: Callable[[Any, Plan], None] | None) -> ParityReport:
    start = time.perf_counter()
    plan = Plan.parse(run.plan)
    meshes = build_mesh(plan, torch.device(training.device).type)
    dp_rank, dp_size = meshes.dp.get_local_rank(), meshes.dp.size()
    if training.global_batch % (dp_size * run.accumulation):
        raise ConfigError(
            f"global batch {training.global_batch} does not split into {dp_size} ranks x "
            f"{run.accumulation} micro-steps",
            hint=f"use a multiple of {dp_size * run.accumulation}",
        )
    options: dict[str, Any] = {"tp": TPOptions(loss_parallel=run.loss_parallel), "fp8": training.fp8}
    if plan.pp_enabled:
        options["loss_fn"] = workload.loss  # runs on the last stage, once per pipeline microbatch
    if run.meta_init:
        pm = parallelize_on_meta(
            lambda: workload.build(training.seed), plan, meshes, device=training.device, seed=training.seed, **options
        )
    else:
        pm = parallelize(workload.build(training.seed).to(training.device), plan, meshes, **options)
    opt = build_optimizer(pm, training.optimizer_factory())
    loss_fn = pm.loss_for(workload.loss)  # the plan's runtime options: a chunked head + loss, 16-bit parameters
    params = list(pm.parameters())
    losses, norms = [], []
    memory: dict[str, int] = {}
    # Pipeline stages hold different layers: the norm's sum of squares is completed over pp.
    pp_group = meshes.pp.get_group() if plan.pp_enabled else None
    reduction = LossReduction.over(meshes.tokens, training.loss_reduction, training.ignore_index)
    for step, (x, y) in enumerate(batches):
        xs, ys = x.chunk(dp_size)[dp_rank].chunk(run.accumulation), y.chunk(dp_size)[dp_rank].chunk(run.accumulation)
        # the Trainer's own micro-step: weighed, sharded (cp), forward and backward, sync on the last
        total = pm.forward_backward(
            [MicroBatch(xm, ym) for xm, ym in zip(xs, ys)], loss_fn=loss_fn, reduction=reduction, device=training.device
        ).loss
        if after_backward is not None:
            after_backward(pm, plan)
        # the mean over every rank that holds different tokens (dp x cp)
        dist.all_reduce(total, group=meshes.tokens.get_group())
        losses.append(float(total) / meshes.tokens.size())
        norms.append(float(reference_grad_norm(params, pp_group=pp_group, skip=pm.tied_copies())))
        opt.step()
        if step == len(batches) - 1:
            memory = memory_bytes(params, opt)
        opt.zero_grad(set_to_none=True)

    diffs = _weight_diffs(pm, ref, training.weight_floor, pp_group=pp_group)
    memory.update({f"ref_{k}": v for k, v in ref.memory.items()})
    return ParityReport(
        plan=run.label,
        losses=tuple(losses),
        ref_losses=ref.losses,
        grad_norms=tuple(norms),
        ref_grad_norms=ref.grad_norms,
        weight_diffs=diffs,
        memory=memory,
        seconds=time.perf_counter() - start,
        ref_moved=ref.moved,
        weight_rtol=None if ref.linear else ADAPTIVE_WEIGHT_RTOL,
    )


def _weight_diffs(pm: Any, ref: _Reference, floor: float, *, pp_group: dist.ProcessGroup | None) -> dict[str, float]:
    """Each parameter's divergence from the reference, by its original name, on every rank.

    Without pipelining every rank holds (a shard of) every parameter and ``full_tensor()`` gathers
    it. With pipelining each rank holds only its stages' parameters, whose names are those of the
    whole model (:mod:`~shardwise.parallel.pipeline.split`): each rank compares its own against
    the reference it trained locally, and the ``{name: divergence}`` dicts are all-gathered over
    ``pp`` (one small object per rank). A parameter that no stage holds counts as ``inf``, so a
    split that loses a layer cannot pass.
    """
    modules = stage_modules(pm.module) if pp_group is not None else [pm.module]
    diffs: dict[str, float] = {}
    for module in modules:
        for name, p in module.named_parameters():
            full, want = _full(p), _full(ref.weights[_clean(name)])
            full = full.reshape(want.shape)  # a TP-fused weight is held as (in, pieces, width)
            diffs[_clean(name)] = float((full - want).abs().max() / want.abs().max().clamp_min(floor))
    if pp_group is None:
        return diffs
    per_stage: list[dict[str, float]] = [{} for _ in range(dist.get_world_size(pp_group))]
    dist.all_gather_object(per_stage, diffs, group=pp_group)
    merged: dict[str, float] = {}
    for stage in per_stage:
        for name, value in stage.items():
            merged[name] = max(value, merged.get(name, 0.0))
    # A tied weight that a later stage holds under another name (lm_head.weight) counts for both.
    out = {}
    for name, aliases in ref.aliases.items():
        found = [merged[a] for a in aliases if a in merged]
        out[name] = max(found) if found else float("inf")
    return out
