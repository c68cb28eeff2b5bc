"""Streaming datasets: documents read in order, packed into fixed-length windows, sharded over
data-parallel ranks and loader workers, resumable exactly (also at another data-parallel degree).

Sources (:mod:`shardwise.data.documents`): files read in order (``.txt``, ``.jsonl``,
``.parquet``, ``.npy``, ``.bin``), a Hugging Face ``datasets`` dataset loaded from local files, or
a callable returning documents: strings (tokenized by ``tokenize``) or token sequences. With
``shuffle`` the file order (or a map-style dataset's row order) is permuted each epoch (seeded by
``seed + epoch``).

**Packing** (:mod:`shardwise.data.packing`). Documents are tokenized, each followed by
``eos_id``, concatenated, and cut into windows of ``seq_len + 1`` tokens (a token file stays
memory-mapped, sliced one window at a time; windows of other readers are counted, not copied);
window ``k`` gives ``(inputs, targets) = (w[:-1], w[1:])``. The windows form one global sequence,
the same whoever reads it.

**Shuffle buffer.** With ``shuffle_windows=S`` the windows are permuted within blocks of ``S``
windows (rounded up to whole global batches): block ``b``'s ``i``-th window is its window
``perm_b[i]``, ``perm_b`` drawn from ``numpy.random.default_rng([seed, epoch, b])``, so the order is
the same for every reader and resume needs no generator state. Each loader worker holds one block
of windows (``S * (seq_len + 1)`` tokens); the last block is cut to whole global batches before
it is permuted. "Window ``k``" below is the ``k``-th window of this shuffled order.

**Sharding.** With ``D`` data-parallel ranks, micro-batches of ``B`` windows, ``W`` loader workers
and global batches of ``G`` windows: window ``k`` belongs to rank ``k % D``, as its ``j = k // D``-th
window; that belongs to micro-batch ``j // B``, which worker ``(j // B) % W`` builds. torch's loader
takes the workers' batches round-robin, so each rank reads its windows in order whatever ``W``
is, and the ranks together read every window once: no duplicates, no gaps. An epoch ends at the
last *whole* global batch (every rank takes the same number of steps): each worker holds back its
windows of a global batch until the stream reached that batch's last window.

**Resume.** The loader is torchdata's ``StatefulDataLoader``; each worker's iterator is
``Stateful`` (epoch, the token stream's position: file, document and token offset in it
(:mod:`shardwise.data.packing`), next window index, held-back windows or the shuffle block), so a
run resumed on the same layout restores every worker exactly where it was, without re-reading.
The position that does not depend on the layout is ``consumed``, the global windows of this epoch
trained on (a multiple of ``G``): under another data-parallel degree (or worker count) each
worker re-reads the stream from the epoch's start and skips the windows before ``consumed``
(tokenizing that prefix again, the cost of changing the layout) and continues with exactly the
windows an uninterrupted run would have read next, as map-style data does
(:mod:`shardwise.checkpoint.reshard`). Keep the global batch size for an exact continuation.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shardwise.data.documents import DocumentSource, document_source
from shardwise.data.loader import stop_workers
from shardwise.data.packing import TokenPosition, TokenStream
from shardwise.errors import ConfigError

Source = Sequence[str] | Callable[[], Iterable[Any]] | Any  # files, a callable, or a Hugging Face dataset


def require_torchdata() -> Any:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise ConfigError(
            "streaming datasets need torchdata's StatefulDataLoader", hint="pip install 'shardwise[data]'"
        ) from None
    return StatefulDataLoader


class PackedStream(IterableDataset):
    """``PackedStream(files_dataset_or_callable, seq_len=128, tokenize=None, eos_id=None, text_key="text",
    shuffle=False, seed=0, bin_dtype="uint16", shuffle_windows=0)``: see the module doc. The Trainer sets the sharding
    with :meth:`shard`."""

    def __init__(self, source: Source, *, seq_len: int, tokenize: Callable[[str], Sequence[int]] | None = None,
                 eos_id: int | None = None, text_key: str = "text", shuffle: bool = False, seed: int = 0,
                 bin_dtype: str = "uint16", shuffle_windows: int = 0) -> None:
        if seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be at least 1")
        if shuffle_windows < 0:
            raise ConfigError(
                f"shuffle_windows={shuffle_windows} must be 0 (windows in order) or a number of windows to shuffle "
                "within"
            )
        self.seed, self.shuffle_windows = seed, shuffle_windows
        self.documents: DocumentSource = document_source(source, text_key=text_key, has_tokenizer=tokenize is not None,
                                                         bin_dtype=np.dtype(bin_dtype), shuffle=shuffle, seed=seed)
        self.seq_len, self.tokenize, self.eos_id = seq_len, tokenize, eos_id
        self.dp_rank, self.dp_size, self.micro_batch, self.global_batch = 0, 1, 1, 1
        self.epoch, self.start = 0, 0  # where a fresh iteration begins (global windows of the epoch)
        self._reset()

    def shard(self, *, dp_rank: int, dp_size: int, micro_batch: int, global_batch: int) -> None:
        self.dp_rank, self.dp_size, self.micro_batch, self.global_batch = dp_rank, dp_size, micro_batch, global_batch

    # -- iteration (one worker) --------------------------------------------------------------
    def _reset(self, position: TokenPosition = TokenPosition()) -> None:
        self._next_k = 0
        self._held: list[np.ndarray] = []
        self._ready: list[np.ndarray] = []
        self._at_epoch = self.epoch
        self._stream: Any = self._open(position)

    def _open(self, position: TokenPosition) -> TokenStream:
        """The reader of this epoch's windows at ``position`` (``read(n, take)``, ``position``)."""
        return TokenStream(
            self.documents, tokenize=self.tokenize, eos_id=self.eos_id, epoch=self.epoch, position=position
        )

    def _sample(self, window: np.ndarray) -> Any:
        """A window as the Trainer's sample: ``(inputs, targets) = (w[:-1], w[1:])``."""
        tokens = torch.from_numpy(window.copy())
        return tokens[:-1], tokens[1:]

    def _worker(self) -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    @property
    def block(self) -> int:
        """Windows per shuffle block: ``shuffle_windows`` rounded up to whole global batches (one
        global batch, in order, without a shuffle)."""
        g = self.global_batch
        return -(-self.shuffle_windows // g) * g if self.shuffle_windows else g

    def _mine(self, k: int) -> bool:
        worker, workers = self._worker()
        return k % self.dp_size == self.dp_rank and ((k // self.dp_size) // self.micro_batch) % workers == worker

    def __iter__(self) -> PackedStream:
        # A restored worker is positioned after this, by load_state_dict (torchdata's order).
        self._reset()
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_stream"] = None  # an open file does not cross into a worker process; __iter__ opens it there
        return state

    def __next__(self) -> Any:
        block, width = self.block, self.seq_len + 1
        assert self._stream is not None, "iterate the stream (iter()) before reading it"
        while not self._ready:
            k = self._next_k
            first = k // block * block
            # kept: the whole block under a shuffle (its permutation decides whose each window is), unless
            # all of it was trained on; else this worker's windows at or after `start`; the rest only counted
            keep = first + block > self.start if self.shuffle_windows else k >= self.start and self._mine(k)
            window = self._stream.read(width, take=keep)
            if window is None:  # the end: the whole global batches of the last block, the rest dropped
                first = self._next_k // block * block
                self._close_block(first, (self._next_k - first) // self.global_batch * self.global_batch)
                self._next_k = first + block  # that block is closed: another call ends at once
                if not self._ready:
                    raise StopIteration
                break
            self._next_k = k + 1
            if keep:
                self._held.append(window)
            if self._next_k % block == 0:  # window k closed a block
                self._close_block(first, block)
        return self._sample(self._ready.pop(0))

    def _close_block(self, first: int, n: int) -> None:
        """Release this worker's windows of the block of windows ``first .. first + n - 1``: in
        order, or (``shuffle_windows``) the block's ``i``-th output is its window ``perm[i]``,
        ``perm`` a permutation drawn from ``(seed, epoch, block index)``, output ``first + i`` owned
        like window ``k`` in the module doc."""
        held, self._held = self._held, []
        if (
            not self.shuffle_windows
        ):  # held: this worker's windows at or after `start`, released once the global batch is whole
            self._ready = held if n == self.block else []
            return
        if len(held) < n:  # the block lies before `start`: nothing was kept, nothing is released
            return
        perm = np.random.default_rng([self.seed, self._at_epoch, first // self.block]).permutation(n)
        self._ready = [held[perm[i]] for i in range(n) if first + i >= self.start and self._mine(first + i)]

    # torchdata's StatefulDataLoader saves and restores each worker's iterator with these
    def state_dict(self) -> dict[str, Any]:
        assert self._stream is not None
        position = self._stream.position
        return {
            "epoch": self._at_epoch,
            "start": self.start,
            "part": position.part,
            "doc": position.doc,
            "offset": position.offset,
            "started": position.started,
            "next_k": self._next_k,
            "held": [w.tolist() for w in self._held],
            "ready": [w.tolist() for w in self._ready],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.start = int(state["epoch"]), int(state["start"])
        self._reset(TokenPosition(int(state["part"]), int(state["doc"]), int(state["offset"]), bool(state["started"])))
        self._next_k = int(state["next_k"])
        self._held = [np.asarray(w, dtype=np.int64) for w in state["held"]]
        self._ready = [np.asarray(w, dtype=np.int64) for w in state["ready"]]


class StreamPosition:
    """The Trainer's data position for a :class:`StreamLoader` (what ``ShardedSampler`` is for
    map-style data): ``set_epoch``, ``advance``, ``epoch_finished``, ``state_dict``. A view: the
    position lives on the loader (``StreamLoader.position`` makes one), so the two hold no reference
    cycle and a loader let go of is freed, its workers stopped, at once."""

    def __init__(self, loader: StreamLoader) -> None:
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        loader = self.loader
        if epoch != loader.epoch:
            loader.epoch, loader.consumed = epoch, 0
        loader.exhausted = False
        loader.dataset.epoch, loader.dataset.start = loader.epoch, loader.consumed

    def advance(self, samples: int) -> None:
        self.loader.consumed += samples

    @property
    def epoch_finished(self) -> bool:
        return self.loader.exhausted

    def _layout(self) -> dict[str, int]:
        d = self.loader.dataset
        return {"dp_size": d.dp_size, "micro_batch": d.micro_batch, "global_batch": d.global_batch,
                "num_workers": int(getattr(self.loader.loader, "num_workers", 0))}

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.loader.epoch,
            "consumed": self.loader.consumed,
            "layout": self._layout(),
            "loader": self.loader.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loader = self.loader
        loader.epoch, loader.consumed = int(state["epoch"]), int(state["consumed"])
        loader.dataset.epoch, loader.dataset.start = loader.epoch, loader.consumed
        if state.get("layout") == self._layout():
            loader.loader.load_state_dict(state["loader"])  # every worker exactly where it was
        # else: each worker re-reads the epoch and skips the windows before `consumed` (module doc)


class StreamLoader:
    """A ``StatefulDataLoader`` over this rank's share of a :class:`PackedStream`; iterating it once
    reads the rest of the current epoch (``position.epoch_finished`` tells whether it ended)."""

    def __init__(
        self,
        dataset: PackedStream,
        *,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        global_batch_size: int,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        multiprocessing_context: str | None = None,
    ) -> None:
        StatefulDataLoader = require_torchdata()
        dataset.shard(dp_rank=dp_rank, dp_size=dp_size, micro_batch=micro_batch_size, global_batch=global_batch_size)
        extra: dict[str, Any] = {"collate_fn": collate_fn} if collate_fn is not None else {}
        if num_workers and multiprocessing_context:
            extra["multiprocessing_context"] = multiprocessing_context
        self.dataset = dataset
        self.loader = StatefulDataLoader(dataset, batch_size=micro_batch_size, num_workers=num_workers, **extra)
        self.epoch, self.consumed, self.exhausted = 0, 0, False  # the position (:class:`StreamPosition`)
        self._closed_state: dict[str, Any] | None = None

    @property
    def position(self) -> StreamPosition:
        return StreamPosition(self)

    def __iter__(self) -> Iterator[Any]:
        if self._closed_state is not None:
            raise RuntimeError("this StreamLoader was closed")
        yield from self.loader
        self.exhausted = True

    def state_dict(self) -> dict[str, Any]:
        """The loader's (every worker's) position; after :meth:`close`, the one it had then."""
        return self._closed_state if self._closed_state is not None else self.loader.state_dict()

    def close(self) -> None:
        """Keeps the position, then stops the worker processes now (:func:`~shardwise.data.loader.stop_workers`)."""
        if self._closed_state is None:
            self._closed_state = self.loader.state_dict()
            stop_workers(self.loader)
