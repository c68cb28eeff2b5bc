"""The reference guides' SimpleNet: Dense -> ReLU -> Dropout -> Dense.

The MindSpore guide uses it on flattened 28x28 MNIST (784 inputs, 256 hidden, 10 classes,
dropout 0.5). Here the defaults fit scikit-learn's 8x8 digits (64 inputs), which ship with the
package instead of being downloaded.
"""

from __future__ import annotations

import torch
from torch import nn


class SimpleNet(nn.Module):
    """``forward(x[B, input_dim] or x[B, 1, H, W]) -> logits[B, num_classes]``."""

    def __init__(self, input_dim: int = 64, hidden_dim: int = 256, num_classes: int = 10, *, dropout: float = 0.5,
                 seed: int | None = None) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)  # nn.Linear's own init, drawn reproducibly
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.relu = nn.ReLU()
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.fc2(self.dropout(self.relu(self.fc1(x))))
