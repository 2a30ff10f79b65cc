"""Model layouts: ``keras`` (fedelastic's default) or ``torchvision`` (torchvision's BatchNorm epsilon and
ImageNet input normalisation inside the model, as its ImageNet weights expect: :mod:`.imagenet`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TORCHVISION_EPS = 1e-5


class ImageNetNorm(nn.Module):
    """``(x - mean) / std`` per channel with ImageNet's statistics (buffers not in the state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def layout_settings(layout: str, in_channels: int, keras_eps: float) -> tuple[float, Callable]:
    """(BatchNorm epsilon, input normalisation) of a model ``layout``: ``keras`` or ``torchvision``."""
    if layout == "keras":
        return keras_eps, _identity
    if layout == "torchvision":
        if in_channels != 3:
            raise ValueError(f"layout 'torchvision' takes RGB images (in_channels 3), got in_channels {in_channels}")
        return TORCHVISION_EPS, ImageNetNorm()
    raise ValueError(f"layout must be 'keras' or 'torchvision', got {layout!r}")
