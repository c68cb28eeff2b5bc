"""What both jobs of ``shardwise train`` share (the built-in GPT, :mod:`shardwise.jobs.train`, and
Hugging Face fine-tuning, :mod:`shardwise.jobs.hf_train`): the Trainer they build from the job's
configuration, the summary, the optimizer factory, the run directory's checks and the resolved
configuration file, the run name all ranks agree on."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.callback import Callback
from shardwise.config import TrainJobConfig, check_output_dir, to_toml
from shardwise.errors import ConfigError
from shardwise.jobs.tracking import tracker_loggers
from shardwise.shape import TransformerShape

if TYPE_CHECKING:
    from shardwise.checkpoint.hf_load import Pretrained
    from shardwise.runtime.detect import RuntimeEnv
    from shardwise.train import Trainer


@dataclass(frozen=True)
class JobSummary:
    """What rank 0 writes to ``<run_dir>/summary.json`` and the command prints at the end."""

    run_dir: str
    steps: int
    world_size: int
    plan: str
    val_loss: float | None
    train_loss: float | None
    unigram_entropy: float
    elapsed_s: float
    params: int
    sample: str
    unit: str = "char"  # what the loss is per: a character (the built-in job) or a token (model.hf)
    total_steps: int | None = None  # the steps the run was to train
    stopped: str | None = None  # None: ran to the end; "preempted" (by a signal) or "stopped" (by a callback)
    stop_signal: str | None = None  # "SIGTERM", "SIGUSR1" when pre-empted
    checkpoint: str | None = None  # the checkpoint saved when pre-empted


def stop_fields(trainer: Any, stop: Any) -> dict[str, Any]:
    """The :class:`JobSummary` fields of how ``fit`` ended (``FitResult.stop``; None: at its last step)."""
    return {"total_steps": trainer.total_steps, "stopped": stop.reason if stop else None,
            "stop_signal": stop.signal if stop else None, "checkpoint": stop.checkpoint if stop else None}


def adamw(params: Iterable[nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW (betas 0.9, 0.95) with weight decay on matrices (linear weights, embeddings), not on biases or LayerNorm gains."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def precision_override(precision: str) -> str | None:
    """``train.precision`` as an override of the plan's: the default fp32 leaves a plan's own
    ``precision=bf16`` alone instead of contradicting it."""
    return None if precision == "fp32" else precision


def default_run_name() -> str:
    return time.strftime("gpt-stdlib-%Y%m%d-%H%M%S")


class WriteConfig(Callback):
    """Rank 0 writes the run's resolved configuration to ``<run_dir>/config.toml`` when training
    starts: after the checkpoint callback restored (or refused) a resume, so a refused resume
    leaves the run directory as it was."""

    def __init__(self, config: TrainJobConfig, run_dir: str) -> None:
        self.config, self.run_dir = config, run_dir

    def on_fit_start(self, trainer: Any) -> None:
        if trainer.env.is_main:
            os.makedirs(self.run_dir, exist_ok=True)
            with open(os.path.join(self.run_dir, "config.toml"), "w") as fh:
                fh.write(to_toml(self.config))


def check_run_dir(run_dir: str) -> None:
    """One line, before anything is written, when the run directory cannot be created or written."""
    check_output_dir(run_dir, what="run directory", hint="choose another --run.runs_dir or --run.name")


def check_fresh_start(run_dir: str) -> None:
    """A run that does not resume must not start over the checkpoints of another: its own saves
    would mix with them, and a restart (which resumes) could pick up the other run's newer step."""
    from shardwise.checkpoint import commit as cm

    newest = cm.latest_complete(os.path.join(run_dir, "checkpoints"), level="none")
    if newest is not None:
        raise ConfigError(f"run directory {run_dir!r} already holds checkpoints (newest: step {newest.step})",
                          hint="add --resume auto to continue that run, or choose another --run.name")


def job_resume(config: TrainJobConfig, env: RuntimeEnv, run_dir: str) -> str | None:
    """``"auto"`` when the job continues its run: ``checkpoint.resume = "auto"``, or a restarted
    attempt (the elastic agent's restart count is above 0), whatever the setting says. Otherwise
    None, once the run directory is known to hold no other run's checkpoints."""
    resume = "auto" if config.checkpoint.resume == "auto" or env.settings.restart_count > 0 else None
    if resume is None:
        check_fresh_start(run_dir)
    return resume


