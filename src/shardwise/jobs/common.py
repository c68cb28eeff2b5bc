"""What both jobs of ``shardwise train`` share (the built-in GPT, :mod:`shardwise.jobs.train`, and
Hugging Face fine-tuning, :mod:`shardwise.jobs.hf_train`): the Trainer they build from the job's
configuration, the optimizer factory, the resolved configuration file, the run name all ranks
agree on (the summary and the run directory's checks, which the command uses before torch is
imported: :mod:`shardwise.jobs.summary`)."""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.callback import Callback
from shardwise.config import TrainJobConfig, to_toml
from shardwise.jobs.summary import check_fresh_start, precision_override
from shardwise.jobs.tracking import tracker_loggers
from shardwise.shape import TransformerShape

if TYPE_CHECKING:
    from shardwise.checkpoint.hf_load import Pretrained
    from shardwise.runtime.detect import RuntimeEnv
    from shardwise.train import Trainer


def adamw(params: Iterable[nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW (betas 0.9, 0.95) with weight decay on matrices (linear weights, embeddings), not on biases or LayerNorm
    gains."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def job_optimizer(t: Any) -> Any:
    """``train.optimizer``: AdamW (decay on matrices) or ``shardwise.optim.muon`` (Muon at
    ``train.muon_lr`` on the hidden matrices, AdamW at ``train.lr`` on the rest), both with
    ``train.weight_decay``."""
    if t.optimizer == "muon":
        from shardwise.optim import muon

        return muon(lr=t.muon_lr, weight_decay=t.weight_decay, adamw_lr=t.lr, adamw_weight_decay=t.weight_decay)
    return partial(adamw, lr=t.lr, weight_decay=t.weight_decay)


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


def job_resume(config: TrainJobConfig, env: RuntimeEnv, run_dir: str) -> str | None:
    """``"auto"`` when the job continues its run: ``checkpoint.resume = "auto"``, or a restarted
    attempt (the elastic agent's restart count is above 0), whatever the setting says. Otherwise
    None, once the run directory is known to hold no other run's checkpoints."""
    resume = "auto" if config.checkpoint.resume == "auto" or env.settings.restart_count > 0 else None
    if resume is None:
        check_fresh_start(run_dir)
    return resume


def job_trainer(
    model: nn.Module | Pretrained,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    config: TrainJobConfig,
    env: RuntimeEnv,
    run_dir: str,
    shape: TransformerShape,
    resume: str | None,
    callbacks: Sequence[Callback] = (),
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Trainer:
    """The Trainer of both jobs, built from ``config`` (whose ``run.name`` all ranks agreed on):
    AdamW with decay on matrices, warmup + cosine over the steps ``fit`` counts, the plan the
    command resolved (``auto``: the Trainer plans), ``train.precision`` as an override of the
    plan's, clipping, limits, evaluation and logging cadence, checkpoints in
    ``<run_dir>/checkpoints`` (with this attempt's injected fault, recovery tests only), the
    progress bar (lines every ``log.progress_every_s`` without a terminal), the loss curves,
    ``config.toml``, then ``callbacks``; the ``[log]`` tracker, which continues its run
    when ``resume`` (what :func:`job_resume` decided) is set. ``shape`` (FLOPs per token,
    ``seq_len``) gives the MFU and token rates. Micro-batch losses are weighted by
    ``train.loss_reduction`` (by default by their valid targets); ``collate_fn`` batches the
    samples (instruction data: padding)."""
    from shardwise.checkpoint import CheckpointManager
    from shardwise.checkpoint.faults import Fault
    from shardwise.train import (
        DataOptions,
        LoggingOptions,
        PlotCurves,
        ProgressBar,
        Trainer,
        TrainOptions,
        warmup_cosine,
    )

    t, ckpt = config.train, config.checkpoint
    fault = Fault.for_attempt(env.settings.fault, env.settings.restart_count)
    return Trainer(
        model,
        loss_fn=loss_fn,
        optimizer=job_optimizer(t),
        plan=config.parallel.plan,
        precision=precision_override(t.precision),
        global_batch_size=t.global_batch_size,
        # the [train] table; its 0s mean "off", the Trainer's None
        train=TrainOptions(
            grad_accum_steps=t.grad_accum_steps,
            clip_grad_norm=t.clip_grad_norm or None,
            scale_lr=t.scale_lr,
            lr_scheduler=warmup_cosine(
                warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio
            ),  # total steps from fit
            seed=config.run.seed,
            max_steps=t.max_steps or None,
            max_epochs=t.max_epochs or None,
            eval_every=t.eval_every or None,
            loss_reduction=t.loss_reduction,
        ),
        data=DataOptions(num_workers=config.data.num_workers, collate_fn=collate_fn),
        logging=LoggingOptions(
            loggers=tracker_loggers(config, resume=resume is not None),
            log_every=t.log_every,
            run_dir=run_dir,
            flops_per_sample=shape.flops_per_token() * shape.seq_len,
            tokens_per_sample=shape.seq_len,
        ),
        callbacks=[
            ProgressBar(every_s=config.log.progress_every_s),
            PlotCurves(),
            WriteConfig(config, run_dir),
            *callbacks,
        ],
        checkpoint=CheckpointManager(
            os.path.join(run_dir, "checkpoints"),
            every_n_steps=ckpt.every_n_steps or None,
            keep_last_n=ckpt.keep_last_n,
            async_save=ckpt.async_save,
            fault=fault,
        ),
    )


def _agree_on_name(name: str) -> str:
    """Rank 0's run name on every rank (the default name holds a timestamp that may differ)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return name
    box = [name]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _with_name(config: TrainJobConfig, name: str) -> TrainJobConfig:
    return replace(config, run=replace(config.run, name=name))
