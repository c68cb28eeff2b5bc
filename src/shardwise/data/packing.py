"""The packed token stream of one epoch: a source's documents tokenized, each followed by
``eos_id``, concatenated, and read a fixed number of tokens at a time, with a position that a
reader can be put back to exactly.

**Position** ``(part, doc, offset)``: the document being read (the ``doc``-th of source part
``part``) and how many of its tokens were consumed. Reopening at a position reads (and tokenizes)
only that one document again; the documents before it are skipped by the source
(:mod:`shardwise.data.documents`) without being read where the format allows.

**Memory.** A token document (``.npy``, ``.bin``) stays memory-mapped and is sliced, never copied
whole: a multi-gigabyte token file costs one window at a time. A window that is only skipped
(another rank's or worker's) is not copied at all, just counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from shardwise.data.documents import DocumentSource
from shardwise.errors import ConfigError

SKIPPED = np.zeros(0, dtype=np.int64)  # what read() returns for a window it only counted


@dataclass(frozen=True)
class TokenPosition:
    """Where a :class:`TokenStream` is: ``part``, ``doc`` (documents of the part started), and
    ``offset`` (tokens consumed of the last one started, if ``started``)."""

    part: int = 0
    doc: int = 0
    offset: int = 0
    started: bool = False


class TokenStream:
    """``read(n, take)``: the next ``n`` tokens (int64), :data:`SKIPPED` when not ``take``, None at the end."""

    def __init__(
        self,
        documents: DocumentSource,
        *,
        tokenize: Callable[[str], Sequence[int]] | None,
        eos_id: int | None,
        epoch: int,
        position: TokenPosition = TokenPosition(),
    ) -> None:
        self.documents, self.tokenize, self.eos_id, self.epoch = documents, tokenize, eos_id, epoch
        self.part, self.doc = position.part, position.doc
        self._docs: Iterator[Any] | None = None
        self._tokens: np.ndarray | None = None  # the document being read, without its eos
        self._length, self.offset = 0, 0
        if position.started:  # read that document again, consumed up to the offset
            self.doc -= 1
            if not self._open_next():
                raise ConfigError(f"the stream's saved position {position} lies past the end of its data",
                                  hint="resume with the same data files in the same order")
            self.offset = position.offset

    @property
    def position(self) -> TokenPosition:
        return TokenPosition(self.part, self.doc, self.offset, self._tokens is not None)

    def _token_array(self, doc: Any) -> np.ndarray:
        if isinstance(doc, str):
            if self.tokenize is None:
                raise ConfigError("text documents need tokenize=", hint="pass a function str -> token ids")
            return np.asarray(self.tokenize(doc), dtype=np.int64)
        return np.asarray(doc).reshape(-1)  # a memory map stays one

    def _open_next(self) -> bool:
        """Start the next document; False at the end of the epoch's data."""
        while self.part < self.documents.parts():
            if self._docs is None:  # (re)open a part past the documents already started
                self._docs = self.documents.documents(self.epoch, self.part, self.doc)
            doc = next(self._docs, None)
            if doc is not None:
                self.doc += 1
                self._tokens = self._token_array(doc)
                self._length, self.offset = len(self._tokens) + (self.eos_id is not None), 0
                return True
            self.part, self.doc, self._docs, self._tokens = self.part + 1, 0, None, None
        self._tokens = None
        return False

    def _slice(self, start: int, n: int) -> np.ndarray:
        assert self._tokens is not None
        body = self._tokens[start:start + n]
        if start + n > len(self._tokens):  # the document's end-of-sequence token
            body = np.concatenate([np.asarray(body, dtype=np.int64), np.array([self.eos_id], dtype=np.int64)])
        return body

    def read(self, n: int, *, take: bool = True) -> np.ndarray | None:
        pieces, need = [], n
        while need:
            if self._tokens is None or self.offset == self._length:
                if not self._open_next():
                    return None
            m = min(need, self._length - self.offset)
            if take:
                pieces.append(self._slice(self.offset, m))
            self.offset += m
            need -= m
        return np.concatenate(pieces).astype(np.int64, copy=False) if take else SKIPPED
