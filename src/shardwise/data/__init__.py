"""Data: distributed sampling and loading, and datasets that ship with Python or a dependency.

- :class:`ShardedSampler` / :class:`EvalSampler`, :func:`train_loader` / :func:`eval_loader`:
  sharding any map-style dataset over the data-parallel ranks (resumable; exact evaluation);
- :func:`load_stdlib_corpus`, :class:`CharWindows`: the standard library's source as characters;
- :func:`load_digits`: scikit-learn's 8x8 digits (optional extra);
- :class:`PackedStream`: streaming documents packed into windows, read through torchdata's
  ``StatefulDataLoader`` (optional extra ``shardwise[data]``; imported only when iterated).
"""

from shardwise.data.corpus import CharWindows, Corpus, load_stdlib_corpus
from shardwise.data.digits import load_digits
from shardwise.data.loader import DistributedLoader, LoaderOptions, eval_loader, train_loader
from shardwise.data.sampler import EvalSampler, ShardedSampler
from shardwise.data.streaming import PackedStream

__all__ = [
    "CharWindows",
    "Corpus",
    "DistributedLoader",
    "EvalSampler",
    "LoaderOptions",
    "PackedStream",
    "ShardedSampler",
    "eval_loader",
    "load_digits",
    "load_stdlib_corpus",
    "train_loader",
]
