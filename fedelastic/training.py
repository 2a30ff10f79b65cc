"""The local trainer: applies a strategy's selections for real and prices every step it runs.

* Unselected parameters get ``requires_grad=False``, so autograd skips their dW, and backprop
  stops below the deepest selected tensor (nothing below it needs a gradient).
* Channel-sparse selections zero the gradient of unselected output channels and restore those
  channels' values and optimizer state after each step, so they stay exactly unchanged.
* Norm layers with no trained tensor run in eval mode (running statistics frozen).
* The probes a strategy asks for (ElasticTrainer importance, TinyTrain Fisher potential) run on
  the real model; their forward and backward passes are charged to the emulated time.
* A selection that does not fit the device's training memory is never trained: the result says
  ``fits=False``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .costmodel import CostModel
from .data import ArrayDataset
from .modelinfo import ModelInfo
from .quant import with_numerics
from .selection import Selection, SelectionContext, SelectionStrategy

_NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass
class LocalResult:
    """What one client's local training produced."""

    fits: bool
    num_examples: int
    steps: int = 0
    train_loss: float = float("nan")
    trained: dict[str, np.ndarray] = field(default_factory=dict)  # tensors and norm buffers that changed
    channel_masks: dict[str, np.ndarray] = field(default_factory=dict)  # partial tensors: 0/1 per output channel
    ratios: np.ndarray | None = None  # union over the round's selections
    train_time_s: float = 0.0
    overhead_time_s: float = 0.0  # probes, included in train_time_s
    macs: float = 0.0
    peak_memory_bytes: float = 0.0
    selections: int = 0
    host_wall_s: float = 0.0


def seed_everything(seed: int | list[int]) -> np.random.Generator:
    rng = np.random.default_rng(seed)
    torch.manual_seed(int(rng.integers(2**62)))
    return rng


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


def importance_probe(
    model: nn.Module, info: ModelInfo, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> np.ndarray:
    """ElasticTrainer importance ``I[k] = -sum g * dw`` of every tensor, from one real step.

    Full backward, one real optimizer step (dw includes lr, momentum and weight decay), a second
    full backward at the new weights, then weights, buffers and optimizer state are restored.
    """
    params = ordered_params(model, info)
    flags = [p.requires_grad for p in params]
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(optimizer.state_dict())
    try:
        for p in params:
            p.requires_grad_(True)
        before = [p.detach().clone() for p in params]
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        delta = [p.detach() - b for p, b in zip(params, before)]
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        importance = np.array(
            [-(p.grad * d).sum().item() if p.grad is not None else 0.0 for p, d in zip(params, delta)]
        )
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.load_state_dict(snapshot)
        optimizer.load_state_dict(opt_state)
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    return importance


def fisher_probe(model: nn.Module, info: ModelInfo, x: torch.Tensor, y: torch.Tensor) -> dict[int, np.ndarray]:
    """TinyTrain's per-channel Fisher potential of each conv/linear layer's output.

    ``delta_o = 1/(2N) * sum_n (sum_d a[n,o,d] * g[n,o,d])**2``: the inner sum over the channel's
    positions is taken per sample, before squaring.
    """
    modules = dict(model.named_modules())
    targets = {li: modules[layer.name] for li, layer in enumerate(info.layers) if layer.kind in ("conv", "linear")}
    outputs: dict[int, torch.Tensor] = {}

    def keep(li):
        def hook(_mod, _inp, out):
            out.retain_grad()
            outputs[li] = out

        return hook

    params = ordered_params(model, info)
    flags = [p.requires_grad for p in params]
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}  # the probe's forward moves BN statistics
    handles = [mod.register_forward_hook(keep(li)) for li, mod in targets.items()]
    try:
        for p in params:
            p.requires_grad_(True)
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        fisher = {}
        for li, a in outputs.items():
            prod = (a * a.grad).detach()
            if isinstance(targets[li], nn.modules.conv._ConvNd):
                per_sample = prod.flatten(2).sum(-1)  # (N, C)
            else:
                per_sample = prod.reshape(prod.shape[0], -1, prod.shape[-1]).sum(1)  # channels last
            fisher[li] = (per_sample**2).sum(0).div(2 * prod.shape[0]).numpy().astype(float)
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


