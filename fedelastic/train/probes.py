"""The probes a strategy asks for, run on the real model: ElasticTrainer's importance and TinyTrain's Fisher potential.

Each runs over the tensors of a scope (all when ``None``) on micro-batches of ``micro_batch``
samples, gradients accumulated over a sum loss, so the figures equal one pass over the batch when
BatchNorm is frozen. Parameters are taken in :class:`ModelInfo` tensor order (:func:`ordered_params`).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from ..modelinfo import ModelInfo
from .optim import SGD


def ordered_params(model: nn.Module, info: ModelInfo) -> list[nn.Parameter]:
    params = dict(model.named_parameters())
    return [params[name] for name in info.tensor_names]


def count_backward_nodes(loss: torch.Tensor) -> int:
    """Autograd nodes a backward from ``loss`` would run (a FLOP-free proxy of backward work)."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return len(seen)


def _chunks(n: int, micro_batch: int) -> list[slice]:
    m = micro_batch or n
    return [slice(i, min(i + m, n)) for i in range(0, n, m)]


def importance_probe(
    model: nn.Module,
    info: ModelInfo,
    optimizer: SGD | torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    micro_batch: int = 0,
    scope: np.ndarray | None = None,
) -> np.ndarray:
    """ElasticTrainer importance ``I[k] = -sum g * dw`` of every tensor, from one real step.

    Full backward, one real optimizer step (dw includes lr, momentum and weight decay), a second
    full backward at the new weights, then weights, buffers and optimizer state are restored.
    ``micro_batch`` (0: the whole batch) accumulates each backward over micro-batches of a sum
    loss divided by the batch size: the same gradient as one pass when BatchNorm is frozen.
    ``scope`` (bool per tensor, default all) limits the probe to those tensors; the others get 0.
    """
    params = ordered_params(model, info)
    in_scope = np.ones(len(params), bool) if scope is None else np.asarray(scope, bool)
    flags = [p.requires_grad for p in params]
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(optimizer.state_dict())
    n = len(x)

    def backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        for part in _chunks(n, micro_batch):
            (nn.functional.cross_entropy(model(x[part]), y[part], reduction="sum") / n).backward()

    try:
        for p, on in zip(params, in_scope):
            p.requires_grad_(bool(on))
        before = [p.detach().clone() for p in params]
        backward()
        optimizer.step()
        delta = [p.detach() - b for p, b in zip(params, before)]
        backward()
        zero = torch.zeros((), device=params[0].device)
        sums = [-(p.grad * d).sum() if p.grad is not None else zero for p, d in zip(params, delta)]
        importance = torch.stack(sums).double().cpu().numpy()  # one device sync, not one per tensor
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.load_state_dict(snapshot)
        optimizer.load_state_dict(opt_state)
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    return importance


def fisher_layers(info: ModelInfo, scope: np.ndarray | None) -> list[int]:
    """The layers :func:`fisher_probe` scores: the conv/linear layers from the deepest to the
    highest tensor of ``scope`` (all when None; none when it is empty)."""
    lowest, highest = 0, len(info.layers) - 1
    if scope is not None:
        picked = np.flatnonzero(np.asarray(scope, bool))
        lowest, highest = (
            (int(info.tensor_layer[picked[0]]), int(info.tensor_layer[picked[-1]])) if picked.size else (1, 0)
        )
    return [li for li, layer in enumerate(info.layers) if layer.kind in ("conv", "linear") and lowest <= li <= highest]


def fisher_probe(
    model: nn.Module,
    info: ModelInfo,
    x: torch.Tensor,
    y: torch.Tensor,
    micro_batch: int = 0,
    scope: np.ndarray | None = None,
) -> dict[int, np.ndarray]:
    """TinyTrain's per-channel Fisher potential of each conv/linear layer's output.

    ``delta_o = 1/(2N) * sum_n (sum_d a[n,o,d] * g[n,o,d])**2``: the inner sum over the channel's
    positions is taken per sample, before squaring. Only the error gradient is computed (no
    weight gradient). ``micro_batch`` splits the batch (per-sample sums: exact when BatchNorm is
    frozen); ``scope`` limits it to the layers from the deepest to the highest tensor in scope.
    """
    modules = dict(model.named_modules())
    targets = {li: modules[info.layers[li].name] for li in fisher_layers(info, scope)}
    outputs: dict[int, torch.Tensor] = {}

    def keep(li):
        def hook(_mod, _inp, out):
            out.retain_grad()
            outputs[li] = out

        return hook

    params = ordered_params(model, info)
    flags = [p.requires_grad for p in params]
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}  # a train-mode forward moves BN statistics
    handles = [mod.register_forward_hook(keep(li)) for li, mod in targets.items()]
    n = len(x)
    sums = {li: 0.0 for li in targets}
    try:
        for p in params:
            p.requires_grad_(False)
        for part in _chunks(n, micro_batch):
            outputs.clear()
            xi = x[part].detach().clone().requires_grad_(True)  # the error gradient flows; no dW
            (nn.functional.cross_entropy(model(xi), y[part], reduction="sum") / n).backward()
            for li, a in outputs.items():
                prod = (a * a.grad).detach()
                if isinstance(targets[li], nn.modules.conv._ConvNd):
                    per_sample = prod.flatten(2).sum(-1)  # (N, C)
                else:
                    per_sample = prod.reshape(prod.shape[0], -1, prod.shape[-1]).sum(1)  # channels last
                sums[li] = sums[li] + (per_sample.double() ** 2).sum(0)
        fisher = {li: (total / (2 * n)).cpu().numpy().astype(float) for li, total in sums.items() if li in outputs}
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
        model.zero_grad(set_to_none=True)
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    return fisher
