"""Records of instruction data: one JSON object per line of a ``.jsonl`` file, one row of a
``.parquet`` file, each with where it came from (``path:line``, ``path row N``) so that every error
about it names the file and line.

:class:`RecordSource` is the same records as a :class:`~shardwise.data.documents.DocumentSource`
for a stream: one part per file (file order permuted each epoch with ``shuffle``, seeded by
``seed + epoch``); resuming at record ``d`` of a part skips ``d`` non-blank lines unparsed, or
whole parquet row groups by their row counts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from shardwise.data.documents import FilesInOrder, _pyarrow_parquet
from shardwise.errors import ConfigError

RECORD_SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class Record:
    """One sample of instruction data: its fields and where it is (``path:line``)."""

    where: str
    value: dict[str, Any]

    def field(self, key: str, kind: type, what: str) -> Any:
        """The record's ``key``, which must be a ``kind`` (one line naming the file and line otherwise)."""
        if key not in self.value:
            raise ConfigError(
                f"{self.where} has no field {key!r} (it has {sorted(self.value)})",
                hint=f"give every record a {what}, or name the field that holds it (--data.{_option(what)})",
            )
        value = self.value[key]
        if not isinstance(value, kind):
            raise ConfigError(f"{self.where}: field {key!r} holds {type(value).__name__}, not {kind.__name__}",
                              hint=f"the {what} must be {'text' if kind is str else 'a list'}")
        return value


def _option(what: str) -> str:
    return {"prompt": "prompt_key", "completion": "completion_key", "conversation": "messages_key"}.get(
        what, "text_key"
    )


def check_record_files(files: Sequence[str]) -> None:
    """Every file exists and is ``.jsonl`` or ``.parquet``."""
    for f in files:
        if not os.path.isfile(f):
            raise ConfigError(f"data file {f} does not exist")
        if not f.endswith(RECORD_SUFFIXES):
            raise ConfigError(
                f"data file {f} is not JSONL or parquet, which prompt_completion and chat data are read from",
                hint="one JSON object per line (.jsonl), or a .parquet file with a column per field",
            )


def read_records(path: str, skip: int = 0) -> Iterator[Record]:
    """The records of one file after its first ``skip`` (module doc)."""
    if path.endswith(".parquet"):
        yield from _parquet_records(path, skip)
        return
    with open(path, encoding="utf-8") as fh:
        seen = 0
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            seen += 1
            if seen <= skip:
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{path}:{number} is not JSON ({exc.msg} at column {exc.colno})", hint="one JSON object per line"
                ) from None
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{path}:{number} is a JSON {type(value).__name__}, not an object", hint="one JSON object per line"
                )
            yield Record(f"{path}:{number}", value)


def _parquet_records(path: str, skip: int) -> Iterator[Record]:
    parquet = _pyarrow_parquet().ParquetFile(path)
    first = 0  # the file's row index of the row group's first row
    for group in range(parquet.metadata.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if skip < rows:
            for number, value in enumerate(parquet.read_row_group(group).to_pylist()[skip:], first + skip + 1):
                yield Record(f"{path} row {number}", value)
            skip = 0
        else:
            skip -= rows
        first += rows


class RecordSource(FilesInOrder):
    """The records of ``files`` as a stream's document source (module doc)."""

    def __init__(self, files: Sequence[str], *, shuffle: bool, seed: int) -> None:
        self.files = [os.fspath(f) for f in files]
        if not self.files:
            raise ConfigError("a stream of records needs at least one file")
        check_record_files(self.files)
        self.shuffle, self.seed = shuffle, seed

    def documents(self, epoch: int, part: int, skip: int) -> Iterator[Record]:
        yield from read_records(self.order(epoch)[part], skip)