class _Applied:
    """A selection applied to a model: requires_grad, norm modes and channel masks."""

    def __init__(self, model: nn.Module, info: ModelInfo, params: list[nn.Parameter], selection: Selection):
        self.params, self.selection = params, selection
        for p, r in zip(params, selection.ratios):
            p.requires_grad_(bool(r > 0))
        modules = dict(model.named_modules())
        for layer in info.layers:
            mod = modules[layer.name]
            if isinstance(mod, _NORM_TYPES):
                mod.train(any(selection.ratios[k] > 0 for k in layer.tensors))
        self.masks = {}
        for k, idx in selection.channels.items():
            mask = torch.zeros(params[k].shape[0], dtype=torch.bool)
            mask[torch.as_tensor(idx)] = True
            self.masks[k] = mask

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer step that leaves unselected channels exactly as they were."""
        saved = {}
        for k, mask in self.masks.items():
            p = self.params[k]
            if p.grad is not None:
                p.grad[~mask] = 0
            buf = optimizer.state.get(p, {}).get("momentum_buffer")
            saved[k] = (p.detach()[~mask].clone(), None if buf is None else buf[~mask].clone())
        optimizer.step()
        with torch.no_grad():
            for k, (values, buf) in saved.items():
                p, mask = self.params[k], self.masks[k]
                p[~mask] = values
                state_buf = optimizer.state.get(p, {}).get("momentum_buffer")
                if state_buf is not None:
                    state_buf[~mask] = 0 if buf is None else buf


def batches(n: int, batch_size: int, epochs: int, rng: np.random.Generator, max_steps: int = 0):
    """Shuffled index batches over ``epochs`` passes, capped at ``max_steps`` (0: no cap)."""
    step = 0
    for _ in range(epochs):
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            if max_steps and step >= max_steps:
                return
            yield order[start : start + batch_size]
            step += 1


@with_numerics  # adds ``numerics=``: int8/fp16 training emulated (fedelastic/quant.py)
def train_local(
    model: nn.Module,
    info: ModelInfo,
    strategy: SelectionStrategy,
    cost: CostModel,
    data: ArrayDataset,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    max_steps: int = 0,
    seed: int | list[int] = 0,
) -> LocalResult:
    """Train ``model`` in place on ``data`` with ``strategy``'s selections, pricing each step on ``cost``."""
    start = time.perf_counter()
    rng = seed_everything(seed)
    params = ordered_params(model, info)
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    x_all, y_all = torch.from_numpy(data.x), torch.from_numpy(data.y)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.train()
    result = LocalResult(fits=True, num_examples=len(data))
    union = np.zeros(info.num_tensors)
    channel_union: dict[int, np.ndarray] = {}
    losses = []
    applied = None
    step_time = step_macs = 0.0
    for step, idx in enumerate(batches(len(data), batch_size, epochs, rng, max_steps)):
        x, y = x_all[idx], y_all[idx]
        if applied is None or strategy.should_reselect(step):
            ctx = SelectionContext(info, cost, step, rng)
            if strategy.probe == "importance":
                ctx.importance = importance_probe(model, info, optimizer, x, y)
                result.overhead_time_s += cost.probe_time_s(full_backward_passes=2, forward_passes=2)
            elif strategy.probe == "fisher":
                ctx.fisher = fisher_probe(model, info, x, y)
                result.overhead_time_s += cost.probe_time_s(full_backward_passes=1)
            selection = strategy.select(ctx)
            peak = cost.peak_memory_bytes(selection.ratios)
            result.peak_memory_bytes = max(result.peak_memory_bytes, peak)
            if peak > ctx.memory_budget_bytes:
                model.load_state_dict(before)
                result.fits = False
                result.train_time_s = result.overhead_time_s
                result.host_wall_s = time.perf_counter() - start
                return result
            applied = _Applied(model, info, params, selection)
            result.selections += 1
            union = np.maximum(union, selection.ratios)
            for k in np.flatnonzero(selection.ratios > 0):
                chans = selection.channels.get(int(k), np.arange(info.tensor_channels[k]))
                channel_union[int(k)] = np.union1d(channel_union.get(int(k), []), chans).astype(np.int64)
            step_time, step_macs = cost.step_time_s(selection.ratios), cost.step_macs(selection.ratios)
        if not selection.mask.any():
            continue  # nothing to train: no step runs
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        applied.step(optimizer)
        losses.append(loss.item())
        result.train_time_s += step_time
        result.macs += step_macs
        result.steps += 1
    result.train_time_s += result.overhead_time_s
    result.train_loss = float(np.mean(losses)) if losses else float("nan")
    result.ratios = union
    for p in params:
        p.requires_grad_(True)
    state = model.state_dict()
    modules = dict(model.named_modules())
    for k in np.flatnonzero(union > 0):
        name = info.tensor_names[k]
        result.trained[name] = state[name].detach().numpy().copy()
        if len(channel_union[int(k)]) < info.tensor_channels[k]:
            mask = np.zeros(info.tensor_channels[k], dtype=np.float32)
            mask[channel_union[int(k)]] = 1
            result.channel_masks[name] = mask
    for layer in info.layers:  # norm running statistics travel with a trained norm layer
        if isinstance(modules[layer.name], _NORM_TYPES) and any(union[k] > 0 for k in layer.tensors):
            for buf in ("running_mean", "running_var"):
                result.trained[f"{layer.name}.{buf}"] = state[f"{layer.name}.{buf}"].numpy().copy()
    result.host_wall_s = time.perf_counter() - start
    return result
