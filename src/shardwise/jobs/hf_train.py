"""The worker side of ``shardwise train --model.hf DIR --data.files 'path/**/*.txt'``: fine-tune a
Hugging Face causal language model on local text, under any plan.

What one process does, top to bottom (the built-in job's steps, :mod:`shardwise.jobs.train`, with
the model and data swapped):

1. join the process group and agree on the run name;
2. tokenize the data files with the directory's own tokenizer and pack them into windows of
   ``seq_len + 1`` tokens (:mod:`shardwise.data.text`; ``seq_len`` is ``model.seq_len``, at most
   the model's ``max_position_embeddings``);
3. ``Trainer(Pretrained(DIR), ...)``: the model is built on meta, parallelized by the plan (``auto``
   plans with the shape read from ``config.json``) and each rank reads only its own slices of the
   weights; AdamW, warmup + cosine, gradient clipping, as the built-in job;
4. rank 0 keeps the directory's config and tokenizer in ``<run_dir>/checkpoints/hf/`` when training
   starts, so ``shardwise checkpoint export --format hf <run_dir>/checkpoints OUT`` needs nothing else;
5. ``fit`` (``--resume auto`` continues from the newest complete checkpoint at the exact data
   position), then rank 0 writes ``summary.json``. No text sample is generated.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

from shardwise.callback import Callback
from shardwise.config import TrainJobConfig
from shardwise.errors import ConfigError


class KeepModelFiles(Callback):
    """Rank 0 copies the model directory's config and tokenizer next to the checkpoints (for the export)."""

    def __init__(self, model_dir: str, checkpoint_dir: str) -> None:
        self.model_dir, self.checkpoint_dir = model_dir, checkpoint_dir

    def on_fit_start(self, trainer: Any) -> None:
        if trainer.env.is_main:
            from shardwise.checkpoint.hf_export import keep_model_files

            keep_model_files(self.model_dir, self.checkpoint_dir)


def check_hf_job(config: TrainJobConfig) -> None:
    """The command's checks before any process starts: the model directory (its config.json and a
    tokenizer file) and at least one data file (one line naming what is missing)."""
    import os.path

    from shardwise.data.text import find_files
    from shardwise.models.hf import read_config, require_transformers

    require_transformers()
    read_config(config.model.hf)
    if not any(os.path.exists(os.path.join(config.model.hf, n)) for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ConfigError(f"model directory {config.model.hf!r} holds no tokenizer", hint="save one there with tokenizer.save_pretrained(dir)")
    if not config.data.files:
        raise ConfigError("model.hf needs data to fine-tune on", hint="pass --data.files 'path/**/*.txt' (text or JSONL files)")
    find_files(config.data.files)


def window_length(requested: int, config: dict[str, Any]) -> int:
    """``model.seq_len``, capped at the positions the model has."""
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    return min(requested, int(limit)) if limit else requested


def run_hf_job(config: TrainJobConfig, env: Any) -> Any:
    """Fine-tune ``config.model.hf`` on ``config.data.files`` (module doc) in the joined group
    ``env`` (:func:`shardwise.jobs.train.run_job` holds the pre-emption handlers); the summary on
    rank 0. A restarted attempt resumes, as the built-in job does."""
    from shardwise.checkpoint.hf_load import Pretrained
    from shardwise.data.corpus import CharWindows
    from shardwise.data.text import load_text_corpus
    from shardwise.jobs.common import _agree_on_name, _with_name, job_resume, job_trainer
    from shardwise.jobs.summary import JobSummary, check_run_dir, default_run_name, stop_fields
    from shardwise.models.hf import lm_loss, load_tokenizer, read_config, shape_of

    if not config.data.files:
        raise ConfigError("model.hf needs data to fine-tune on", hint="pass --data.files 'path/**/*.txt' (text or JSONL files)")
    name = _agree_on_name(config.run.name or default_run_name().replace("gpt-stdlib", "hf"))
    config = _with_name(config, name)
    run_dir = os.path.join(config.run.runs_dir, name)
    check_run_dir(run_dir)
    model_config = read_config(config.model.hf)
    seq = window_length(config.model.seq_len, model_config)
    tokenizer = load_tokenizer(config.model.hf)
    corpus = load_text_corpus(config.data.files, tokenize=lambda text: tokenizer.encode(text, add_special_tokens=False),
                              eos_id=tokenizer.eos_token_id, vocab_size=int(model_config["vocab_size"]),
                              val_fraction=config.data.val_fraction, text_key=config.data.text_key)
    train_set, val_set = CharWindows(corpus.train, seq), CharWindows(corpus.val, seq)
    shape = shape_of(model_config, seq_len=seq)
    resume = job_resume(config, env, run_dir)
    trainer = job_trainer(Pretrained(config.model.hf), loss_fn=lm_loss, config=config, env=env, run_dir=run_dir, shape=shape,
                          resume=resume, callbacks=[KeepModelFiles(config.model.hf, os.path.join(run_dir, "checkpoints"))])
    trainer.setup(train_set)  # plan="auto": chosen from the training data (a no-op for other plans)
    if env.is_main:
        if trainer.auto_choice is not None:
            print(f"plan=auto chose {trainer.plan}:\n  " + trainer.plan.describe().replace("\n", "\n  "), flush=True)
        load = trainer.model.extras.get("load")
        print(f"data: {len(corpus.files)} file(s), {corpus.documents} document(s), {len(corpus.train):,} training / "
              f"{len(corpus.val):,} validation tokens, windows of {seq} tokens", flush=True)
        print(f"model: {model_config.get('model_type')} from {config.model.hf}, {shape.layers} layers x {shape.hidden} hidden, "
              f"{load.elements_total:,} parameters; rank 0 read {load.elements_read:,} of them", flush=True)
    result = trainer.fit(train_set, val_set, resume=resume)
    if not env.is_main:
        return None
    summary = JobSummary(run_dir=run_dir, steps=result.step, world_size=env.world_size, plan=str(trainer.plan),
                         val_loss=result.val_metrics.get("val_loss"), train_loss=result.train_loss,
                         unigram_entropy=corpus.unigram_entropy, elapsed_s=result.elapsed_s, params=trainer.model.extras["load"].elements_total,
                         sample="", unit="token", **stop_fields(trainer, result.stop))
    with open(os.path.join(run_dir, "summary.json"), "w") as fh:
        json.dump(asdict(summary), fh, indent=2)
    return summary
