"""Data: distributed sampling and loading, and datasets that ship with Python or a dependency.

- :class:`ShardedSampler` / :class:`EvalSampler`, :func:`train_loader` / :func:`eval_loader`:
  sharding any map-style dataset over the data-parallel ranks (resumable; exact evaluation);
- :func:`load_stdlib_corpus`, :class:`CharWindows`: the standard library's source as characters;
- :func:`load_digits`: scikit-learn's 8x8 digits (optional extra);
- :class:`PackedStream`: streaming documents packed into windows, read through torchdata's
  ``StatefulDataLoader`` (optional extra ``shardwise[data]``; imported only when iterated);
- instruction data: :class:`InstructFormat` and :func:`make_examples` (prompt/completion and chat
  records with a loss mask, :mod:`shardwise.data.instruct`), :class:`PaddedExamples`,
  :class:`PackedExamples` and :class:`PadCollate` (:mod:`shardwise.data.batching`),
  :class:`ExampleStream` (the same as a resumable stream), :func:`read_records`.
"""

from shardwise.data.batching import PackedExamples, PadCollate, PaddedExamples
from shardwise.data.corpus import CharWindows, Corpus, load_stdlib_corpus
from shardwise.data.digits import load_digits
from shardwise.data.example_stream import ExampleStream
from shardwise.data.instruct import InstructFormat, make_examples
from shardwise.data.loader import DistributedLoader, LoaderOptions, eval_loader, train_loader
from shardwise.data.records import read_records
from shardwise.data.sampler import EvalSampler, ShardedSampler
from shardwise.data.streaming import PackedStream

__all__ = [
    "CharWindows",
    "Corpus",
    "DistributedLoader",
    "EvalSampler",
    "ExampleStream",
    "InstructFormat",
    "LoaderOptions",
    "PackedExamples",
    "PackedStream",
    "PadCollate",
    "PaddedExamples",
    "ShardedSampler",
    "eval_loader",
    "load_digits",
    "load_stdlib_corpus",
    "make_examples",
    "read_records",
    "train_loader",
]
