"""The Trainer's options in sections, as ``shardwise train`` groups its configuration in tables
(:mod:`shardwise.config.sections`)::

    Trainer(model, loss_fn=..., global_batch_size=64, optimizer=..., plan="dp", precision="bf16",
            train=TrainOptions(max_steps=1000, grad_accum_steps=2, clip_grad_norm=1.0),
            data=DataOptions(num_workers=2), parallel=ParallelOptions(fsdp=FSDPOptions(...)),
            logging=LoggingOptions(run_dir="runs/a", log_every=20), callbacks=[...], checkpoint="runs/a/ckpt")

Each section is a frozen dataclass whose defaults are the Trainer's; a section left out (or None)
is all defaults. The Trainer's earlier flat keywords (``max_steps=``, ``num_workers=``, ...) still
work with a :class:`DeprecationWarning` naming the new spelling: :data:`OLD_KEYWORDS` maps each to
its field, and :func:`accepts_old_keywords` moves them there before the constructor runs. An old
keyword beside a section that also sets its field (to anything but the default) is refused (one
:class:`~shardwise.errors.ConfigError` line): the Trainer does not guess which one was meant.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import MISSING, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from shardwise.data.loader import LoaderOptions
from shardwise.errors import ConfigError
from shardwise.parallel.ddp import DDPOptions
from shardwise.parallel.reduction import IGNORE_INDEX

if TYPE_CHECKING:
    from shardwise.parallel.fp8 import Fp8Options
    from shardwise.parallel.fsdp import FSDPOptions
    from shardwise.parallel.pipeline import PipelineOptions
    from shardwise.parallel.tp import TPOptions
    from shardwise.plan.cluster import ClusterSpec
    from shardwise.train.loggers import Logger
    from shardwise.train.metrics import MetricsArg
    from shardwise.train.precision import LossScaler
    from shardwise.auto.certify import CertifyOptions

SchedulerFactory = Callable[..., Any]  # (optimizer) or (optimizer, total_steps) -> scheduler


@dataclass(frozen=True)
class TrainOptions:
    """What one run does: accumulation, clipping, the learning-rate schedule, limits, evaluation
    and how micro-batch losses are weighed (the math: :mod:`shardwise.train.trainer`)."""

    grad_accum_steps: int = 1  # micro-steps per optimizer step (the all-reduce runs on the last)
    clip_grad_norm: float | None = None  # clip the global gradient 2-norm to this; None: no clipping
    # (optimizer) -> scheduler, built with the Trainer; or (optimizer, total_steps) -> scheduler,
    # built when fit knows the number of steps; stepped once per optimizer step
    lr_scheduler: SchedulerFactory | None = None
    scale_lr: str = "none"  # "linear" or "sqrt": scale the learning rates from 1 replica to dp_size
    seed: int = 0  # Python, NumPy and torch (seed + dp_rank) and the data order
    max_steps: int | None = None  # stop after this many optimizer steps
    max_epochs: int | None = None  # stop after this many epochs (neither limit: one epoch)
    eval_every: int | None = None  # evaluate every N steps; None: at each epoch's end and fit's end
    eval_batch_size: int | None = None  # per-rank evaluation batch; None: the micro-batch size
    loss_reduction: str = "samples"  # "samples": micro-batches weigh the same; "tokens": by valid targets
    ignore_index: int = IGNORE_INDEX  # the target value "tokens" does not count


@dataclass(frozen=True)
class DataOptions:
    """How the training and evaluation data are read (``torch.utils.data.DataLoader`` options and
    the order of the samples)."""

    num_workers: int = 0  # loader worker processes per rank
    pin_memory: bool = False  # page-locked batches, copied to the GPU without blocking
    persistent_workers: bool = False  # keep the workers (and their dataset copies) across epochs
    worker_start_method: str | None = None  # "fork" (fast), "spawn", "forkserver"; None: Python's default
    collate_fn: Callable[[list[Any]], Any] | None = None  # samples -> batch (None: torch's default)
    shuffle: bool = True  # reshuffle every epoch, from the seed and the epoch

    def loader(self) -> LoaderOptions:
        """The DataLoader's share of these options."""
        return LoaderOptions(
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
            collate_fn=self.collate_fn,
            worker_start_method=self.worker_start_method,
        )


@dataclass(frozen=True)
class PrecisionOptions:
    """The compute precision and what goes with it. ``precision="bf16"`` is short for
    ``precision=PrecisionOptions("bf16")``."""

    compute: str | None = None  # "fp32", "bf16", "fp16" or "fp8"; None: the plan's (fp32 unless it names one)
    fp8: Fp8Options | None = None  # which Linear layers precision="fp8" converts, and how (shardwise.parallel.fp8)
    loss_scaler: LossScaler | None = None  # fp16's dynamic loss scaling; None: LossScaler() defaults

    @classmethod
    def of(cls, value: str | PrecisionOptions | None) -> PrecisionOptions:
        return value if isinstance(value, PrecisionOptions) else cls(check_section("precision", value, str))


@dataclass(frozen=True)
class ParallelOptions:
    """The options of each technique a plan may use (the plan itself, which techniques and how many
    ranks each, is the Trainer's ``plan``), and what ``plan="auto"`` plans for and how it is proven."""

    ddp: DDPOptions = DDPOptions()  # buckets, comm hooks, SyncBatchNorm (shardwise.parallel.ddp)
    tp: TPOptions | None = None  # an explicit TP plan, loss_parallel (shardwise.parallel.tp)
    fsdp: FSDPOptions | None = None  # reshard_after_forward, reduce_dtype for zero plans
    pipeline: PipelineOptions | None = None  # where pp plans cut the model
    cluster: ClusterSpec | str | None = None  # plan="auto": a ClusterSpec, a preset or a spec file; None: this machine
    certify: bool | CertifyOptions | None = (
        None  # plan="auto": prove the choice by parity; None: for runs of 1000+ steps
    )


