"""scikit-learn's 8x8 handwritten digits: a real image dataset that ships inside a package.

1797 grayscale images of 8x8 pixels (values 0..16, scaled here to [0, 1]) with labels 0..9, from
the UCI optical digits set. scikit-learn is an optional extra (``pip install shardwise[examples]``);
nothing is downloaded. The split is a fixed permutation from ``seed``, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset

from shardwise.errors import ShardwiseError


@dataclass(frozen=True)
class DigitsSplits:
    train: TensorDataset  # (image[1, 8, 8] float32, label int64)
    val: TensorDataset
    num_classes: int = 10


def load_digits(*, val_fraction: float = 0.2, seed: int = 0, flatten: bool = False) -> DigitsSplits:
    """Train/validation splits of the digits; ``flatten=True`` gives vectors of 64 features."""
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
    except ImportError:
        raise ShardwiseError(
            "the digits dataset needs scikit-learn, which is not installed",
            hint="pip install 'shardwise[examples]' (or: pip install scikit-learn)",
        ) from None
    bunch = _sk_load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    images = images.reshape(len(images), -1) if flatten else images.unsqueeze(1)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(labels) * val_fraction)
    val_idx, train_idx = order[:n_val], order[n_val:]
    return DigitsSplits(
        train=TensorDataset(images[train_idx], labels[train_idx]), val=TensorDataset(images[val_idx], labels[val_idx])
    )
