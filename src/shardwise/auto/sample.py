"""Size: what one training sample looks like, for ``plan="auto"``.

The Trainer chooses an automatic plan when ``fit`` (or ``Trainer.setup``) sees the training data
(:class:`AutoData`). The per-sample shape is the first sample of the dataset (of a streaming
dataset, the first of a fresh pass; the Trainer's own pass starts over), collated as a batch of one
with the Trainer's ``collate_fn`` (:func:`first_inputs`); its sequence length is dimension 1 of
integer inputs (token ids), 1 for anything else, unless ``tokens_per_sample`` says otherwise
(:func:`shardwise.auto.measure.sample_stats`). Certification runs on the first global batches of
the same data (:meth:`AutoData.collate`, :func:`shardwise.auto.certify.certify_plans`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch.utils.data import IterableDataset, default_collate

from shardwise.auto.certify import CertifyOptions
from shardwise.data.batch import split_batch
from shardwise.errors import ConfigError, ShardwiseError


@dataclass(frozen=True)
class AutoData:
    """What ``plan="auto"`` takes from ``fit``: the training data, its collate function, the
    certification options and the length of the run (``certify=None`` certifies long runs)."""

    dataset: Any
    collate_fn: Callable[[list[Any]], Any] | None = None
    certify: CertifyOptions = CertifyOptions()
    total_steps: int | None = None
    grad_accum_steps: int = 1

    @property
    def certifying(self) -> bool:
        return self.certify.wanted(self.total_steps)

    def _items(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices`` (modulo the data's length): by index, or for a streaming
        dataset from the start of a fresh pass of it (the Trainer's own pass starts over)."""
        if isinstance(self.dataset, IterableDataset):
            pool = list(itertools.islice(iter(self.dataset), max(indices) + 1))
            n = len(pool)
        else:
            pool, n = self.dataset, len(self.dataset)
        if n == 0:
            raise ConfigError(
                "the training data is empty", hint="pass a dataset with at least one global batch of samples"
            )
        return [pool[i % n] for i in indices]

    def collate(self, indices: Sequence[int]) -> tuple[Any, Any]:
        """``(inputs, targets)`` of the samples at ``indices`` (modulo the data's length), collated
        like the Trainer's loader."""
        try:
            items = self._items(indices)
        except ShardwiseError:
            raise
        except Exception as exc:  # the user's dataset: one line naming it
            raise ConfigError(
                f"the training data's sample {indices[0]} cannot be read ({type(exc).__name__}: {str(exc)[:160]})",
                hint="check the dataset's __getitem__",
            ) from None
        try:
            return split_batch((self.collate_fn or default_collate)(items))
        except ShardwiseError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"the training data's samples cannot be collated ({type(exc).__name__}: {str(exc)[:160]})",
                hint="pass a collate_fn that stacks them into (inputs, targets)",
            ) from None


def first_inputs(data: AutoData) -> Any:
    """The inputs of the first sample, as a batch of one (what the model's forward takes)."""
    return data.collate([0])[0]  # an empty dataset fails there, as one line