@dataclass(frozen=True)
class LoggingOptions:
    """What the run reports and where: loggers, cadence, evaluation metrics, the run directory,
    rank 0's progress, and the inputs of the throughput and MFU figures."""

    loggers: Sequence[Logger] = ()  # objects with log(metrics, step) and close()
    log_every: int = 10  # reduce and log the loss and throughput every N steps (one all-reduce)
    metrics: MetricsArg = None  # ["accuracy"] or {"name": fn(outputs, targets) -> (sum, count)}
    run_dir: str | os.PathLike[str] | None = None  # metrics.csv, TensorBoard, curves.png, auto_plan.json
    progress_bar: bool = True  # rank 0's progress: a bar on a terminal, lines in a log file
    flops_per_sample: float | None = None  # forward + backward FLOPs of one sample: enables MFU
    tokens_per_sample: int | None = None  # enables tokens_per_s; plan="auto" plans for this sequence length
    peak_flops_per_device: float | None = None  # for MFU; None: the known GPUs' figures


# The Trainer's section parameters and their classes.
SECTIONS: dict[str, type] = {"train": TrainOptions, "data": DataOptions, "precision": PrecisionOptions,
                             "parallel": ParallelOptions, "logging": LoggingOptions}

# Every earlier flat keyword of the Trainer -> the field it now is ("section.field[.field]").
OLD_KEYWORDS: dict[str, str] = {
    **{
        name: f"train.{name}"
        for name in (
            "grad_accum_steps",
            "clip_grad_norm",
            "lr_scheduler",
            "scale_lr",
            "seed",
            "max_steps",
            "max_epochs",
            "eval_every",
            "eval_batch_size",
            "loss_reduction",
            "ignore_index",
        )
    },
    **{
        name: f"data.{name}"
        for name in ("num_workers", "pin_memory", "persistent_workers", "worker_start_method", "collate_fn", "shuffle")
    },
    **{name: f"precision.{name}" for name in ("fp8", "loss_scaler")},
    **{name: f"parallel.{name}" for name in ("ddp", "tp", "fsdp", "pipeline", "cluster", "certify")},
    "sync_batchnorm": "parallel.ddp.sync_batchnorm",
    **{
        name: f"logging.{name}"
        for name in (
            "loggers",
            "log_every",
            "metrics",
            "run_dir",
            "progress_bar",
            "flops_per_sample",
            "tokens_per_sample",
            "peak_flops_per_device",
        )
    },
}


def check_section(name: str, value: Any, cls: type) -> Any:
    """``value`` if it is a ``cls``; None: ``cls()`` (all defaults), or None for precision's string."""
    if value is None:
        return None if cls is str else cls()
    if not isinstance(value, cls):
        example = f"{name}='bf16'" if cls is str else f"{name}={cls.__name__}(...)"
        raise ConfigError(
            f"Trainer({name}={value!r}) is not a {cls.__name__}", hint=f"pass {example} (shardwise.train.options)"
        )
    return value


def accepts_old_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """``Trainer.__init__`` that also takes the earlier flat keywords (:data:`OLD_KEYWORDS`), each
    moved into its section with a DeprecationWarning. Its signature stays the new one."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        old = {name: kwargs.pop(name) for name in list(kwargs) if name in OLD_KEYWORDS}
        if old:
            kwargs.update(sections_with(kwargs, old))
        init(self, *args, **kwargs)

    return wrapper


def sections_with(given: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """The sections of ``given`` (the new keywords) with the ``old`` keywords' values set in them."""
    out: dict[str, Any] = {}
    for name, value in sorted(
        old.items(), key=lambda item: OLD_KEYWORDS[item[0]].count(".")
    ):  # ddp= before sync_batchnorm=
        section, *path = OLD_KEYWORDS[name].split(".")
        cls = SECTIONS[section]
        current = out.get(section, given.get(section))
        current = PrecisionOptions.of(current) if cls is PrecisionOptions else check_section(section, current, cls)
        out[section] = _set(current, path, value, old=name)
        warnings.warn(
            f"Trainer({name}=...) is deprecated: use {section}={_spelling(current, path, value)}",
            DeprecationWarning,
            stacklevel=3,
        )  # the caller's Trainer(...) line (above this function and the wrapper)
    return out


def _set(options: Any, path: list[str], value: Any, *, old: str) -> Any:
    """``options`` with the field at ``path`` set to ``value``; refused if the section already sets it."""
    name = path[0]
    if len(path) > 1:
        return replace(options, **{name: _set(getattr(options, name), path[1:], value, old=old)})
    current, default = getattr(options, name), _default(type(options), name)
    if current is not default and current != default:
        raise ConfigError(
            f"Trainer got {old}={_short(value)} and {type(options).__name__}({name}={_short(current)}) both",
            hint=f"pass {name} once, in {type(options).__name__}",
        )
    return replace(options, **{name: value})


def _default(cls: type, name: str) -> Any:
    field = next(f for f in fields(cls) if f.name == name)
    return field.default if field.default is not MISSING else field.default_factory()  # type: ignore[misc]


def _spelling(options: Any, path: list[str], value: Any) -> str:
    """How the new keyword reads, e.g. ``TrainOptions(max_steps=5)``."""
    inner = _short(value) if len(path) == 1 else _spelling(getattr(options, path[0]), path[1:], value)
    return f"{type(options).__name__}({path[0]}={inner})"


def _short(value: Any) -> str:
    """``repr(value)`` if it is short and on one line, else ``...``."""
    text = repr(value)
    return text if len(text) <= 40 and "\n" not in text else "..."
