"""Certification of an automatic plan by parity, on the user's own model and training data.

Before ``Trainer(plan="auto")`` trains, :func:`certify_plans` (on the Trainer's model and data)
proves with :func:`certify` that the chosen layout computes what one process would, with the
parity engine of ``shardwise verify`` (:mod:`shardwise.verify.parity`), on

- a **shrunken copy of the user's model** (:func:`shrink`): the same layer types, with its
  repeated blocks (those FSDP wraps and the planner prices, :mod:`shardwise.models.blocks`; they
  must share their parameter shapes to be dropped) cut to as few as the plans need (2, or the
  pipeline's stages); a Hugging Face model is rebuilt from its config with fewer ``num_hidden_layers``. The copy runs in
  ``eval()`` mode, so dropout is off and BatchNorm uses its running statistics: under data parallelism batch
  statistics are per replica by design, which is not what the certificate is about;
- **the first global batches of the real training data** (:class:`DataWorkload`), collated with
  the Trainer's own collate function, with the Trainer's loss function;
- ``steps`` optimizer steps in fp32 with the user's optimizer (the Trainer's ``optimizer=``
  factory), or SGD with momentum when the user gave none (its update is linear in the gradient, so
  rounding stays float32-sized; with an optimizer like Adam the weights pass at a looser
  tolerance, loss and grad norm at ``rtol``: see the parity module doc);
- the Trainer's own micro-step (:meth:`~shardwise.parallel.parallelize.ParallelModel.forward_backward`).

Each rank trains the single-process reference locally (no communication), then each candidate
plan in the world, and compares per-step loss, per-step global gradient norm and every final
weight at ``rtol`` (float32 tolerance, 1e-5, as ``shardwise verify``). The ranks agree on one
verdict: the three divergences are all-reduced (MAX) over the world, so a divergence on one rank
only (one shard's gradient) refuses the plan everywhere. A refused plan names the check that
failed; the next candidate is tried, up to ``max_plans``. The :class:`Certificate` (what was
compared, tolerances, divergences, seconds) goes into ``auto_plan.json``.

Communication: what the plans themselves do for ``steps`` steps of a tiny model, plus one
3-element all-reduce per candidate.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint.hf_load import Pretrained
from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.models.blocks import find_blocks
from shardwise.parallel.reduction import IGNORE_INDEX
from shardwise.runtime.detect import RuntimeEnv
from shardwise.verify.parity import Run, Training, run_parallel, run_reference

if TYPE_CHECKING:
    from shardwise.auto.sample import AutoData


@dataclass(frozen=True)
class CertifyOptions:
    """``ParallelOptions(certify=...)`` of the Trainer. ``enabled``: True, False, or None (the default): on when the run
    has at least ``long_run`` optimizer steps. ``after_backward(pm, plan)`` runs in each candidate's
    parallel run after every backward (tests break a plan with it on purpose)."""

    enabled: bool | None = None
    steps: int = 3
    rtol: float = 1e-5
    lr: float = 0.01
    long_run: int = 1000
    max_plans: int = 3
    after_backward: Callable[[Any, Plan], None] | None = None

    def wanted(self, total_steps: int | None) -> bool:
        if self.enabled is not None:
            return self.enabled
        return total_steps is not None and total_steps >= self.long_run

    @classmethod
    def of(cls, value: "bool | CertifyOptions | None") -> "CertifyOptions":
        if isinstance(value, CertifyOptions):
            return value
        if value is None or isinstance(value, bool):
            return cls(enabled=value)
        raise ConfigError(
            f"certify={value!r} is not True, False, None or a CertifyOptions",
            hint="ParallelOptions(certify=False) turns certification off; None certifies runs of 1000 steps or more",
        )


# -- the shrunken copy ---------------------------------------------------------------------------
def repeated_blocks(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The model's blocks (:func:`shardwise.models.blocks.find_blocks`, the ones FSDP wraps and
    the planner prices) as ``(qualified name, container)``, when they can be dropped: every block
    of the same type and parameter shapes (else None: the copy keeps the whole model)."""
    found = find_blocks(model)
    if found is None or len({_signature(c) for c in found.modules}) != 1:
        return None
    return found.name, found.container


