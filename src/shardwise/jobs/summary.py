"""What the ``shardwise train`` command and its workers share without torch: the summary rank 0
writes to ``<run_dir>/summary.json`` and the command prints, how a run that stopped early is
described, and the run directory's checks, done before any process starts (so bad input is
answered without importing torch)."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

from shardwise.config import TrainJobConfig, check_output_dir
from shardwise.errors import ConfigError


@dataclass(frozen=True)
class JobSummary:
    """What rank 0 writes to ``<run_dir>/summary.json`` and the command prints at the end."""

    run_dir: str
    steps: int
    world_size: int
    plan: str
    val_loss: float | None
    train_loss: float | None
    unigram_entropy: float | None  # None: no validation data to compare with
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


def precision_override(precision: str) -> str | None:
    """``train.precision`` as an override of the plan's: the default fp32 leaves a plan's own
    ``precision=bf16`` alone instead of contradicting it."""
    return None if precision == "fp32" else precision


def default_run_name() -> str:
    return time.strftime("gpt-stdlib-%Y%m%d-%H%M%S")


def check_data_options(config: TrainJobConfig) -> None:
    """The ``[data]`` options that only work together, checked before any process starts."""
    from shardwise.jobs.instruct_data import check_instruct_options

    data = config.data
    if (data.files or data.streaming or data.format != "text") and not config.model.hf:
        raise ConfigError("data.files, data.streaming and data.format are for fine-tuning a Hugging Face model",
                          hint="pass --model.hf DIR too, or drop them")
    if not data.streaming and (data.val_files or data.shuffle_windows):
        given = "data.val_files" if data.val_files else "data.shuffle_windows"
        raise ConfigError(f"{given} is an option of a streamed dataset", hint="add --data.streaming true, or drop it")
    if data.streaming and not config.train.max_steps:
        raise ConfigError("a streamed dataset has no length known before training", hint="set --max-steps N")
    check_instruct_options(config)
    if config.lora.r and not config.model.hf:
        raise ConfigError(
            "lora.r adds adapters to a Hugging Face model", hint="pass --model.hf DIR too, or drop --lora.*"
        )
    if config.lora.base == "nf4" and not config.lora.r:
        raise ConfigError(
            "lora.base=nf4 is QLoRA's 4-bit base under LoRA adapters", hint="add --lora.r 16 (or another rank)"
        )


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
    if summary.val_loss is not None and summary.unigram_entropy and summary.stopped != "preempted":
        ratio = summary.val_loss / summary.unigram_entropy
        lines.append(
            f"validation loss {summary.val_loss:.4f} nats/{unit} ({summary.val_loss / math.log(2):.3f} bits/{unit}) "
            f"after {summary.steps} steps in {summary.elapsed_s:.0f} s; the corpus's unigram entropy is "
            f"{summary.unigram_entropy:.4f} nats/{unit} (the loss is {ratio:.0%} of it)"
        )
    if summary.sample:
        lines.append("sample:\n" + "\n".join("  | " + line for line in summary.sample.splitlines()))
    files = "metrics.csv, curves.png, config.toml, summary.json, " + (
        "sample.txt, checkpoints/"
        if unit == "char"
        else f"checkpoints/ (export: shardwise checkpoint export --format hf {summary.run_dir}/checkpoints OUT)"
    )
    lines.append(f"logs: {summary.run_dir}/ ({files})")
    return "\n".join(lines)
