"""A small ResNet (He et al. 2016): the reference guides' ResNet-50 run, scaled down for CPUs.

Same ingredients as ResNet-50 (residual BasicBlocks of conv-BN-ReLU, a stride-2 downsample with a
1x1 projection shortcut at each new stage, global average pooling, one linear classifier), but
three stages of 16/32/64 channels and a 3x3 stem without max-pooling, so 8x8 digits and 32x32
images keep enough resolution. The BatchNorm layers are what ``SyncBatchNorm`` conversion
replaces: with small per-rank batches, statistics over the global batch train better.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`` with 3x3 convolutions."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """``forward(x[B, C, H, W]) -> logits[B, num_classes]``; ``blocks`` BasicBlocks per stage."""

    def __init__(self, *, in_channels: int = 1, num_classes: int = 10, widths: Sequence[int] = (16, 32, 64),
                 blocks: Sequence[int] = (2, 2, 2), seed: int | None = None) -> None:
        super().__init__()
        if len(widths) != len(blocks):
            raise ValueError(f"widths {tuple(widths)} and blocks {tuple(blocks)} need the same length")
        if seed is not None:
            torch.manual_seed(seed)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        stages = []
        in_ch = widths[0]
        for i, (width, count) in enumerate(zip(widths, blocks)):
            layers = [BasicBlock(in_ch, width, stride=1 if i == 0 else 2)]
            layers += [BasicBlock(width, width) for _ in range(count - 1)]
            stages.append(nn.Sequential(*layers))
            in_ch = width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet_small(*, in_channels: int = 1, num_classes: int = 10, seed: int | None = None) -> ResNet:
    """ResNet-14 style (3 stages x 2 BasicBlocks, 16/32/64 channels, ~0.17M parameters)."""
    return ResNet(in_channels=in_channels, num_classes=num_classes, seed=seed)
