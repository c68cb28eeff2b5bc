"""The training data as the Trainer reads it: how many optimizer steps an epoch holds, and the
loader that gives this data-parallel rank its micro-batches with a resumable position.

- a map-style dataset of ``N`` samples holds ``N // G`` whole global batches of ``G`` samples per
  epoch (the tail is dropped, so every micro-batch has the same size); it is read through
  :func:`~shardwise.data.loader.train_loader`, whose ``ShardedSampler`` is the position;
- a :class:`~shardwise.data.streaming.PackedStream` has no length before it is read, so it needs
  ``max_steps``; it is read through torchdata's ``StatefulDataLoader``
  (:class:`~shardwise.data.streaming.StreamLoader`), whose ``StreamPosition`` is the position.

`fit` stops the loader's worker processes before it returns (:func:`close_train_data`).

Both positions have ``set_epoch``, ``advance``, ``epoch_finished`` and ``state_dict``: the
checkpoint saves them with the train state.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from shardwise.data.loader import LoaderOptions, stop_workers, train_loader
from shardwise.data.streaming import PackedStream, StreamLoader
from shardwise.errors import ConfigError


def batches_per_epoch(train_data: Dataset, *, global_batch_size: int, max_steps: int | None) -> int:
    """Whole global batches in one epoch of ``train_data``; at least one. A streaming dataset
    has no length to count (0): it needs ``max_steps``."""
    if isinstance(train_data, PackedStream):
        if max_steps is None:
            raise ConfigError("a streaming dataset has no length known before training",
                              hint="pass Trainer(train=TrainOptions(max_steps=...))")
        return 0
    per_epoch = len(train_data) // global_batch_size  # type: ignore[arg-type]
    if per_epoch < 1:
        raise ConfigError(f"the training data ({len(train_data)} samples) is smaller than one global batch "  # type: ignore[arg-type]
                          f"({global_batch_size})", hint="use a smaller global_batch_size or more data")
    return per_epoch


def open_train_data(data: Dataset, *, options: LoaderOptions, dp_rank: int, dp_size: int, micro_batch_size: int,
                    global_batch_size: int, seed: int, shuffle: bool) -> tuple[Any, Any]:
    """``(loader, position)`` for this rank's share of ``data`` (module doc)."""
    if isinstance(data, PackedStream):  # read in order through torchdata's StatefulDataLoader
        stream = StreamLoader(
            data,
            dp_rank=dp_rank,
            dp_size=dp_size,
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            num_workers=options.num_workers,
            collate_fn=options.collate_fn,
            multiprocessing_context=options.worker_start_method,
        )
        return stream, stream.position
    loader = train_loader(data, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, dp_rank=dp_rank,
                          dp_size=dp_size, seed=seed, shuffle=shuffle, options=options)
    return loader, loader.sampler


def close_train_data(loader: Any) -> None:
    """Stops the loader's worker processes at the end of ``fit`` (a stream's loader keeps its
    position for a later save); otherwise they would live as long as the trainer, and torch would
    stop them in the cyclic garbage collector, 5 s per worker (:func:`~shardwise.data.loader.stop_workers`)."""
    if isinstance(loader, StreamLoader):
        loader.close()
    else:
        stop_workers(loader)
