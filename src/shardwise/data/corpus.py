"""A character-level text corpus that ships with Python: the standard library's own source.

The files are found through ``sysconfig.get_paths()["stdlib"]`` (no download, no network). The
order is deterministic and independent of the file system: ``*.py`` files outside test suites,
sorted by the MD5 of their relative path (a fixed pseudo-random order, so the capped corpus mixes
many modules instead of only those starting with ``a``). Files are concatenated, separated by a
blank line, until ``max_chars``; the last ``val_fraction`` of the text is the validation split
(contiguous, so no window of validation text was seen in training).

The vocabulary is the sorted set of characters in the corpus. :attr:`Corpus.unigram_entropy` is
the entropy of the training split's character frequencies, ``H = -sum_c p(c) ln p(c)`` in
nats/char: the cross-entropy a model that ignores context would reach, and the figure a language
model's validation loss (also in nats/char) should end well below.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.utils.data import Dataset

from shardwise.errors import ConfigError

_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "turtledemo", "lib2to3"}


def stdlib_dir() -> str:
    """The directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the library's ``*.py`` files (tests excluded), in the corpus order."""
    root = root or stdlib_dir()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return sorted(found, key=lambda rel: (hashlib.md5(rel.encode()).hexdigest(), rel))


@dataclass(frozen=True)
class CharVocab:
    """The character tokenizer: id ``i`` is ``chars[i]``. A character outside the vocabulary
    encodes as the space (or id 0 without one); an id outside it decodes to nothing (the ids a
    vocabulary padded for tensor parallelism adds stand for no character)."""

    chars: str

    def __len__(self) -> int:
        return len(self.chars)

    def unknown(self, text: str) -> str:
        """The distinct characters of ``text`` outside the vocabulary, in order of appearance."""
        known = set(self.chars)
        return "".join(dict.fromkeys(c for c in text if c not in known))

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.chars)}
        unknown = index.get(" ", 0)
        return torch.tensor([index.get(c, unknown) for c in text], dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        return "".join(self.chars[int(i)] for i in ids if 0 <= int(i) < len(self.chars))


@dataclass(frozen=True)
class Corpus:
    """Text, vocabulary and the two splits as token tensors (``int64`` ids)."""

    text: str
    vocab: str  # the characters, id = position
    train: torch.Tensor
    val: torch.Tensor
    files: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def tokenizer(self) -> CharVocab:
        return CharVocab(self.vocab)

    @property
    def unigram_entropy(self) -> float:
        """Entropy of the training split's character distribution, in nats/char."""
        counts = torch.bincount(self.train, minlength=self.vocab_size).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())

    def encode(self, text: str) -> torch.Tensor:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        return self.tokenizer.decode(ids)


def load_stdlib_corpus(*, max_chars: int = 1_000_000, val_fraction: float = 0.1, root: str | None = None) -> Corpus:
    """Read up to ``max_chars`` characters of the standard library (see the module doc)."""
    if max_chars < 1000:
        raise ConfigError(
            f"corpus max_chars={max_chars} is too small", hint="use at least 1000 (the default is 1000000)"
        )
    if not 0.0 < val_fraction < 0.5:
        raise ConfigError(f"corpus val_fraction={val_fraction} must be in (0, 0.5)", hint="for example 0.1")
    root = root or stdlib_dir()
    if not os.path.isdir(root):
        raise ConfigError(f"the standard library directory {root!r} does not exist",
                          hint="this Python has no source files (a frozen or zipped build); use another interpreter")
    parts: list[str] = []
    used: list[str] = []
    total = 0
    for rel in stdlib_files(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
            chunk = fh.read() + "\n\n"
        parts.append(chunk[: max_chars - total])
        used.append(rel)
        total += len(parts[-1])
        if total >= max_chars:
            break
    text = "".join(parts)
    if len(text) < 1000:
        raise ConfigError(f"only {len(text)} characters of Python source found under {root!r}",
                          hint="this Python ships without its library sources; use another interpreter")
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    n_val = max(1, int(math.floor(len(ids) * val_fraction)))
    return Corpus(text=text, vocab=vocab, train=ids[:-n_val], val=ids[-n_val:], files=tuple(used))


class CharWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens as ``(input[seq_len], target[seq_len])`` (target = input shifted by one).

    Window ``i`` starts at ``i * stride``; ``stride = seq_len`` gives non-overlapping windows.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, stride: int | None = None) -> None:
        stride = stride or seq_len
        if seq_len < 1 or stride < 1:
            raise ConfigError(f"window seq_len={seq_len} and stride={stride} must be positive")
        if len(tokens) < seq_len + 1:
            raise ConfigError(f"a split of {len(tokens)} tokens is shorter than one window of {seq_len + 1}",
                              hint="use a shorter seq_len or a larger corpus (max_chars)")
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.stride
        chunk = self.tokens[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]
