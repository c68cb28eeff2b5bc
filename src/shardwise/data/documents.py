"""Where a :class:`~shardwise.data.streaming.PackedStream` reads its documents from, and how a
reader resumes at document ``d`` of part ``p`` without reading (or tokenizing) what comes before.

A source is a sequence of *parts* read in order; a part yields *documents*: a string (tokenized
by the stream) or a sequence of token ids.

- :class:`FileSource`: one part per file, in the given order (permuted each epoch with
  ``shuffle``, seeded by ``seed + epoch``):

  ========== ====================================================== ==========================
  suffix     documents                                               resuming at document d
  ========== ====================================================== ==========================
  ``.txt``   the whole file, one document                            (d is 0 or 1)
  ``.jsonl`` one per non-blank line, its ``text_key`` field          d lines skipped unparsed
  ``.parquet`` one per row, column ``text_key``: a string or a list  whole row groups skipped by
             of token ids; read a row group at a time, that column   their row counts, no read
  ``.npy``   a 1-D array of token ids, memory-mapped, one document   (d is 0 or 1)
  ``.bin``   raw little-endian token ids of ``bin_dtype``, one doc   (d is 0 or 1)
  ========== ====================================================== ==========================

- :class:`HFDatasetSource`: a Hugging Face ``datasets.Dataset`` (loaded from local files, e.g.
  ``load_dataset("parquet", data_files=...)``), one part, one document per row (``text_key``);
  rows by index, so resuming reads from row ``d`` directly; with ``shuffle`` the rows are
  permuted each epoch (``seed + epoch``). A ``datasets.IterableDataset`` (``streaming=True``) is
  read in order and resumed with its ``skip(d)``; it is read whole by every loader worker (through
  its ``iter``: iterated directly inside a worker it would keep only that worker's file shards),
  since the stream decides which windows a worker keeps.
- :class:`CallableSource`: a callable returning an iterable of documents (strings, token
  sequences, or dicts holding ``text_key``); one part; resuming iterates past ``d`` documents.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np

from shardwise.errors import ConfigError

FILE_SUFFIXES = (".txt", ".jsonl", ".parquet", ".npy", ".bin")
TEXT_SUFFIXES = (".txt", ".jsonl")


class DocumentSource(Protocol):
    """``parts()`` parts; ``documents(epoch, part, skip)`` the documents of one part after the first ``skip``."""

    def parts(self) -> int: ...

    def documents(self, epoch: int, part: int, skip: int) -> Iterator[Any]: ...


def field(doc: Any, text_key: str) -> Any:
    """A document's text (or token ids): a dict's ``text_key`` entry, anything else as it is."""
    if isinstance(doc, dict):
        if text_key not in doc:
            raise ConfigError(f"a document has no {text_key!r} field (it has {sorted(doc)})", hint="set text_key=")
        return doc[text_key]
    return doc


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("parquet files need pyarrow", hint="pip install 'shardwise[data]'") from None
    return pq


def parquet_column(path: str, column: str, skip: int = 0) -> Iterator[Any]:
    """The values of one column of a parquet file after its first ``skip`` rows, read a row group
    at a time; the row groups before ``skip`` are passed over by their row counts, unread."""
    parquet = _pyarrow_parquet().ParquetFile(path)
    if column not in parquet.schema_arrow.names:
        raise ConfigError(
            f"parquet file {path} has no column {column!r} (it has {parquet.schema_arrow.names})", hint="set text_key="
        )
    for group in range(parquet.metadata.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if skip >= rows:
            skip -= rows
            continue
        yield from parquet.read_row_group(group, columns=[column]).column(column).to_pylist()[skip:]
        skip = 0


class FilesInOrder:
    """A source whose parts are ``self.files``, one file each, in an order fixed per epoch: as
    listed, or with ``shuffle`` a permutation seeded by ``seed + epoch`` (the same on every rank)."""

    files: list[str]
    shuffle: bool
    seed: int

    def parts(self) -> int:
        return len(self.files)

    def order(self, epoch: int) -> list[str]:
        files = list(self.files)
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(files)
        return files


class FileSource(FilesInOrder):
    """Files read in order, one part each (module doc); checked when built: each exists, has a
    known suffix, text has a tokenizer, a parquet file has the ``text_key`` column."""

    def __init__(self, files: Sequence[str], *, text_key: str, has_tokenizer: bool, bin_dtype: np.dtype, shuffle: bool,
                 seed: int) -> None:
        self.files = [os.fspath(f) for f in files]
        if not self.files:
            raise ConfigError("a PackedStream needs at least one file")
        for f in self.files:
            if not os.path.isfile(f):
                raise ConfigError(f"data file {f} does not exist")
            if not f.endswith(FILE_SUFFIXES):
                raise ConfigError(f"data file {f} is not one of {', '.join(FILE_SUFFIXES)}")
            if f.endswith(TEXT_SUFFIXES) and not has_tokenizer:
                raise ConfigError(f"text file {f} needs tokenize=", hint="pass a function str -> token ids")
            if f.endswith(".parquet"):
                columns = _pyarrow_parquet().read_schema(f).names
                if text_key not in columns:
                    raise ConfigError(
                        f"parquet file {f} has no column {text_key!r} (it has {columns})", hint="set text_key="
                    )
        self.text_key, self.bin_dtype, self.shuffle, self.seed = text_key, bin_dtype, shuffle, seed

    def documents(self, epoch: int, part: int, skip: int) -> Iterator[Any]:
        path = self.order(epoch)[part]
        if path.endswith(".jsonl"):
            yield from self._jsonl(path, skip)
        elif path.endswith(".parquet"):
            yield from parquet_column(path, self.text_key, skip)
        elif skip == 0:  # the single-document formats
            if path.endswith(".npy"):
                yield np.load(path, mmap_mode="r")
            elif path.endswith(".bin"):  # raw token ids (nanoGPT / Megatron style)
                yield np.memmap(path, dtype=self.bin_dtype.newbyteorder("<"), mode="r")
            else:
                with open(path, encoding="utf-8") as fh:
                    yield fh.read()

    def _jsonl(self, path: str, skip: int) -> Iterator[Any]:
        with open(path, encoding="utf-8") as fh:
            seen = 0
            for line in fh:
                if not line.strip():
                    continue
                seen += 1
                if seen > skip:
                    yield field(json.loads(line), self.text_key)

def is_hf_dataset(source: Any) -> bool:
    """A Hugging Face ``datasets.Dataset`` or ``datasets.IterableDataset``."""
    return type(source).__module__.split(".")[0] == "datasets" and hasattr(source, "column_names")


class HFDatasetSource:
    """A Hugging Face dataset, one part (module doc)."""

    def __init__(self, dataset: Any, *, text_key: str, shuffle: bool, seed: int) -> None:
        columns = dataset.column_names
        if columns is not None and text_key not in columns:
            raise ConfigError(f"the dataset has no column {text_key!r} (it has {columns})", hint="set text_key=")
        self.indexed = hasattr(dataset, "__len__") and hasattr(dataset, "select")
        if shuffle and not self.indexed:
            raise ConfigError(
                "shuffle=True needs a map-style dataset (an IterableDataset has no row order to permute)",
                hint="shuffle it yourself with dataset.shuffle(seed, buffer_size=...), or load it without "
                "streaming=True",
            )
        if self.indexed and columns is not None and len(columns) > 1:
            dataset = dataset.select_columns([text_key])  # read only the text
        self.dataset, self.text_key, self.shuffle, self.seed = dataset, text_key, shuffle, seed

    def parts(self) -> int:
        return 1

    def documents(self, epoch: int, part: int, skip: int) -> Iterator[Any]:
        if not self.indexed:  # .iter, not iter(): the whole stream, also inside a loader worker (module doc)
            rows = self.dataset.skip(skip) if skip else self.dataset
            for batch in rows.iter(batch_size=256):
                yield from batch[self.text_key]
            return
        n = len(self.dataset)
        order = list(range(n))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        for start in range(skip, n, 256):  # rows by index, a batch at a time
            yield from self.dataset[order[start:start + 256]][self.text_key]


class CallableSource:
    """A callable returning an iterable of documents, one part (module doc)."""

    def __init__(self, make: Callable[[], Iterable[Any]], *, text_key: str, shuffle: bool) -> None:
        if shuffle:
            raise ConfigError("shuffle=True permutes files or a map-style dataset's rows, not a callable's documents",
                              hint="shuffle inside the callable, or pass files or a datasets.Dataset")
        self.make, self.text_key = make, text_key

    def parts(self) -> int:
        return 1

    def documents(self, epoch: int, part: int, skip: int) -> Iterator[Any]:
        for i, doc in enumerate(self.make()):
            if i >= skip:
                yield field(doc, self.text_key)


def document_source(source: Any, *, text_key: str, has_tokenizer: bool, bin_dtype: np.dtype, shuffle: bool,
                    seed: int) -> DocumentSource:
    """The :class:`DocumentSource` for what a user passed to ``PackedStream``."""
    if is_hf_dataset(source):
        return HFDatasetSource(source, text_key=text_key, shuffle=shuffle, seed=seed)
    if callable(source):
        return CallableSource(source, text_key=text_key, shuffle=shuffle)
    if isinstance(source, (str, os.PathLike)):
        source = [source]
    return FileSource(
        source, text_key=text_key, has_tokenizer=has_tokenizer, bin_dtype=bin_dtype, shuffle=shuffle, seed=seed
    )
