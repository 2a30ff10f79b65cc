"""Describe a torch model as plain data for the cost model and the selectors.

:func:`describe` runs one forward pass with hooks and records, in forward order, every module
that owns parameters (a *layer*) and every weightless leaf module (an *op*: ReLU, pooling...).
The result, :class:`ModelInfo`, is pure Python/numpy: nothing downstream needs torch.
Functional operations inside ``forward`` (e.g. a residual ``x + y``) are not seen by hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported only by describe(): the data classes stay torch-free
    import torch
    from torch import nn


@cache
def _module_types() -> tuple[tuple, tuple]:
    """(norm layer types, activation types whose backward needs only a one-bit mask)."""
    from torch import nn

    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm2d)
    cheap = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.Dropout, nn.Identity, nn.Flatten)
    return norms, cheap


@dataclass(frozen=True)
class LayerInfo:
    """A module that owns parameters; sizes are per sample."""

    name: str
    kind: str  # conv | linear | norm | attention | other
    macs: int
    in_numel: int
    out_numel: int
    out_channels: int
    tensors: tuple[int, ...]
    groups: int = 1  # conv groups: a grouped (depthwise) conv's output channel needs only its own inputs
    batch_stats: bool = False  # a BatchNorm (its statistics can be frozen); other norms normalise per sample


@dataclass(frozen=True)
class OpInfo:
    """A weightless leaf module; ``above`` is the index of the next layer toward the loss."""

    name: str
    kind: str  # mask (backward needs one bit per element) | saved (backward needs its input)
    in_numel: int
    out_numel: int
    above: int


@dataclass(frozen=True)
class ModelInfo:
    """Tensors and layers of a model, in forward order (index 0 is nearest the input)."""

    model_name: str
    layers: tuple[LayerInfo, ...]
    ops: tuple[OpInfo, ...]
    tensor_names: tuple[str, ...]
    tensor_roles: tuple[str, ...]  # weight | bias | norm_weight | norm_bias | other
    tensor_layer: np.ndarray
    tensor_numel: np.ndarray
    tensor_channels: np.ndarray  # size of dim 0 (output channels)

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_names)

    @property
    def num_params(self) -> int:
        return int(self.tensor_numel.sum())

    def layer_first_tensor(self) -> np.ndarray:
        return np.array([layer.tensors[0] for layer in self.layers], dtype=np.int64)


def _kind(module: nn.Module) -> str:
    from torch import nn

    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, _module_types()[0]):
        return "norm"
    if isinstance(module, nn.MultiheadAttention):
        return "attention"
    return "other"


def _macs(module: nn.Module, kind: str, inp: torch.Tensor, out: torch.Tensor) -> int:
    batch = out.shape[0] if out.dim() > 0 else 1
    if kind == "conv":
        kernel = int(np.prod(module.kernel_size))
        return out.numel() // batch * (module.in_channels // module.groups) * kernel
    if kind == "linear":
        return out.numel() // batch * module.in_features
    if kind == "attention":
        tokens, dim = inp.shape[1], module.embed_dim
        return 4 * tokens * dim * dim + 2 * tokens * tokens * dim
    return 0


def first_tensor(x) -> torch.Tensor | None:
    """The first tensor in ``x`` (a tensor, or nested tuples/lists), or None."""
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for item in x:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def describe(model: nn.Module, sample: torch.Tensor, model_name: str = "") -> ModelInfo:
    """Run ``model`` once on ``sample`` (batch >= 1) and describe it per sample."""
    import torch
    from torch import nn

    owners = [(name, mod) for name, mod in model.named_modules() if any(True for _ in mod.parameters(recurse=False))]
    owner_ids = {id(mod) for _, mod in owners}
    leaves = [(name, mod) for name, mod in model.named_modules() if not any(True for _ in mod.children())]
    seen: dict[int, tuple[int, str, nn.Module, int, int, int, int]] = {}
    order = [0]

    def hook(name: str):
        def fn(mod, args, out):
            if id(mod) in seen:
                return
            inp, o = first_tensor(args), first_tensor(out)
            batch = sample.shape[0]
            in_n = inp.numel() // batch if inp is not None else 0
            out_n = o.numel() // batch if o is not None else 0
            kind = _kind(mod)
            macs = _macs(mod, kind, inp, o) if (inp is not None and o is not None) else 0
            seen[id(mod)] = (order[0], name, mod, in_n, out_n, macs, o.shape[1] if o is not None and o.dim() > 1 else 1)
            order[0] += 1

        return fn

    def pre_hook(name: str):
        def fn(mod, args):
            if id(mod) not in seen:  # non-leaf owners of direct params (e.g. a class token)
                n = sum(p.numel() for p in mod.parameters(recurse=False))
                seen[id(mod)] = (order[0], name, mod, n, n, 0, 1)
                order[0] += 1

        return fn

    handles = []
    for name, mod in leaves:
        handles.append(mod.register_forward_hook(hook(name)))
    for name, mod in owners:
        if any(True for _ in mod.children()):
            handles.append(mod.register_forward_pre_hook(pre_hook(name)))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(sample)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()

    names, roles, tlayer, numel, channels = [], [], [], [], []
    layers: list[LayerInfo] = []
    ops_raw = []
    for _, name, mod, in_n, out_n, macs, out_ch in sorted(seen.values(), key=lambda r: r[0]):
        if id(mod) not in owner_ids:
            kind = "mask" if isinstance(mod, _module_types()[1]) else "saved"
            ops_raw.append((name, kind, in_n, out_n, len(layers)))
            continue
        kind = _kind(mod)
        idx = []
        for pname, p in mod.named_parameters(recurse=False):
            if kind == "norm":
                role = "norm_weight" if pname == "weight" else "norm_bias"
            elif kind in ("conv", "linear"):
                role = "bias" if pname == "bias" else "weight"
            else:
                role = "other"
            idx.append(len(names))
            names.append(f"{name}.{pname}" if name else pname)
            roles.append(role)
            tlayer.append(len(layers))
            numel.append(p.numel())
            channels.append(p.shape[0] if p.dim() > 0 else 1)
        groups = int(getattr(mod, "groups", 1)) if kind == "conv" else 1
        batch_stats = isinstance(mod, nn.modules.batchnorm._BatchNorm)
        layers.append(
            LayerInfo(name, kind, int(macs), int(in_n), int(out_n), int(out_ch), tuple(idx), groups, batch_stats)
        )
    missing = [n for n, p in model.named_parameters() if n not in set(names)]
    if missing:
        raise ValueError(f"parameters not reached by a forward pass: {missing[:5]}")
    ops = tuple(OpInfo(n, k, i, o, min(a, len(layers))) for n, k, i, o, a in ops_raw)
    return ModelInfo(
        model_name=model_name,
        layers=tuple(layers),
        ops=ops,
        tensor_names=tuple(names),
        tensor_roles=tuple(roles),
        tensor_layer=np.array(tlayer, dtype=np.int64),
        tensor_numel=np.array(numel, dtype=np.int64),
        tensor_channels=np.array(channels, dtype=np.int64),
    )
