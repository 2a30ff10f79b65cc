"""MobileNetV2 built layer for layer like ``tf.keras.applications.MobileNetV2``.

Every layer that owns parameters is a direct child of the model, registered in forward order
under its Keras name (``Conv1``, ``bn_Conv1``, ``expanded_conv_depthwise``, ...,
``block_16_project_BN``, ``Conv_1``, ``Conv_1_bn``, ``dense``), so ``model.named_modules()``
yields the names that measured traces of the Keras model use (see :mod:`fedelastic.profiling.chrome_trace`).

Details kept from Keras:

- convolutions have no bias; activations are ReLU6;
- strided convolutions pad like TensorFlow's ``"same"`` (the extra row/column goes at the
  bottom/right), which is what Keras' ``Conv1`` and ``block_N_pad`` layers do;
- BatchNorm epsilon is 1e-3 and momentum 0.999 (PyTorch momentum 0.001);
- channel counts follow Keras for a width multiplier ``alpha``: every count is rounded with
  ``_make_divisible(c * alpha, 8)`` and the last convolution keeps 1280 channels unless
  ``alpha > 1``;
- the classifier is the artifact's head: global average pooling, dropout 0.2, dense ``dense``.

The ReLU6 activations and the pooling are modules too (``Conv1_relu``, ``block_1_expand_relu``,
``block_1_depthwise_relu``, ``out_relu``, ...), so forward hooks see them; the strided-conv padding
and the residual additions are functional.

Input preprocessing (``x / 127.5 - 1``) belongs to the data pipeline, not to the module.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layout import layout_settings

__all__ = ["MobileNetV2", "mobilenetv2"]

_BN_EPS = 1e-3
_BN_MOMENTUM = 0.001  # Keras momentum 0.999

# (expansion, output channels, stride) of each inverted residual block, block_id 0..16
_BLOCKS: tuple[tuple[int, int, int], ...] = (
    (1, 16, 1),
    (6, 24, 2), (6, 24, 1),
    (6, 32, 2), (6, 32, 1), (6, 32, 1),
    (6, 64, 2), (6, 64, 1), (6, 64, 1), (6, 64, 1),
    (6, 96, 1), (6, 96, 1), (6, 96, 1),
    (6, 160, 2), (6, 160, 1), (6, 160, 1),
    (6, 320, 1),
)  # fmt: skip


def _make_divisible(v: float, divisor: int = 8) -> int:
    """Keras' channel rounding: nearest multiple of ``divisor``, never below 90% of ``v``."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def _same_pad(x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """Zero-pad ``x`` as TensorFlow's ``padding="same"`` does (extra pixel at bottom/right)."""
    pads: list[int] = []
    for size in (x.shape[-1], x.shape[-2]):  # F.pad order: last dim first
        total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads)


class MobileNetV2(nn.Module):
    """MobileNetV2 with Keras layer names.

    Parameters
    ----------
    width_mult : float
        Keras' ``alpha``; 1.0 is the standard network.
    num_classes : int
        Size of the classifier output.
    in_channels : int
        Channels of the input images.
    dropout : float
        Dropout rate before the classifier.
    input_size : int
        Nominal input height and width (informational: the network works on any size).
    layout : str
        ``"keras"`` (default) or ``"torchvision"``: torchvision's MobileNetV2 (strided convolutions pad one
        pixel on every side, BatchNorm epsilon 1e-5) taking images in [0, 1] and normalising them with
        ImageNet's mean and std, as torchvision's ImageNet weights expect (:mod:`.imagenet`).
    """

    def __init__(
        self,
        width_mult: float = 1.0,
        *,
        num_classes: int = 200,
        in_channels: int = 3,
        dropout: float = 0.2,
        input_size: int = 224,
        layout: str = "keras",
    ) -> None:
        super().__init__()
        if width_mult <= 0:
            raise ValueError(f"width_mult must be positive, got {width_mult}")
        self._eps, self.input_norm = layout_settings(layout, in_channels, _BN_EPS)
        self._same = layout == "keras"  # TensorFlow's "same" padding; torchvision pads 1 on every side
        strided_pad = 0 if self._same else 1
        self.input_size = input_size
        self.num_classes = num_classes
        # (prefix, has expansion, stride, residual) in forward order
        self._plan: list[tuple[str, bool, int, bool]] = []

        first = _make_divisible(32 * width_mult, 8)
        self.add_module("Conv1", nn.Conv2d(in_channels, first, 3, stride=2, padding=strided_pad, bias=False))
        self._bn("bn_Conv1", first)
        self.add_module("Conv1_relu", nn.ReLU6())
        in_ch = first
        for block_id, (expansion, filters, stride) in enumerate(_BLOCKS):
            out_ch = _make_divisible(int(filters * width_mult), 8)
            prefix = f"block_{block_id}_" if block_id else "expanded_conv_"
            hidden = in_ch * expansion
            if block_id:
                self.add_module(prefix + "expand", nn.Conv2d(in_ch, hidden, 1, bias=False))
                self._bn(prefix + "expand_BN", hidden)
                self.add_module(prefix + "expand_relu", nn.ReLU6())
            padding = 1 if stride == 1 else strided_pad  # Keras: stride 2 pads explicitly, like block_N_pad
            dw = nn.Conv2d(hidden, hidden, 3, stride=stride, padding=padding, groups=hidden, bias=False)
            self.add_module(prefix + "depthwise", dw)
            self._bn(prefix + "depthwise_BN", hidden)
            self.add_module(prefix + "depthwise_relu", nn.ReLU6())
            self.add_module(prefix + "project", nn.Conv2d(hidden, out_ch, 1, bias=False))
            self._bn(prefix + "project_BN", out_ch)
            self._plan.append((prefix, bool(block_id), stride, in_ch == out_ch and stride == 1))
            in_ch = out_ch
        last = _make_divisible(1280 * width_mult, 8) if width_mult > 1.0 else 1280
        self.add_module("Conv_1", nn.Conv2d(in_ch, last, 1, bias=False))
        self._bn("Conv_1_bn", last)
        self.out_relu = nn.ReLU6()
        self.global_average_pooling2d = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.add_module("dense", nn.Linear(last, num_classes))
        self.num_features = last

    def _bn(self, name: str, ch: int) -> None:
        self.add_module(name, nn.BatchNorm2d(ch, eps=self._eps, momentum=_BN_MOMENTUM))

    def _run(self, x: torch.Tensor, *names: str, prefix: str) -> torch.Tensor:
        for name in names:
            x = getattr(self, prefix + name)(x)
        return x

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone output (after ``out_relu``), shape ``[B, C, H/32, W/32]``."""
        x = self.input_norm(x)
        x = self.Conv1_relu(self.bn_Conv1(self.Conv1(_same_pad(x, 3, 2) if self._same else x)))
        for prefix, expand, stride, residual in self._plan:
            y = x
            if expand:
                y = self._run(y, "expand", "expand_BN", "expand_relu", prefix=prefix)
            if stride == 2 and self._same:
                y = _same_pad(y, 3, 2)  # block_N_pad
            y = self._run(y, "depthwise", "depthwise_BN", "depthwise_relu", prefix=prefix)
            y = self._run(y, "project", "project_BN", prefix=prefix)
            x = x + y if residual else y  # block_N_add
        return self.out_relu(self.Conv_1_bn(self.Conv_1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_classes]`` for images ``[B, 3, H, W]``."""
        x = self.global_average_pooling2d(self.forward_features(x)).flatten(1)
        return self.dense(self.dropout(x))


def mobilenetv2(
    width_mult: float = 1.0,
    *,
    num_classes: int = 200,
    in_channels: int = 3,
    input_size: int = 224,
    dropout: float = 0.2,
    layout: str = "keras",
) -> MobileNetV2:
    """MobileNetV2 as ``tf.keras.applications.MobileNetV2(alpha=width_mult)`` + dense head.

    With ``width_mult=1.0`` and 200 classes it has 2,480,072 parameters (Keras' trainable count).
    Small variants for tests: ``mobilenetv2(0.35, num_classes=10, input_size=32)``. ``layout="torchvision"``:
    as torchvision's, for its ImageNet weights.
    """
    return MobileNetV2(
        width_mult, num_classes=num_classes, in_channels=in_channels, dropout=dropout, input_size=input_size,
        layout=layout,
    )  # fmt: skip
