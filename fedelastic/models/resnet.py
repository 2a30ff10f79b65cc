"""ResNet-50 (and smaller variants) built layer for layer like ``tf.keras.applications.ResNet50``.

Every layer that owns parameters is a direct child of the model, registered in forward order
under its Keras name (``conv1_conv``, ``conv1_bn``, ``conv2_block1_0_conv``, ...,
``conv5_block3_3_bn``, ``dense``), so ``model.named_modules()`` yields the names that measured
traces of the Keras model use (see :mod:`fedelastic.profiling.chrome_trace`).

Details kept from Keras:

- convolutions have biases (Keras' ResNet50 uses ``use_bias=True``);
- the stride of a stage sits on the first 1x1 convolution of its first block (``_0_conv`` and
  ``_1_conv``), not on the 3x3 one;
- BatchNorm epsilon is 1.001e-5 and momentum 0.99 (PyTorch momentum 0.01);
- the classifier is the head the ElasticTrainer artifact puts on the backbone:
  global average pooling, dropout 0.2, then a dense layer named ``dense``.

Activations and pooling are modules too (``conv1_relu``, ``pool1_pool``, ``conv2_block1_1_relu``,
``conv2_block1_out``, ...), so forward hooks see them; the residual additions are functional.

Input preprocessing (Keras' ``caffe`` mode: RGB->BGR and mean subtraction) belongs to the data
pipeline and is not part of the module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .layout import layout_settings

__all__ = ["ResNet", "resnet50", "resnet_small"]

_BN_EPS = 1.001e-5
_BN_MOMENTUM = 0.01  # Keras momentum 0.99


class ResNet(nn.Module):
    """Bottleneck ResNet (v1, Keras flavour) with Keras layer names.

    Parameters
    ----------
    blocks : sequence of int
        Number of bottleneck blocks in each stage; one entry per stage, stages are named
        ``conv2``, ``conv3``, ... as in Keras. ``(3, 4, 6, 3)`` is ResNet-50.
    width : int
        Bottleneck width of the first stage (64 in ResNet-50); it doubles every stage and the
        block output has ``4 * width`` channels.
    num_classes : int
        Size of the classifier output.
    in_channels : int
        Channels of the input images.
    dropout : float
        Dropout rate before the classifier.
    input_size : int
        Nominal input height and width (informational: the network works on any size).
    layout : str
        ``"keras"`` (default) or ``"torchvision"``: torchvision's ResNet (v1.5: a stage's stride on the
        3x3 convolution, BatchNorm epsilon 1e-5) taking images in [0, 1] and normalising them with
        ImageNet's mean and std, as torchvision's ImageNet weights expect (:mod:`.imagenet`).
    """

    def __init__(
        self,
        blocks: Sequence[int] = (3, 4, 6, 3),
        *,
        width: int = 64,
        num_classes: int = 200,
        in_channels: int = 3,
        dropout: float = 0.2,
        input_size: int = 224,
        layout: str = "keras",
    ) -> None:
        super().__init__()
        if not blocks or any(b < 1 for b in blocks):
            raise ValueError(f"blocks must be a non-empty sequence of positive ints, got {blocks!r}")
        self._eps, self.input_norm = layout_settings(layout, in_channels, _BN_EPS)
        self.input_size = input_size
        self.num_classes = num_classes
        # (block name prefix, has a projection shortcut) in forward order
        self._plan: list[tuple[str, bool]] = []

        self._conv("conv1_conv", in_channels, width, 7, stride=2, padding=3)
        self._bn("conv1_bn", width)
        self.conv1_relu = nn.ReLU()
        self.pool1_pad = nn.ZeroPad2d(1)
        self.pool1_pool = nn.MaxPool2d(3, stride=2)
        in_ch = width
        for stage, n_blocks in enumerate(blocks):
            filters = width * 2**stage
            stride = 1 if stage == 0 else 2
            for i in range(n_blocks):
                name = f"conv{stage + 2}_block{i + 1}"
                first = i == 0
                s = stride if first else 1
                if first:
                    self._conv(f"{name}_0_conv", in_ch, 4 * filters, 1, stride=s)
                    self._bn(f"{name}_0_bn", 4 * filters)
                s1, s2 = (1, s) if layout == "torchvision" else (s, 1)
                self._conv(f"{name}_1_conv", in_ch, filters, 1, stride=s1)
                self._bn(f"{name}_1_bn", filters)
                self.add_module(f"{name}_1_relu", nn.ReLU())
                self._conv(f"{name}_2_conv", filters, filters, 3, stride=s2, padding=1)
                self._bn(f"{name}_2_bn", filters)
                self.add_module(f"{name}_2_relu", nn.ReLU())
                self._conv(f"{name}_3_conv", filters, 4 * filters, 1)
                self._bn(f"{name}_3_bn", 4 * filters)
                self.add_module(f"{name}_out", nn.ReLU())  # after the residual add
                self._plan.append((name, first))
                in_ch = 4 * filters
        self.global_average_pooling2d = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.add_module("dense", nn.Linear(in_ch, num_classes))
        self.num_features = in_ch

    def _conv(self, name: str, cin: int, cout: int, k: int, *, stride: int = 1, padding: int = 0) -> None:
        self.add_module(name, nn.Conv2d(cin, cout, k, stride=stride, padding=padding, bias=True))

    def _bn(self, name: str, ch: int) -> None:
        self.add_module(name, nn.BatchNorm2d(ch, eps=self._eps, momentum=_BN_MOMENTUM))

    def _cbn(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return getattr(self, f"{name}_bn")(getattr(self, f"{name}_conv")(x))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone output before pooling, shape ``[B, 4 * width * 2**(stages-1), H/32, W/32]``."""
        x = self.conv1_relu(self._cbn(self.input_norm(x), "conv1"))
        x = self.pool1_pool(self.pool1_pad(x))
        for name, projection in self._plan:
            shortcut = self._cbn(x, f"{name}_0") if projection else x
            y = getattr(self, f"{name}_1_relu")(self._cbn(x, f"{name}_1"))
            y = getattr(self, f"{name}_2_relu")(self._cbn(y, f"{name}_2"))
            y = self._cbn(y, f"{name}_3")
            x = getattr(self, f"{name}_out")(shortcut + y)  # {name}_add, then {name}_out
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_classes]`` for images ``[B, 3, H, W]``."""
        x = self.global_average_pooling2d(self.forward_features(x)).flatten(1)
        return self.dense(self.dropout(x))


def resnet50(
    num_classes: int = 200, *, in_channels: int = 3, input_size: int = 224, dropout: float = 0.2, layout: str = "keras"
) -> ResNet:
    """ResNet-50 as ``tf.keras.applications.ResNet50`` + the artifact's dense head (``layout="torchvision"``:
    as torchvision's, for its ImageNet weights).

    With 200 classes it has 23,944,392 parameters (Keras' trainable count).
    """
    return ResNet(
        (3, 4, 6, 3),
        width=64,
        num_classes=num_classes,
        in_channels=in_channels,
        dropout=dropout,
        input_size=input_size,
        layout=layout,
    )


def resnet_small(
    num_classes: int = 10,
    *,
    in_channels: int = 3,
    input_size: int = 32,
    blocks: Sequence[int] = (1, 1, 1, 1),
    width: int = 8,
    dropout: float = 0.2,
    layout: str = "keras",
) -> ResNet:
    """A narrow, shallow ResNet with the same layer naming scheme, for fast tests."""
    return ResNet(
        blocks,
        width=width,
        num_classes=num_classes,
        in_channels=in_channels,
        dropout=dropout,
        input_size=input_size,
        layout=layout,
    )
