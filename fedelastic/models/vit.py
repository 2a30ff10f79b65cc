"""Vision Transformer built layer for layer like vit-keras' ``vit_b16`` (as used by ElasticTrainer).

The module tree mirrors the Keras layer names, with Keras' ``/`` becoming PyTorch's ``.``::

    embedding                                         Conv2d patch embedding
    class_token                                       ClassToken (parameter ``cls``)
    Transformer.posembed_input                        AddPositionEmbs (parameter ``pe``)
    Transformer.encoderblock_{i}.LayerNorm_0
    Transformer.encoderblock_{i}.MultiHeadDotProductAttention_1.{query,key,value,out}
    Transformer.encoderblock_{i}.LayerNorm_2
    Transformer.encoderblock_{i}.MlpBlock_3.{Dense_0,Dense_1}
    Transformer.encoder_norm
    head                                              Linear classifier

so the qualified names of the parameter-owning modules, in forward order, are the names
:mod:`fedelastic.profiling.chrome_trace` reads from measured traces of the Keras model.

Details kept from vit-keras: pre-norm blocks, LayerNorm epsilon 1e-6, exact (erf) GELU, the
class token prepended before the position embedding is added, the head on the class token,
no pre-logits layer. Input preprocessing (``x / 127.5 - 1``) belongs to the data pipeline.
The GELU is a module (``MlpBlock_3.gelu``; Keras' ``lambda``) so forward hooks see it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VisionTransformer", "vit_b16", "vit_tiny"]

_LN_EPS = 1e-6


class ClassToken(nn.Module):
    """Prepend a learned class token: ``[B, N, D] -> [B, N + 1, D]``."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the class token in front of the tokens."""
        return torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)


class AddPositionEmbs(nn.Module):
    """Add a learned position embedding of shape ``[1, num_tokens, D]``."""

    def __init__(self, num_tokens: int, hidden_size: int) -> None:
        super().__init__()
        self.pe = nn.Parameter(torch.empty(1, num_tokens, hidden_size))
        nn.init.normal_(self.pe, std=0.06)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Add the embedding."""
        return x + self.pe


class MultiHeadSelfAttention(nn.Module):
    """Self-attention with separate ``query``/``key``/``value``/``out`` projections."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the tokens of ``x`` (``[B, N, D]``)."""
        b, n, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, n, self.num_heads, d // self.num_heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)))
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class MlpBlock(nn.Module):
    """``Dense_0`` -> GELU -> dropout -> ``Dense_1`` -> dropout."""

    def __init__(self, hidden_size: int, mlp_dim: int, dropout: float) -> None:
        super().__init__()
        self.add_module("Dense_0", nn.Linear(hidden_size, mlp_dim))
        self.gelu = nn.GELU()  # exact (erf) GELU, as vit-keras
        self.dropout_0 = nn.Dropout(dropout)
        self.add_module("Dense_1", nn.Linear(mlp_dim, hidden_size))
        self.dropout_1 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP."""
        x = self.dropout_0(self.gelu(self.Dense_0(x)))
        return self.dropout_1(self.Dense_1(x))


class TransformerBlock(nn.Module):
    """Pre-norm encoder block, named like vit-keras' ``TransformerBlock``."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_dim: int, dropout: float) -> None:
        super().__init__()
        self.add_module("LayerNorm_0", nn.LayerNorm(hidden_size, eps=_LN_EPS))
        self.add_module("MultiHeadDotProductAttention_1", MultiHeadSelfAttention(hidden_size, num_heads))
        self.add_module("LayerNorm_2", nn.LayerNorm(hidden_size, eps=_LN_EPS))
        self.add_module("MlpBlock_3", MlpBlock(hidden_size, mlp_dim, dropout))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x + attn(ln0(x))``, then ``+ mlp(ln2(.))``."""
        x = x + self.dropout(self.MultiHeadDotProductAttention_1(self.LayerNorm_0(x)))
        return x + self.MlpBlock_3(self.LayerNorm_2(x))


class Encoder(nn.Module):
    """vit-keras' ``Transformer`` scope: position embedding, blocks, final norm."""

    def __init__(
        self, num_tokens: int, hidden_size: int, num_layers: int, num_heads: int, mlp_dim: int, dropout: float
    ) -> None:
        super().__init__()
        self.posembed_input = AddPositionEmbs(num_tokens, hidden_size)
        for i in range(num_layers):
            self.add_module(f"encoderblock_{i}", TransformerBlock(hidden_size, num_heads, mlp_dim, dropout))
        self.num_layers = num_layers
        self.encoder_norm = nn.LayerNorm(hidden_size, eps=_LN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Encode the token sequence."""
        x = self.posembed_input(x)
        for i in range(self.num_layers):
            x = getattr(self, f"encoderblock_{i}")(x)
        return self.encoder_norm(x)


class VisionTransformer(nn.Module):
    """ViT classifier with vit-keras layer names.

    Parameters
    ----------
    input_size : int
        Input height and width; must be a multiple of ``patch_size``.
    patch_size : int
        Patch edge length.
    hidden_size, num_layers, num_heads, mlp_dim : int
        Transformer width, depth, heads and MLP width.
    num_classes : int
        Size of the classifier output.
    in_channels : int
        Channels of the input images.
    dropout : float
        Dropout rate inside the blocks.
    """

    def __init__(
        self,
        *,
        input_size: int = 224,
        patch_size: int = 16,
        hidden_size: int = 768,
        num_layers: int = 12,
        num_heads: int = 12,
        mlp_dim: int = 3072,
        num_classes: int = 200,
        in_channels: int = 3,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if input_size % patch_size:
            raise ValueError(f"input_size {input_size} is not a multiple of patch_size {patch_size}")
        self.input_size = input_size
        self.num_classes = num_classes
        num_tokens = (input_size // patch_size) ** 2 + 1
        self.embedding = nn.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size)
        self.class_token = ClassToken(hidden_size)
        self.add_module("Transformer", Encoder(num_tokens, hidden_size, num_layers, num_heads, mlp_dim, dropout))
        self.head = nn.Linear(hidden_size, num_classes)
        self.num_features = hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_classes]`` for images ``[B, in_channels, input_size, input_size]``."""
        x = self.embedding(x).flatten(2).transpose(1, 2)  # [B, N, D], patches in row-major order
        x = self.Transformer(self.class_token(x))
        return self.head(x[:, 0])  # ExtractToken


def vit_b16(
    num_classes: int = 200, *, in_channels: int = 3, input_size: int = 224, dropout: float = 0.1
) -> VisionTransformer:
    """ViT-B/16 as vit-keras' ``vit_b16(include_top=True)``.

    With 200 classes at 224x224 it has 85,952,456 parameters.
    """
    return VisionTransformer(
        input_size=input_size, patch_size=16, num_classes=num_classes, in_channels=in_channels, dropout=dropout
    )


def vit_tiny(
    num_classes: int = 10,
    *,
    in_channels: int = 3,
    input_size: int = 32,
    patch_size: int = 8,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    mlp_dim: int = 128,
    dropout: float = 0.0,
) -> VisionTransformer:
    """A small ViT with the same layer naming scheme, for fast tests."""
    return VisionTransformer(
        input_size=input_size,
        patch_size=patch_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        mlp_dim=mlp_dim,
        num_classes=num_classes,
        in_channels=in_channels,
        dropout=dropout,
    )
