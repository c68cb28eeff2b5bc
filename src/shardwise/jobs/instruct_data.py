"""Instruction data for ``shardwise train --model.hf DIR --data.format prompt_completion|chat``: the
command's checks before any process starts, and each worker's datasets.

**Before any process starts** (:func:`check_instruct_job`, called by the command; one line and
exit 2 for each): options that do not go together (packing or ``train_on`` with text, packing
under context parallelism, whose split attention cannot keep packed samples apart), a tokenizer
without a chat template for ``chat``, a model that does not keep packed samples apart
(:func:`shardwise.models.hf.check_packing_of`), and the records themselves: a line that is not JSON
or lacks a field (file and line named), a chat without an assistant turn, and samples whose
prompt alone fills the context (counted and reported; none left is refused). The records are
all read and tokenized here, except with ``data.streaming``, where the first
:data:`STREAM_CHECK` of each file are (a worker that meets a bad record later stops with the same
line).

**Samples** are at most ``seq`` tokens: ``model.seq_len`` capped at the model's positions and
rounded down to :func:`pad_multiple` (padding rounds each batch up to it: context parallelism
splits the sequence into ``2 cp`` chunks, sequence parallelism into ``tp``).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from shardwise.config import TrainJobConfig
from shardwise.errors import ConfigError

STREAM_CHECK = 1000  # records of each file the command checks for a streamed dataset


def pad_multiple(plan: str) -> int:
    """What padded lengths are a multiple of under ``plan`` (8 for ``auto``)."""
    from shardwise.layout import Plan

    if plan.strip().lower() in ("auto", "dp", "ddp"):
        return 8
    p = Plan.parse(plan)
    return math.lcm(8, 2 * p.cp if p.cp > 1 else 1, p.tp if p.sequence_parallel else 1)


def sample_length(config: TrainJobConfig, window: int) -> int:
    """``seq`` of the module doc, from ``window``: ``model.seq_len`` capped at the model's positions."""
    m = pad_multiple(config.parallel.plan)
    seq = window // m * m
    if seq < m:
        raise ConfigError(f"model.seq_len={config.model.seq_len} leaves no sample length that is a multiple of {m}",
                          hint=f"use a model.seq_len of at least {m}")
    return seq


def instruct_format(config: TrainJobConfig) -> Any:
    from shardwise.data.instruct import InstructFormat

    d = config.data
    return InstructFormat(
        format=d.format,
        prompt_key=d.prompt_key,
        completion_key=d.completion_key,
        messages_key=d.messages_key,
        train_on=d.train_on,
    )


def check_instruct_options(config: TrainJobConfig) -> None:
    """The ``[data]`` options of instruction data that only work together (no torch, no files read)."""
    from shardwise.layout import Plan

    d = config.data
    if d.format == "text":
        given = [k for k, v in (("data.packing", d.packing), ("data.train_on", d.train_on != "completion")) if v]
        if given:
            raise ConfigError(f"{given[0]} is an option of prompt_completion and chat data (text is packed as it is)",
                              hint="add --data.format prompt_completion or chat, or drop it")
        return
    if (
        d.packing
        and config.parallel.plan.strip().lower() not in ("auto", "dp", "ddp")
        and Plan.parse(config.parallel.plan).cp > 1
    ):
        raise ConfigError(
            f"data.packing under {config.parallel.plan}: context parallel's split attention cannot keep packed samples "
            "apart",
            hint="use padded batches (--data.packing false) with cp, or a plan without cp",
        )


