"""Small models for the embedded digits data and MCU-class budgets."""

from __future__ import annotations

from torch import nn


def small_cnn(num_classes: int = 10, in_channels: int = 1, input_size: int = 8, width: int = 16) -> nn.Sequential:
    """A three-conv CNN with batch norm, sized for 8x8 digits."""
    w = width
    return nn.Sequential(
        nn.Conv2d(in_channels, w, 3, padding=1, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU(),
        nn.Conv2d(w, 2 * w, 3, padding=1, bias=False),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1, bias=False),
        nn.BatchNorm2d(4 * w),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * w, num_classes),
    )


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, expand: int, stride: int):
        super().__init__()
        mid = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.block = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU6(),
            nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU6(),
            nn.Conv2d(mid, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x):
        y = self.block(x)
        return x + y if self.use_res else y


def mcu_net(num_classes: int = 10, in_channels: int = 1, input_size: int = 8, width: int = 16) -> nn.Sequential:
    """An MCUNet-like stack of inverted residual blocks (depthwise convs, ReLU6)."""
    w = width
    return nn.Sequential(
        nn.Conv2d(in_channels, w, 3, padding=1, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU6(),
        _InvertedResidual(w, w, 3, 1),
        _InvertedResidual(w, 2 * w, 4, 2),
        _InvertedResidual(2 * w, 2 * w, 4, 1),
        _InvertedResidual(2 * w, 4 * w, 4, 2),
        _InvertedResidual(4 * w, 4 * w, 4, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * w, num_classes),
    )
