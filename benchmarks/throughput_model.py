"""The issue-10 throughput workload's model: a ~5.5k-parameter CNN for 8x8 digits (a user factory)."""

from torch import nn


def tiny_cnn(num_classes: int = 10, in_channels: int = 1, input_size: int = 8) -> nn.Sequential:
    flat = 16 * (input_size // 2) ** 2
    return nn.Sequential(
        nn.Conv2d(in_channels, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, 16),
        nn.ReLU(),
        nn.Linear(16, num_classes),
    )
