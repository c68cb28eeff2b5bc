"""Instruction data read as a stream: records tokenized as they are read (:mod:`shardwise.data.instruct`),
one sample per record (padded batches) or packed into rows with document boundaries
(:mod:`shardwise.data.batching`), sharded over data-parallel ranks and loader workers and resumed
exactly, by the machinery of :class:`~shardwise.data.streaming.PackedStream` (whose "window ``k``"
is here sample ``k``: a record's piece, or a packed row).

**Position.** The reader is at ``(part, record)``: the file being read and how many of its records
were read. A packed row still being filled holds the pieces of its records: the position saved is
that of the row's first record, so a restored reader reads those records again and closes the
same row (packing is deterministic). A record left with no target to learn is skipped (and
counted in :attr:`ExampleReader.dropped`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from torch.utils.data import IterableDataset

from shardwise.data.batching import Packer, packed_item, padded_item
from shardwise.data.instruct import InstructFormat, Piece, check_chat_tokenizer, piece, tokenize
from shardwise.data.packing import SKIPPED, TokenPosition
from shardwise.data.records import Record, RecordSource
from shardwise.data.streaming import PackedStream
from shardwise.errors import ConfigError


class ExampleReader:
    """``read(n, take)``: the next sample (``n`` is ignored), :data:`SKIPPED` when not ``take``, None
    at the end of the epoch; ``position`` to resume at (module doc)."""

    def __init__(
        self,
        source: RecordSource,
        *,
        epoch: int,
        position: TokenPosition,
        make: Callable[[Record], Piece | None],
        packer: Packer | None,
    ) -> None:
        self.source, self.epoch, self.make, self.packer = source, epoch, make, packer
        self.part, self.doc = position.part, position.doc
        self._records: Any = None
        self._row_start: tuple[int, int] | None = None  # where the row being packed began
        self.dropped = 0

    @property
    def position(self) -> TokenPosition:
        part, doc = self._row_start if self._row_start is not None else (self.part, self.doc)
        return TokenPosition(part, doc)

    def _next_piece(self) -> tuple[Piece, tuple[int, int]] | None:
        while self.part < self.source.parts():
            if self._records is None:
                self._records = self.source.documents(self.epoch, self.part, self.doc)
            record = next(self._records, None)
            if record is None:
                self.part, self.doc, self._records = self.part + 1, 0, None
                continue
            at = (self.part, self.doc)
            self.doc += 1
            p = self.make(record)
            if p is None:
                self.dropped += 1
                continue
            return p, at
        return None

    def read(self, n: int, *, take: bool = True) -> np.ndarray | None:
        sample = self._read()
        return None if sample is None else (sample if take else SKIPPED)

    def _read(self) -> np.ndarray | None:
        if self.packer is None:
            got = self._next_piece()
            return None if got is None else got[0]
        while True:
            got = self._next_piece()
            if got is None:
                self._row_start = None
                return self.packer.flush()
            p, at = got
            if self._row_start is None:
                self._row_start = at
            row = self.packer.add(p)
            if row is not None:  # p did not fit: it begins the next row
                self._row_start = at
                return row


class ExampleStream(PackedStream):
    """``ExampleStream(files, tokenizer=, fmt=InstructFormat(...), seq_len=, packing=False, pad_id=,
    shuffle=False, seed=0, shuffle_windows=0)``: JSONL or parquet records as a stream of samples
    (module doc). Padded samples are ``(inputs[n], targets[n])`` of their own length (batch them with
    :class:`~shardwise.data.batching.PadCollate`); packed ones ``{"inputs", "targets", "position_ids"}``
    rows of ``seq_len``."""

    def __init__(
        self,
        files: Sequence[str],
        *,
        tokenizer: Any,
        fmt: InstructFormat,
        seq_len: int,
        pad_id: int,
        packing: bool = False,
        shuffle: bool = False,
        seed: int = 0,
        shuffle_windows: int = 0,
    ) -> None:
        IterableDataset.__init__(self)
        if seq_len < 1 or shuffle_windows < 0:
            raise ConfigError(f"seq_len={seq_len} must be at least 1 and shuffle_windows={shuffle_windows} at least 0")
        if fmt.format == "chat":
            check_chat_tokenizer(tokenizer)
        self.documents: Any = RecordSource(files, shuffle=shuffle, seed=seed)
        self.tokenizer, self.fmt, self.packing, self.pad_id = tokenizer, fmt, packing, pad_id
        self.seed, self.shuffle_windows, self.seq_len, self.tokenize, self.eos_id = (
            seed,
            shuffle_windows,
            seq_len,
            None,
            None,
        )
        self.dp_rank, self.dp_size, self.micro_batch, self.global_batch = 0, 1, 1, 1
        self.epoch, self.start = 0, 0
        self._reset()

    def _piece(self, record: Record) -> Piece | None:
        return piece(*tokenize(record, self.tokenizer, self.fmt), self.seq_len)

    def _open(self, position: TokenPosition) -> ExampleReader:
        packer = Packer(self.seq_len, self.pad_id) if self.packing else None
        return ExampleReader(self.documents, epoch=self.epoch, position=position, make=self._piece, packer=packer)

    def _sample(self, window: np.ndarray) -> Any:
        return packed_item(window) if self.packing else padded_item(window)
