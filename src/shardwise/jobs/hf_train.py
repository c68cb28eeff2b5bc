"""The worker side of ``shardwise train --model.hf DIR --data.files 'path/**/*.txt'``: fine-tune a
Hugging Face causal language model on local text, under any plan.

What one process does, top to bottom (the built-in job's steps, :mod:`shardwise.jobs.train`, with
the model and data swapped):

1. join the process group and agree on the run name;
2. tokenize the data files with the directory's own tokenizer and pack them into windows of
   ``seq_len + 1`` tokens (:mod:`shardwise.data.text`; ``seq_len`` is ``model.seq_len``, at most
   the model's ``max_position_embeddings``), or with ``data.streaming`` read them as a packed
   stream (:func:`job_data`); instruction data (``data.format`` ``prompt_completion`` or ``chat``)
   becomes padded or packed samples with a loss mask (:mod:`shardwise.jobs.instruct_data`);
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
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

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
    """The command's checks before any process starts: the model directory (its config.json, its
    weights whole and of the config's shapes, a tokenizer file) and at least one data file (one
    line naming what is missing)."""
    import os.path

    from shardwise.checkpoint.hf_load import Pretrained
    from shardwise.checkpoint.weights_check import check_weights
    from shardwise.data.text import find_files
    from shardwise.models.hf import check_transformers, read_config

    check_transformers()  # the workers import it: here only what the checks below need
    read_config(config.model.hf)
    model = Pretrained(config.model.hf).build_meta()
    check_weights(
        config.model.hf, model
    )  # whole files, every shard of the index, the shapes config.json gives (headers only)
    if config.lora.r:  # the targets against the model's own layers (built on meta), the extras installed
        lora = lora_spec(config)
        if lora.base == "nf4":
            from shardwise.models.nf4 import require_torchao

            require_torchao()
        lora.peft_config(model)
    if not any(
        os.path.exists(os.path.join(config.model.hf, n)) for n in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        raise ConfigError(
            f"model directory {config.model.hf!r} holds no tokenizer",
            hint="save one there with tokenizer.save_pretrained(dir)",
        )
    if not config.data.files:
        raise ConfigError(
            "model.hf needs data to fine-tune on", hint="pass --data.files 'path/**/*.txt' (text or JSONL files)"
        )
    files = find_files(config.data.files)
    if config.data.format != "text":  # options, tokenizer, packing, and the records themselves
        from shardwise.jobs.instruct_data import check_instruct_job

        window = window_length(config.model.seq_len, read_config(config.model.hf))
        print(f"data: {check_instruct_job(config, window=window)}", flush=True)
        if config.data.streaming:
            from shardwise.data.streaming import require_torchdata

            require_torchdata()
        return
    if config.data.streaming:  # the stream's own checks (torchdata, suffixes, parquet columns), reading no data
        from shardwise.data.documents import document_source
        from shardwise.data.streaming import require_torchdata

        require_torchdata()
        document_source(
            files, text_key=config.data.text_key, has_tokenizer=True, bin_dtype=np.dtype("uint16"), shuffle=True, seed=0
        )
        if config.data.val_files:
            find_files(config.data.val_files)


def lora_spec(config: TrainJobConfig) -> Any:
    """The :class:`~shardwise.models.lora.LoRA` of the ``[lora]`` table (alpha 0: twice r), or None when ``r`` is 0."""
    section = config.lora
    if section.r == 0:
        return None
    from shardwise.models.lora import LoRA

    targets = tuple(t.strip() for t in section.targets.split(",") if t.strip()) or None
    return LoRA(
        r=section.r, alpha=section.alpha or 2.0 * section.r, dropout=section.dropout, targets=targets, base=section.base
    )


def window_length(requested: int, config: dict[str, Any]) -> int:
    """``model.seq_len``, capped at the positions the model has."""
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    return min(requested, int(limit)) if limit else requested


@dataclass(frozen=True)
class JobData:
    """The job's training and validation data, what the log says of them, and the unigram entropy
    (nats/token) its validation loss is compared with."""

    train: Any
    val: Any
    description: str
    unigram_entropy: float | None  # None: no validation split
    collate: Any = None  # instruction data: pads the samples of a batch


def job_data(config: TrainJobConfig, tokenizer: Any, *, vocab_size: int, seq: int) -> JobData:
    """Step 2 of the module doc: windows of ``seq + 1`` tokens of ``data.files``, tokenized whole
    into a map-style dataset (the last ``data.val_fraction`` for validation), or with
    ``data.streaming`` a :class:`~shardwise.data.streaming.PackedStream` of them (file order and,
    with ``data.shuffle_windows``, windows shuffled per epoch, seeded by ``run.seed``) and the
    windows of ``data.val_files`` for validation."""
    from shardwise.data.corpus import CharWindows
    from shardwise.data.streaming import PackedStream
    from shardwise.data.text import find_files, load_text_corpus, load_tokens, unigram_entropy

    d = config.data
    if d.format != "text":
        from shardwise.jobs.instruct_data import instruct_job_data

        return JobData(*instruct_job_data(config, tokenizer, seq=seq))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    eos = tokenizer.eos_token_id
    if not d.streaming:
        corpus = load_text_corpus(
            d.files,
            tokenize=encode,
            eos_id=eos,
            vocab_size=vocab_size,
            val_fraction=d.val_fraction,
            text_key=d.text_key,
        )
        return JobData(CharWindows(corpus.train, seq), CharWindows(corpus.val, seq),
                       f"{len(corpus.files)} file(s), {corpus.documents} document(s), {len(corpus.train):,} training / "
                       f"{len(corpus.val):,} validation tokens", corpus.unigram_entropy)
    files = find_files(d.files)
    stream = PackedStream(
        files,
        seq_len=seq,
        tokenize=encode,
        eos_id=eos,
        text_key=d.text_key,
        shuffle=True,
        seed=config.run.seed,
        shuffle_windows=d.shuffle_windows,
    )
    if not d.val_files:
        return JobData(stream, None, f"{len(files)} file(s) streamed, no validation (data.val_files)", None)
    val_paths = find_files(d.val_files)
    tokens, documents = load_tokens(val_paths, tokenize=encode, eos_id=eos, vocab_size=vocab_size, text_key=d.text_key)
    if len(tokens) < seq + 1:
        raise ConfigError(
            f"data.val_files hold {len(tokens)} tokens, less than one window of {seq + 1}", hint="add validation text"
        )
    return JobData(
        stream,
        CharWindows(tokens, seq),
        f"{len(files)} file(s) streamed; validation {len(val_paths)} file(s), "
        f"{documents} document(s), {len(tokens):,} tokens",
        unigram_entropy(tokens, vocab_size),
    )


def _print_setup(
    trainer: Any, config: TrainJobConfig, data: Any, *, seq: int, model_config: dict, shape: Any, source: Any
) -> None:
    """Rank 0's lines before the first step: the plan ``plan="auto"`` chose, the data, the loss
    reduction, the model and what rank 0 read of it, and the LoRA adapters."""
    from shardwise.parallel.reduction import LossReduction

    if trainer.auto_choice is not None:
        print(f"plan=auto chose {trainer.plan}:\n  " + trainer.plan.describe().replace("\n", "\n  "), flush=True)
    load = trainer.model.load
    print(
        f"data: {data.description}" + (f", windows of {seq} tokens" if config.data.format == "text" else ""),
        flush=True,
    )
    print(LossReduction(config.train.loss_reduction).describe(), flush=True)
    print(
        f"model: {model_config.get('model_type')} from {config.model.hf}, {shape.layers} layers x {shape.hidden} "
        f"hidden, {load.elements_total:,} parameters; rank 0 read {load.elements_read:,} of them",
        flush=True,
    )
    if source.lora is not None:
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        print(
            f"lora: r={source.lora.r}, alpha={source.lora.alpha:g}, base {source.lora.base}; rank 0 trains "
            f"{trainable:,} adapter elements, the base is frozen (checkpoints hold the adapters only)",
            flush=True,
        )


def run_hf_job(config: TrainJobConfig, env: Any) -> Any:
    """Fine-tune ``config.model.hf`` on ``config.data.files`` (module doc) in the joined group
    ``env`` (:func:`shardwise.jobs.train.run_job` holds the pre-emption handlers); the summary on
    rank 0. A restarted attempt resumes, as the built-in job does."""
    from shardwise.checkpoint.hf_load import Pretrained
    from shardwise.jobs.common import _agree_on_name, _with_name, job_resume, job_trainer
    from shardwise.jobs.summary import JobSummary, check_run_dir, default_run_name, stop_fields
    from shardwise.models.hf import lm_loss, load_tokenizer, read_config, shape_of

    if not config.data.files:
        raise ConfigError(
            "model.hf needs data to fine-tune on", hint="pass --data.files 'path/**/*.txt' (text or JSONL files)"
        )
    name = _agree_on_name(config.run.name or default_run_name().replace("gpt-stdlib", "hf"))
    config = _with_name(config, name)
    run_dir = os.path.join(config.run.runs_dir, name)
    check_run_dir(run_dir)
    model_config = read_config(config.model.hf)
    seq = window_length(config.model.seq_len, model_config)
    if config.data.format != "text":
        from shardwise.jobs.instruct_data import sample_length

        seq = sample_length(config, seq)
    data = job_data(config, load_tokenizer(config.model.hf), vocab_size=int(model_config["vocab_size"]), seq=seq)
    train_set, val_set = data.train, data.val
    shape = shape_of(model_config, seq_len=seq)
    resume = job_resume(config, env, run_dir)
    source = Pretrained(
        config.model.hf, lora=lora_spec(config), seed=config.run.seed
    )  # [lora] r > 0: adapters on a frozen base
    trainer = job_trainer(
        source,
        loss_fn=lm_loss,
        config=config,
        env=env,
        run_dir=run_dir,
        shape=shape,
        resume=resume,
        callbacks=[KeepModelFiles(config.model.hf, os.path.join(run_dir, "checkpoints"))],
        collate_fn=data.collate,
    )
    trainer.setup(train_set)  # plan="auto": chosen from the training data (a no-op for other plans)
    if env.is_main:
        _print_setup(trainer, config, data, seq=seq, model_config=model_config, shape=shape, source=source)
    result = trainer.fit(train_set, val_set, resume=resume)  # no validation split: val_set is None
    if not env.is_main:
        return None
    summary = JobSummary(
        run_dir=run_dir,
        steps=result.step,
        world_size=env.world_size,
        plan=str(trainer.plan),
        val_loss=result.val_metrics.get("val_loss"),
        train_loss=result.train_loss,
        unigram_entropy=data.unigram_entropy,
        elapsed_s=result.elapsed_s,
        params=trainer.model.load.elements_total,
        sample="",
        unit="token",
        **stop_fields(trainer, result.stop),
    )
    with open(os.path.join(run_dir, "summary.json"), "w") as fh:
        json.dump(asdict(summary), fh, indent=2)
    return summary