def _signature(module: nn.Module) -> tuple:
    """A block's type and parameter shapes: only truly repeated blocks (same shapes) can be dropped."""
    return (type(module),) + tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


def shrink(model: nn.Module, *, blocks: int) -> tuple[nn.Module, str]:
    """A copy of ``model`` with at most ``blocks`` of its repeated blocks (module doc), in eval
    mode, and a description of what was kept. Only the kept parts are copied (the container is
    swapped for a shorter one while the copy is taken). A Hugging Face model's config says the new
    number of layers too (its forward loops over ``config.num_hidden_layers``)."""
    found = repeated_blocks(model)
    if found is None or len(found[1]) <= blocks:
        kept = len(found[1]) if found else 0
        small = copy.deepcopy(model)
        what = f"{type(model).__name__}, whole ({kept} repeated blocks)" if kept else f"{type(model).__name__}, whole"
    else:
        name, container = found
        kind = nn.Sequential if isinstance(container, nn.Sequential) else nn.ModuleList
        short = (
            kind(list(container.children())[:blocks])
            if kind is nn.ModuleList
            else kind(*list(container.children())[:blocks])
        )
        if not name:  # the model is the sequence of blocks itself
            small = copy.deepcopy(short)
        else:
            parent, attr = _parent(model, name)
            setattr(parent, attr, short)
            try:
                small = copy.deepcopy(model)
            finally:
                setattr(parent, attr, container)
        for module in small.modules():  # the model's own config, or those of the HF models inside a user's wrapper
            _set_layers(getattr(module, "config", None), blocks)
        what = f"{type(model).__name__}, {blocks} of {len(container)} blocks of {repr(name) if name else 'the model'}"
    if any(p.is_meta for p in small.parameters()):
        raise ConfigError(f"the {type(model).__name__} is on the meta device: certification needs its layers' values",
                          hint="build the model on a real device, or pass ParallelOptions(certify=False)")
    return small.eval(), what


def shrink_config(config: Any, *, blocks: int, seed: int = 0) -> tuple[nn.Module, str]:
    """A Hugging Face causal LM built from ``config`` with at most ``blocks`` layers (eval mode)."""
    from shardwise.models.hf import build_causal_lm

    config = copy.deepcopy(config)
    layers = int(getattr(config, "num_hidden_layers", blocks))
    _set_layers(config, min(blocks, layers))
    model = build_causal_lm(config, seed=seed)
    return model.eval(), f"{type(model).__name__} from its config, {min(blocks, layers)} of {layers} layers"


def _set_layers(config: Any, blocks: int) -> None:
    if config is None or not hasattr(config, "num_hidden_layers") or not callable(getattr(config, "to_dict", None)):
        return
    config.num_hidden_layers = min(int(config.num_hidden_layers), blocks)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:blocks]


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    head, _, attr = name.rpartition(".")
    return (model.get_submodule(head) if head else model), attr


