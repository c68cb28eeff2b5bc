"""The worker side of ``shardwise train``: one process of the built-in GPT job.

Each process runs ``python -m shardwise.jobs.train [--config run.toml] [--section.key=value ...]``
(the same configuration grammar as the command), so the job also runs under any launcher::

    shardwise run --nproc-per-node 4 -m shardwise.jobs.train --train.max_steps=200
    srun --ntasks-per-node=1 shardwise run -m shardwise.jobs.train --config run.toml

What one process does, top to bottom:

1. join the process group (:func:`shardwise.init`) and agree on the run name (rank 0's);
2. read the standard-library corpus (every rank reads the same files; a second, no download);
3. build the GPT from the seed (identical on every rank), the AdamW factory (decay on matrices
   only), the warmup + cosine schedule and the learning rate scaled with the data-parallel size;
4. ``Trainer.fit`` on the training windows, evaluating on the validation windows; when training
   starts rank 0 keeps the model's shape and the corpus's characters in
   ``<run_dir>/checkpoints/gpt/model.json`` (:mod:`shardwise.checkpoint.gpt_files`), so
   ``shardwise generate --checkpoint <run_dir>/checkpoints`` needs nothing else;
5. every rank samples the same text from the same generator (so a layout whose forward
   communicates works too); rank 0 writes ``summary.json`` and ``sample.txt`` into the run dir.

Pre-emption: the process holds the pre-emption handlers (SIGTERM, SIGUSR1) from the moment it has
joined the group until it exits, so a signal while it builds the model is honoured at the first
step (a save, then a clean stop) and one after ``fit`` cannot kill a worker that is writing its
last files. Before that (importing torch, joining the group) a signal ends the worker at once:
nothing is lost yet, and joining needs the launcher's store, so a worker whose launcher died then
must not wait. The launcher's grace period (SIGKILL after ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) or,
when the launcher is gone, the worker's own deadline (:mod:`shardwise.runtime.parent`) bounds how
long a stop may take. A pre-empted run saves, skips the
sample and records in ``summary.json`` how it stopped; the process exits 0 either way (a non-zero
exit would make the elastic agent restart it), and the launcher reports the signal. A restarted
attempt (``TORCHELASTIC_RESTART_COUNT`` > 0) always resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Subset

from shardwise.callback import Callback
from shardwise.config import TrainJobConfig, load_config, override_keys
from shardwise.jobs.common import _agree_on_name, _with_name, job_resume, job_trainer
from shardwise.jobs.summary import JobSummary, check_data_options, check_run_dir, default_run_name, stop_fields
from shardwise.data.corpus import CharVocab, CharWindows, load_stdlib_corpus
from shardwise.errors import ShardwiseError
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.runtime.detect import RuntimeEnv
from shardwise.runtime.env import init, shutdown
from shardwise.shape import TransformerShape


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy in nats over all positions of the batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class KeepGPTFiles(Callback):
    """Rank 0 writes the GPT's shape and vocabulary beside the checkpoints when training starts
    (after a resume was accepted, as ``config.toml``), for ``shardwise generate``."""

    def __init__(self, shape: TransformerShape, vocab: CharVocab, checkpoint_dir: str) -> None:
        self.shape, self.vocab, self.checkpoint_dir = shape, vocab, checkpoint_dir

    def on_fit_start(self, trainer: Any) -> None:
        if trainer.env.is_main:
            from shardwise.checkpoint.gpt_files import GPTFiles, keep_gpt_files

            keep_gpt_files(self.checkpoint_dir, GPTFiles(shape=self.shape, vocab=self.vocab))


def run_job(config: TrainJobConfig) -> JobSummary | None:
    """Train the GPT as ``config`` says; returns the summary on rank 0 and ``None`` elsewhere.

    The run directory's files are each written once, by rank 0: ``config.toml`` when training
    starts (after a resume was accepted, so a refused resume changes nothing), ``metrics.csv`` and
    ``auto_plan.json`` by the Trainer, ``curves.png``, then ``summary.json`` and ``sample.txt``;
    ``checkpoints/gpt/model.json`` beside the checkpoints when training starts.
    """
    from shardwise.checkpoint.signals import process_signal

    check_data_options(config)  # the command checked them; a direct start of this module too
    env = init()
    with process_signal():  # held from here until the job ends (see the module doc)
        if config.model.hf:
            from shardwise.jobs.hf_train import run_hf_job

            return run_hf_job(config, env)
        return _train(config, env)


def _train(config: TrainJobConfig, env: RuntimeEnv) -> JobSummary | None:
    name = _agree_on_name(config.run.name or default_run_name())
    config = _with_name(config, name)
    run_dir = os.path.join(config.run.runs_dir, name)
    check_run_dir(run_dir)
    corpus = load_stdlib_corpus(max_chars=config.data.max_chars, val_fraction=config.data.val_fraction)
    t = config.train
    # The vocabulary is padded to a multiple of 8 so that tensor parallelism can split the
    # embedding and the output layer evenly; the padded ids never occur and are never decoded.
    shape = GPTConfig(**{**config.model.shape().to_dict(), "vocab_size": -(-corpus.vocab_size // 8) * 8, "name": "gpt"})
    model = GPT(shape, seed=config.run.seed)
    train_set = CharWindows(corpus.train, shape.seq_len)
    val_set = CharWindows(corpus.val, shape.seq_len)
    if t.eval_windows and t.eval_windows < len(val_set):
        val_set = Subset(val_set, range(t.eval_windows))
    resume = job_resume(config, env, run_dir)  # a restarted attempt continues the run it replaces
    checkpoints = os.path.join(run_dir, "checkpoints")
    trainer = job_trainer(model, loss_fn=lm_loss, config=config, env=env, run_dir=run_dir, shape=shape, resume=resume,
                          callbacks=[KeepGPTFiles(model.config, corpus.tokenizer, checkpoints)])
    trainer.setup(train_set)  # plan="auto": chosen from the training data (a no-op for other plans)
    if env.is_main:
        if trainer.auto_choice is not None:
            print(f"plan=auto chose {trainer.plan}:\n  " + trainer.plan.describe().replace("\n", "\n  "), flush=True)
        print(f"corpus: {len(corpus.files)} files of the standard library, {len(corpus.text):,} characters "
              f"({len(corpus.train):,} train / {len(corpus.val):,} validation), vocabulary {corpus.vocab_size}, "
              f"unigram entropy {corpus.unigram_entropy:.3f} nats/char", flush=True)
        print(
            f"model: GPT {shape.layers} layers x {shape.hidden} hidden x {shape.heads} heads, context {shape.seq_len}, "
            f"{shape.param_count():,} parameters, {shape.flops_per_token() / 1e6:.2f} MFLOP/token; "
            f"lr {trainer.optimizer.param_groups[0]['lr']:g}, {trainer.total_steps_for(train_set)} steps of "
            f"{t.global_batch_size} sequences",
            flush=True,
        )
    result = trainer.fit(train_set, val_set, resume=resume)
    stop = result.stop
    # A pipeline stage holds only some layers, so it cannot generate text on its own; a pre-empted
    # run spends the scheduler's grace period on leaving, not on sampling.
    preempted = stop is not None and stop.reason == "preempted"
    sample = "" if trainer.plan.pp_enabled or preempted else _sample(trainer.model.module, corpus, config)
    if not env.is_main:
        return None
    summary = JobSummary(
        run_dir=run_dir, steps=result.step, world_size=env.world_size, plan=str(trainer.plan),
        val_loss=result.val_metrics.get("val_loss"), train_loss=result.train_loss,
        unigram_entropy=corpus.unigram_entropy, elapsed_s=result.elapsed_s, params=shape.param_count(), sample=sample,
        **stop_fields(trainer, stop),
    )
    with open(os.path.join(run_dir, "summary.json"), "w") as fh:
        json.dump(asdict(summary), fh, indent=2)
    with open(os.path.join(run_dir, "sample.txt"), "w") as fh:
        fh.write(sample)
    return summary


def _sample(module: nn.Module, corpus: Any, config: TrainJobConfig) -> str:
    if config.sample.chars == 0:
        return ""
    gpt = module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
    device = next(gpt.parameters()).device
    prompt = corpus.encode(config.sample.prompt or "\n").unsqueeze(0).to(device)
    gen = torch.Generator().manual_seed(config.run.seed)
    ids = gpt.generate(prompt, config.sample.chars, temperature=config.sample.temperature,
                       top_k=config.sample.top_k or None, generator=gen, vocab_limit=corpus.vocab_size)
    return corpus.decode(ids[0].tolist())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shardwise.jobs.train", description="One process of the built-in GPT job."
    )
    parser.add_argument("--config", default=None, help="TOML file (defaults < file < --section.key=value)")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        overrides, rest = override_keys(argv)
        args = parser.parse_args(rest)
        config = load_config(path=args.config, overrides=overrides)
        run_job(config)
    except ShardwiseError as err:
        from shardwise.launch.worker_errors import record_failure

        if not record_failure(err):  # under a launcher, it prints the line once for all ranks
            print(f"shardwise train: error: {err}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
