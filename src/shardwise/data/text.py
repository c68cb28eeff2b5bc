"""Text and JSONL files as packed token windows (for fine-tuning a language model on local files).

``load_text_corpus("data/**/*.txt,notes/*.jsonl", tokenize=tok.encode, eos_id=tok.eos_token_id)``:

1. **files**: each comma-separated glob is expanded (``**`` recurses), the union is sorted by path,
   so the order does not depend on the file system; no match is one error naming the pattern;
2. **documents**: a ``.jsonl`` file gives one document per line (the ``text_key`` field of each
   JSON object), a ``.parquet`` file one per row (its ``text_key`` column, strings; needs
   pyarrow), any other file is one document;
3. **packing**: documents are tokenized, each followed by ``eos_id``, and concatenated into one
   token stream; the last ``val_fraction`` of it is the validation split (contiguous, never seen
   in training); :class:`~shardwise.data.corpus.CharWindows` cuts each split into windows of
   ``seq_len + 1`` tokens (inputs and next-token targets), no padding, the tail dropped.

The windows are a map-style dataset in a fixed order, so the trainer's
:class:`~shardwise.data.sampler.ShardedSampler` position (epoch, samples consumed) resumes a run
exactly: the same files and tokenizer give the same windows, and a saved position for a dataset
of another length is refused. Tokenization runs once per rank when the job starts.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from shardwise.data.documents import parquet_column
from shardwise.errors import ConfigError


def find_files(patterns: str) -> list[str]:
    """The files matched by comma-separated globs, sorted, each once."""
    found: set[str] = set()
    for pattern in (p.strip() for p in patterns.split(",")):
        if not pattern:
            continue
        matches = [m for m in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(m)]
        if not matches:
            raise ConfigError(
                f"data files {pattern!r} match no file",
                hint="check the path; quote globs like 'data/**/*.txt' so the shell leaves them",
            )
        found.update(os.path.abspath(m) for m in matches)
    if not found:
        raise ConfigError("no data files given", hint="pass --data.files 'path/**/*.txt'")
    return sorted(found)


def read_documents(paths: Sequence[str], *, text_key: str = "text") -> list[str]:
    """One document per file, per line of a ``.jsonl`` file or per row of a ``.parquet`` one (its ``text_key``
    field)."""
    docs: list[str] = []
    for path in paths:
        if path.endswith(".parquet"):
            for number, value in enumerate(parquet_column(path, text_key), 1):
                if not isinstance(value, str):
                    raise ConfigError(
                        f"{path} row {number}: column {text_key!r} holds {type(value).__name__}, not text",
                        hint="set --data.text_key to the column holding the text",
                    )
                docs.append(value)
            continue
        with open(path, encoding="utf-8", errors="replace") as fh:
            if not path.endswith(".jsonl"):
                docs.append(fh.read())
                continue
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(
                        f"{path}:{number} is not JSON ({exc.msg})", hint="one JSON object per line"
                    ) from None
                if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                    raise ConfigError(
                        f"{path}:{number} has no string field {text_key!r}",
                        hint="set --data.text_key to the field holding the text",
                    )
                docs.append(record[text_key])
    return docs


@dataclass(frozen=True)
class TextCorpus:
    """The packed token stream's two splits and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    files: tuple[str, ...]
    documents: int
    vocab_size: int

    @property
    def unigram_entropy(self) -> float:
        """Entropy of the training split's token frequencies, in nats/token (a context-free baseline)."""
        return unigram_entropy(self.train, self.vocab_size)


def load_tokens(files: Sequence[str], *, tokenize: Callable[[str], list[int]], eos_id: int | None, vocab_size: int,
                text_key: str = "text") -> tuple[torch.Tensor, int]:
    """Steps 2-3 of the module doc without the split: ``(the packed token stream, documents)``."""
    docs = read_documents(files, text_key=text_key)
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenize(doc))
        if eos_id is not None:
            ids.append(eos_id)
    tokens = torch.tensor(ids, dtype=torch.long)
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise ConfigError(
            f"the tokenizer produced id {int(tokens.max())}, outside the model's vocabulary of {vocab_size}",
            hint="use the tokenizer saved with the model",
        )
    return tokens, len(docs)


def unigram_entropy(tokens: torch.Tensor, vocab_size: int) -> float:
    """Entropy of the token frequencies, in nats/token (a context-free baseline)."""
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def load_text_corpus(patterns: str, *, tokenize: Callable[[str], list[int]], eos_id: int | None, vocab_size: int,
                     val_fraction: float = 0.1, text_key: str = "text") -> TextCorpus:
    """Steps 1-3 of the module doc."""
    files = find_files(patterns)
    tokens, documents = load_tokens(files, tokenize=tokenize, eos_id=eos_id, vocab_size=vocab_size, text_key=text_key)
    n_val = max(1, int(math.floor(len(tokens) * val_fraction)))
    if len(tokens) - n_val < 2:
        raise ConfigError(f"the data files hold only {len(tokens)} tokens", hint="add more text")
    return TextCorpus(
        train=tokens[:-n_val], val=tokens[-n_val:], files=tuple(files), documents=documents, vocab_size=vocab_size
    )
