"""Batches of instruction samples (:data:`~shardwise.data.instruct.Piece`: inputs and targets):
padded, or packed with document boundaries.

**Padded** (:class:`PaddedExamples` + :class:`PadCollate`): one sample per row, padded on the
right to the longest sample of the micro-batch, rounded up to ``multiple_of`` (context and
sequence parallelism split the sequence) and at most ``max_len``. Padding has the target
``-100``; under a causal mask no real token sees the padding after it, so no attention mask is
needed and every sample's loss is the one it has alone.

**Packed** (:func:`pack`, :class:`PackedExamples`): samples laid end to end, in order, into rows of
``seq_len`` tokens (a sample that does not fit in what is left of a row starts the next one; the
rest of the row is padding). Each row carries ``position_ids`` that restart at 0 at every
sample, and that is what keeps the samples apart: the model must build its attention mask from
them, so that no token attends across a sample boundary (Hugging Face models do when
``position_ids`` are passed and ``attention_mask`` is not; check a model with
:func:`shardwise.models.hf.check_packing`). A packed row's item is a mapping
``{"inputs", "targets", "position_ids"}``: the Trainer calls ``model(inputs, position_ids=...)``.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from shardwise.data.instruct import IGNORE_INDEX, Piece
from shardwise.errors import ConfigError


def packed_row(pieces: Sequence[Piece], seq_len: int, pad_id: int) -> np.ndarray:
    """``pieces`` laid end to end into one ``[3, seq_len]`` row: inputs, targets, positions."""
    row = np.empty((3, seq_len), dtype=np.int64)
    row[0], row[1] = pad_id, IGNORE_INDEX
    at = 0
    for p in pieces:
        n = p.shape[1]
        row[:2, at:at + n] = p
        row[2, at:at + n] = np.arange(n)
        at += n
    row[2, at:] = np.arange(seq_len - at)  # the padding is a document of its own
    return row


class Packer:
    """Greedy packing of pieces in order into rows of ``seq_len`` (module doc), one row at a time:
    :meth:`add` returns the row a piece closed (or None), :meth:`flush` the last one."""

    def __init__(self, seq_len: int, pad_id: int) -> None:
        self.seq_len, self.pad_id = seq_len, pad_id
        self.pending: list[Piece] = []
        self.used = 0

    def add(self, p: Piece) -> np.ndarray | None:
        if p.shape[1] > self.seq_len:
            raise ConfigError(
                f"a sample of {p.shape[1]} tokens does not fit in rows of {self.seq_len}",
                hint="cut samples to seq_len first",
            )
        closed = None
        if self.used + p.shape[1] > self.seq_len:
            closed = self.flush()
        self.pending.append(p)
        self.used += p.shape[1]
        return closed

    def flush(self) -> np.ndarray | None:
        if not self.pending:
            return None
        row = packed_row(self.pending, self.seq_len, self.pad_id)
        self.pending, self.used = [], 0
        return row


def pack(pieces: Iterable[Piece], seq_len: int, pad_id: int) -> list[np.ndarray]:
    """Every piece packed into ``[3, seq_len]`` rows (module doc)."""
    packer, rows = Packer(seq_len, pad_id), []
    for p in pieces:
        row = packer.add(p)
        if row is not None:
            rows.append(row)
    last = packer.flush()
    return rows + ([last] if last is not None else [])


def packed_item(row: np.ndarray) -> dict[str, torch.Tensor]:
    """A packed row as the Trainer's sample: ``{"inputs", "targets", "position_ids"}``."""
    t = torch.from_numpy(np.ascontiguousarray(row))
    return {"inputs": t[0], "targets": t[1], "position_ids": t[2]}


def padded_item(p: Piece) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(np.ascontiguousarray(p))
    return t[0], t[1]


class PaddedExamples(Dataset):
    """One sample per item, ``(inputs[n], targets[n])`` of its own length: batch it with :class:`PadCollate`."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        self.pieces = list(pieces)

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return padded_item(self.pieces[i])


class PackedExamples(Dataset):
    """The pieces packed into rows of ``seq_len`` (module doc); the default collate batches them."""

    def __init__(self, pieces: Sequence[Piece], *, seq_len: int, pad_id: int) -> None:
        self.rows = pack(pieces, seq_len, pad_id)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return packed_item(self.rows[i])


class PadCollate:
    """Right-pads ``(inputs, targets)`` samples to the longest of the batch, rounded up to
    ``multiple_of`` and at most ``max_len`` (module doc). Picklable, for loader workers."""

    def __init__(self, *, pad_id: int, multiple_of: int = 8, max_len: int | None = None) -> None:
        if multiple_of < 1:
            raise ConfigError(f"multiple_of={multiple_of} must be at least 1")
        self.pad_id, self.multiple_of, self.max_len = pad_id, multiple_of, max_len

    def length(self, longest: int) -> int:
        n = -(-longest // self.multiple_of) * self.multiple_of
        return min(n, self.max_len) if self.max_len else n

    def __call__(self, samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if samples and isinstance(samples[0], dict):  # packed rows: already of one length
            return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}  # type: ignore[return-value]
        n = self.length(max(int(x.shape[0]) for x, _ in samples))
        inputs = torch.full((len(samples), n), self.pad_id, dtype=torch.long)
        targets = torch.full((len(samples), n), IGNORE_INDEX, dtype=torch.long)
        for row, (x, y) in enumerate(samples):
            m = min(len(x), n)
            inputs[row, :m], targets[row, :m] = x[:m], y[:m]
        return inputs, targets