def job_trainer(model: nn.Module | Pretrained, *, loss_fn: Callable[[Any, Any], torch.Tensor], config: TrainJobConfig, env: RuntimeEnv,
                run_dir: str, shape: TransformerShape, resume: str | None, callbacks: Sequence[Callback] = ()) -> Trainer:
    """The Trainer of both jobs, built from ``config`` (whose ``run.name`` all ranks agreed on):
    AdamW with decay on matrices, warmup + cosine over the steps ``fit`` counts, the plan the
    command resolved (``auto``: the Trainer plans), ``train.precision`` as an override of the
    plan's, clipping, limits, evaluation and logging cadence, checkpoints in
    ``<run_dir>/checkpoints`` (with this attempt's injected fault, recovery tests only), the loss
    curves, ``config.toml``, then ``callbacks``; the ``[log]`` tracker, which continues its run
    when ``resume`` (what :func:`job_resume` decided) is set. ``shape`` (FLOPs per token,
    ``seq_len``) gives the MFU and token rates."""
    from shardwise.checkpoint import CheckpointManager
    from shardwise.checkpoint.faults import Fault
    from shardwise.train import PlotCurves, Trainer, warmup_cosine

    t, ckpt = config.train, config.checkpoint
    fault = Fault.for_attempt(env.settings.fault, env.settings.restart_count)
    return Trainer(
        model,
        loss_fn=loss_fn,
        optimizer=partial(adamw, lr=t.lr, weight_decay=t.weight_decay),
        plan=config.parallel.plan,
        precision=precision_override(t.precision),
        global_batch_size=t.global_batch_size,
        grad_accum_steps=t.grad_accum_steps,
        clip_grad_norm=t.clip_grad_norm or None,
        scale_lr=t.scale_lr,
        lr_scheduler=warmup_cosine(warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio),  # total steps from fit
        callbacks=[PlotCurves(), WriteConfig(config, run_dir), *callbacks],
        loggers=tracker_loggers(config, resume=resume is not None),
        seed=config.run.seed,
        max_steps=t.max_steps or None,
        max_epochs=t.max_epochs or None,
        eval_every=t.eval_every or None,
        log_every=t.log_every,
        num_workers=config.data.num_workers,
        run_dir=run_dir,
        flops_per_sample=shape.flops_per_token() * shape.seq_len,
        tokens_per_sample=shape.seq_len,
        checkpoint=CheckpointManager(os.path.join(run_dir, "checkpoints"), every_n_steps=ckpt.every_n_steps or None,
                                     keep_last_n=ckpt.keep_last_n, async_save=ckpt.async_save, fault=fault),
    )


def cut_short_line(summary: JobSummary, resume_command: str) -> str | None:
    """The summary line of a run that ended before its last step (None when it ran to the end)."""
    of = f" of {summary.total_steps}" if summary.total_steps else ""
    if summary.stopped == "preempted":
        return (f"pre-empted by {summary.stop_signal} at step {summary.steps}{of}: checkpoint saved at "
                f"{summary.checkpoint}; resume with: {resume_command}")
    if summary.stopped == "stopped":
        return f"stopped early at step {summary.steps}{of} (a callback ended training)"
    return None


def format_summary(summary: JobSummary, resume_command: str = "shardwise train --resume auto") -> str:
    """The closing lines of ``shardwise train``: validation loss against the unigram entropy, a sample.
    A run cut short says so first, and a pre-empted one says how to continue instead of a loss."""
    lines = []
    unit = summary.unit
    short = cut_short_line(summary, resume_command)
    if short is not None:
        lines.append(short)
    if summary.val_loss is not None and summary.stopped != "preempted":
        ratio = summary.val_loss / summary.unigram_entropy
        lines.append(f"validation loss {summary.val_loss:.4f} nats/{unit} ({summary.val_loss / math.log(2):.3f} bits/{unit}) after "
                     f"{summary.steps} steps in {summary.elapsed_s:.0f} s; the corpus's unigram entropy is "
                     f"{summary.unigram_entropy:.4f} nats/{unit} (the loss is {ratio:.0%} of it)")
    if summary.sample:
        lines.append("sample:\n" + "\n".join("  | " + line for line in summary.sample.splitlines()))
    files = "metrics.csv, curves.png, config.toml, summary.json, " + ("sample.txt, checkpoints/" if unit == "char" else "checkpoints/ (export: "
             f"shardwise checkpoint export --format hf {summary.run_dir}/checkpoints OUT)")
    lines.append(f"logs: {summary.run_dir}/ ({files})")
    return "\n".join(lines)


def _agree_on_name(name: str) -> str:
    """Rank 0's run name on every rank (the default name holds a timestamp that may differ)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return name
    box = [name]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _with_name(config: TrainJobConfig, name: str) -> TrainJobConfig:
    return replace(config, run=replace(config.run, name=name))