def check_instruct_job(config: TrainJobConfig, *, window: int) -> str:
    """The command's checks (module doc), for samples of at most ``window`` tokens (``model.seq_len``
    capped at the model's positions); returns a line describing the data."""
    from shardwise.data.instruct import check_chat_tokenizer, make_examples
    from shardwise.data.records import check_record_files, read_records
    from shardwise.data.text import find_files
    from shardwise.models.hf import check_packing_of, load_tokenizer

    check_instruct_options(config)
    d = config.data
    tokenizer = load_tokenizer(config.model.hf)
    if d.format == "chat":
        check_chat_tokenizer(tokenizer)
    if d.packing:
        check_packing_of(config.model.hf)
    seq = sample_length(config, window)
    fmt = instruct_format(config)
    lines = []
    for option, patterns in (("data.files", d.files), ("data.val_files", d.val_files)):
        if not patterns:
            continue
        files = find_files(patterns)
        check_record_files(files)
        if d.streaming:
            records = itertools.chain.from_iterable(itertools.islice(read_records(f), STREAM_CHECK) for f in files)
        else:
            records = itertools.chain.from_iterable(read_records(f) for f in files)
        examples = make_examples(records, tokenizer, fmt, seq_len=seq)
        checked = f"the first {STREAM_CHECK} of each file: " if d.streaming else ""
        lines.append(
            f"{option}: {len(files)} file(s), {checked}{examples.records:,} record(s), {examples.describe(seq)}"
        )
    return "; ".join(lines)


def instruct_job_data(config: TrainJobConfig, tokenizer: Any, *, seq: int) -> tuple[Any, Any, str, float | None, Any]:
    """The worker's ``(train, val, description, unigram entropy, collate)``: padded or packed samples
    of ``data.files`` (the last ``data.val_fraction`` of the records for validation), or with
    ``data.streaming`` an :class:`~shardwise.data.example_stream.ExampleStream` and
    ``data.val_files`` loaded whole."""
    from shardwise.data.batching import PackedExamples, PadCollate, PaddedExamples
    from shardwise.data.example_stream import ExampleStream
    from shardwise.data.instruct import make_examples
    from shardwise.data.records import read_records
    from shardwise.data.text import find_files
    d, fmt = config.data, instruct_format(config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    collate = PadCollate(pad_id=pad_id, multiple_of=pad_multiple(config.parallel.plan), max_len=seq)
    how = f"packed into rows of {seq} tokens" if d.packing else f"padded per batch (at most {seq} tokens)"

    def dataset(pieces: list[Any]) -> Any:
        return PackedExamples(pieces, seq_len=seq, pad_id=pad_id) if d.packing else PaddedExamples(pieces)

    def load(patterns: str) -> tuple[list[Any], str]:
        files = find_files(patterns)
        examples = make_examples(
            itertools.chain.from_iterable(read_records(f) for f in files), tokenizer, fmt, seq_len=seq
        )
        return examples.pieces, f"{len(files)} file(s), {examples.records:,} record(s), {examples.describe(seq)}"

    if d.streaming:
        train: Any = ExampleStream(
            find_files(d.files),
            tokenizer=tokenizer,
            fmt=fmt,
            seq_len=seq,
            pad_id=pad_id,
            packing=d.packing,
            shuffle=True,
            seed=config.run.seed,
            shuffle_windows=d.shuffle_windows,
        )
        if not d.val_files:
            return train, None, f"{d.format} records streamed, {how}; no validation (data.val_files)", None, collate
        pieces, val_text = load(d.val_files)
        return (
            train,
            dataset(pieces),
            f"{d.format} records streamed, {how}; validation {val_text}",
            _target_entropy(pieces, tokenizer),
            collate,
        )
    pieces, text = load(d.files)
    n_val = max(1, math.floor(len(pieces) * d.val_fraction))
    if len(pieces) - n_val < 1:
        raise ConfigError(
            f"data.files hold {len(pieces)} sample(s), too few to keep {n_val} for validation", hint="add records"
        )
    train, val = dataset(pieces[:-n_val]), dataset(pieces[-n_val:])
    return (
        train,
        val,
        f"{d.format}: {text}; {how}; the last {n_val} for validation",
        _target_entropy(pieces[:-n_val], tokenizer),
        collate,
    )


def _target_entropy(pieces: list[Any], tokenizer: Any) -> float | None:
    """The unigram entropy (nats/token) of the learned targets: what a model ignoring the context reaches."""
    import numpy as np
    import torch

    from shardwise.data.text import unigram_entropy

    learned = [p[1][p[1] >= 0] for p in pieces]
    if not learned:
        return None
    tokens = torch.from_numpy(np.concatenate(learned))
    return unigram_entropy(tokens, max(len(tokenizer), int(tokens.max()) + 1)) if len(tokens) else None