# -- the workload --------------------------------------------------------------------------------
@dataclass
class DataWorkload:
    """The parity engine's workload (``build``, ``batch``, ``loss``) over a fixed small model and
    collated batches of the real data; every ``build`` returns a fresh copy of the same weights."""

    template: nn.Module
    batches: list[tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    description: str = ""  # what the copy kept (for the certificate)

    def build(self, seed: int) -> nn.Module:
        return copy.deepcopy(self.template)

    def batch(self, step: int, size: int) -> tuple[Any, Any]:
        return self.batches[step % len(self.batches)]

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        return self.loss_fn(output, target)


# -- the certificate -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """One candidate plan's comparison. ``divergences``: the largest relative divergence of the
    loss, the gradient norm and the weights (the worst weight named in ``weight``)."""

    plan: str
    divergences: dict[str, float]
    rtol: float
    seconds: float
    weight: str = ""
    error: str = ""
    model: str = ""  # the shrunken copy it ran on
    weight_rtol: float | None = None  # the weights' own tolerance under an adaptive optimizer (None: rtol)

    @property
    def failed(self) -> str | None:
        """The first check that failed, in words (None: passed)."""
        if self.error:
            return f"the plan did not run: {self.error}"
        for check, value in self.divergences.items():
            tolerance = (
                max(self.rtol, self.weight_rtol) if check == "weights" and self.weight_rtol is not None else self.rtol
            )
            if not value <= tolerance:  # NaN fails too
                where = f" ({self.weight})" if check == "weights" and self.weight else ""
                return f"{check} diverged: max rel diff {value:.3g}{where} > rtol {tolerance:g}"
        return None

    @property
    def passed(self) -> bool:
        return self.failed is None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"plan": self.plan, "passed": self.passed, "max_rel_diff": dict(self.divergences),
                               "seconds": round(self.seconds, 4)}
        if self.model:
            out["model"] = self.model
        if self.weight:
            out["worst_weight"] = self.weight
        if self.weight_rtol is not None:
            out["weights_rtol"] = max(self.rtol, self.weight_rtol)
        if not self.passed:
            out["failed"] = self.failed
        return out


@dataclass(frozen=True)
class Certificate:
    plan: str | None  # the first candidate that passed (None: none did)
    verdicts: tuple[Verdict, ...]
    compared: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0  # everything: the copy, the reference and every candidate

    @property
    def refused(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.passed]

    def summary(self) -> str:
        if self.plan is None:
            return "certification refused every candidate: " + "; ".join(f"{v.plan}: {v.failed}" for v in self.verdicts)
        refused = "".join(f"; refused {v.plan}: {v.failed}" for v in self.refused)
        return f"certified {self.plan} by parity in {self.seconds:.2f} s{refused}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "certified": self.plan,
            "compared": dict(self.compared),
            "rtol": self.verdicts[0].rtol if self.verdicts else None,
            "candidates": [v.to_dict() for v in self.verdicts],
            "seconds": round(self.seconds, 4),
        }


def certify(workload_for: Callable[[Plan], DataWorkload], plans: Sequence[Plan], *, options: CertifyOptions,
            accumulation: int = 1, global_batch: int, device: str = "cpu", loss_parallel: bool = False,
            compared: dict[str, Any] | None = None, loss_reduction: str = "samples", ignore_index: int = IGNORE_INDEX,
            optimizer: Callable[[Any], torch.optim.Optimizer] | None = None) -> Certificate:
    """Certify ``plans`` in order until one passes (module doc). ``workload_for(plan)`` is the
    shrunken copy a plan runs on (a pipeline needs as many blocks as stages); the reference is
    trained once per distinct workload. ``optimizer``: the user's factory (None: SGD with momentum
    at ``options.lr``). Collective: every rank of the world."""
    start = time.perf_counter()
    training = Training(
        steps=options.steps,
        global_batch=global_batch,
        lr=options.lr,
        optimizer=optimizer or "sgd",
        device=device,
        loss_reduction=loss_reduction,
        ignore_index=ignore_index,
    )
    references: dict[int, Any] = {}
    verdicts: list[Verdict] = []
    chosen: str | None = None
    for plan in list(plans)[: options.max_plans]:
        began = time.perf_counter()
        workload = workload_for(plan)
        batches = [workload.batch(step, global_batch) for step in range(training.steps)]
        if id(workload) not in references:
            references[id(workload)] = run_reference(workload, batches, training)
        error, weight, weight_rtol = "", "", None
        values = [float("inf")] * 3
        try:
            report = run_parallel(
                workload,
                Run(str(plan), accumulation=accumulation, loss_parallel=loss_parallel),
                batches,
                references[id(workload)],
                training,
                after_backward=options.after_backward,
            )
            weight, wdiff = report.weight_diff
            values, weight_rtol = [report.loss_diff, report.grad_norm_diff, wdiff], report.weight_rtol
            if not report.reference_moved:
                error = "the reference did not train (zero gradients or unchanged weights): nothing was compared"
        except (ConfigError, RuntimeError, ValueError, TypeError, AssertionError) as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        values = [v if v == v else float("inf") for v in values]  # NaN: as far off as it gets
        agreed = torch.tensor(values + [1.0 if error else 0.0], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        loss, grad, wdiff, any_error = agreed.tolist()
        if any_error and not error:
            error = "it failed on another rank"
        verdict = Verdict(
            plan=str(plan),
            divergences={"loss": loss, "grad norm": grad, "weights": wdiff},
            rtol=options.rtol,
            seconds=time.perf_counter() - began,
            weight=weight,
            error=error,
            model=workload.description,
            weight_rtol=weight_rtol,
        )
        verdicts.append(verdict)
        if verdict.passed:
            chosen = str(plan)
            break
    info = {
        "steps": training.steps,
        "global_batch": global_batch,
        "micro_steps": accumulation,
        "optimizer": f"sgd momentum 0.9 lr {options.lr:g}" if optimizer is None else "the Trainer's",
        "precision": "fp32",
        "mode": "eval (dropout off, BatchNorm running statistics)",
        "loss_reduction": loss_reduction,
        "quantities": ["loss per step", "global gradient norm per step", "every weight after the last step"],
        "reference": "one process, locally on every rank, the whole global batch per step",
        **(compared or {}),
    }
    if verdicts:
        info["model"] = verdicts[-1].model
    return Certificate(plan=chosen, verdicts=tuple(verdicts), compared=info, seconds=time.perf_counter() - start)


def certify_plans(
    model: Any,
    plans: Sequence[Plan],
    *,
    data: AutoData,
    env: RuntimeEnv,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    loss_parallel: bool = False,
    loss_reduction: str = "samples",
    ignore_index: int = IGNORE_INDEX,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> Certificate:
    """Certify ``plans`` in order on a shrunken copy of ``model`` and the first global batches of the
    data (:func:`certify`) with the user's ``optimizer`` factory (None: SGD with momentum).
    ``model`` is the user's module, or a Hugging Face ``Pretrained`` directory
    (rebuilt from its config with fewer layers). Collective: every rank."""
    plans = list(plans)[: data.certify.max_plans]
    accumulation = min(data.grad_accum_steps, 2)
    # one global batch that every candidate splits evenly: dp ranks x micro-steps x pipeline microbatches
    global_batch = 2
    for p in plans:
        global_batch = math.lcm(global_batch, p.dp_size * accumulation * (p.microbatches if p.pp_enabled else 1))
    batches = [
        data.collate(range(step * global_batch, (step + 1) * global_batch)) for step in range(data.certify.steps)
    ]
    copies: dict[int, DataWorkload] = {}

    def workload_for(plan: Plan) -> DataWorkload:
        """The shrunken copy for ``plan``: 2 blocks, or one per pipeline stage (made once per size)."""
        blocks = max(2, plan.pp * max(1, plan.virtual_stages))
        if blocks not in copies:
            if isinstance(model, Pretrained):
                template, what = shrink_config(model.config(), blocks=blocks)
            else:
                template, what = shrink(model, blocks=blocks)
            params = sum(p.numel() for p in template.parameters())
            copies[blocks] = DataWorkload(template, batches, loss_fn, description=f"{what}, {params:,} parameters")
        return copies[blocks]

    compared = {"samples": f"the first {data.certify.steps * global_batch} of the training data (in order)"}
    return certify(
        workload_for,
        plans,
        options=data.certify,
        accumulation=accumulation,
        global_batch=global_batch,
        device=str(env.device),
        loss_parallel=loss_parallel,
        compared=compared,
        loss_reduction=loss_reduction,
        ignore_index=ignore_index,
        optimizer=optimizer,
    )
