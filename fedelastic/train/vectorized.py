"""Vectorised cohort training: many clients trained as one batched model (``torch.func.vmap``).

:func:`train_cohort_vmap` gives each client of a cohort what :func:`fedelastic.train.trainer.train_local`
would give it, started from the same weights, but runs the cohort's steps together: the clients'
parameters are stacked along a new first dimension, one ``vmap(functional_call(...))`` call runs
every client's forward pass on its own batch, and one backward pass of the clients' summed
losses gives every client's own gradient at once. The host side is the same as
``train_local``'s, client by client: the seeded batch order (``seed``, e.g. ``[seed, round, pid]``),
the selections, their pricing on the client's :class:`~fedelastic.cost.costmodel.CostModel`, memory
failures and the reported figures.

* Step ``t`` runs the clients that have a ``t``-th batch (the others are not computed and keep
  their parameters); a short batch is padded with zero-weight samples to its call's widest batch,
  so its loss and gradient are the mean over its valid samples only. On a CPU, where padding costs
  as much as data, a step's clients run in calls of similar batch widths (:func:`by_width`).
* The optimizer is ``train_local``'s, written out on the stacked tensors: SGD with momentum and
  coupled weight decay (torch's formula), or SGDW (decoupled decay), constant or cosine rate.
* Selections are masks: an unselected tensor keeps its value and momentum, and a step
  differentiates only the tensors some client of the step trains (so backprop stops below the
  deepest of them, as in ``train_local``). A channel-sparse tensor (TinyTrain's output channels,
  Sparse Update's input channels, picked by norm on the client's weights when the selection is
  applied: ``train_local``'s ``_Masks``) is masked per element: its other channels keep their
  values and momentum, what ``_Applied.step``'s restore leaves. The ``importance`` probe
  (ElasticTrainer's) and the ``fisher`` probe (TinyTrain's; :class:`_Taps`) run vectorised too, on
  the clients that reselect at a step, on their current weights and batch, piece by piece where
  memory splits it; each client's selection is then taken on the host between steps, as
  ``train_local`` takes it.
* BatchNorm in train mode (``train.bn_mode = "train"``): each client keeps its own norm buffers
  (running statistics, momentum and ``num_batches_tracked``, stacked like its parameters), and a
  norm layer runs on batch statistics for the clients whose selection trains one of its tensors,
  as ``train_local``'s, its statistics taken over the client's valid samples only (``_MaskedNorms``:
  a padded batch's padding is left out). Clients run a step in calls grouped by their norm modes.
  A probe on batch statistics runs in the loop's micro-batches (each its own statistics) and
  leaves the statistics as they were.
* int8 devices' numerics (``train.numerics = "device"``) with QAS, fp32 master weights and fp32
  gradients (the defaults): :class:`~fedelastic.train.quant.BatchedInt8`, each client's activation
  ranges calibrated on its own first batch; int8 and fp32 clients run in separate calls.
* Refused, with an error naming the key: a probe other than these (``train.strategy``),
  active dropout (``model.name``), fp16 numerics
  (``train.numerics``; no shipped profile trains in fp16), and int8 without QAS
  (``train.qas``), with quantised gradients (``train.quantized_gradients``) or device-dtype master
  weights (``train.master_weights``): their optimizer hooks are not written for stacked tensors.

The weights agree with the per-client loop to float32 rounding, not bit for bit: a batched
convolution is a grouped convolution with its own summation order, and the padded loss sums the
same terms in another order (tests/unit/train/test_vectorized.py states the tolerance).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

from ..cost.costmodel import CostModel
from ..data import ArrayDataset
from ..errors import ConfigError
from ..modelinfo import ModelInfo
from ..selection.strategy import Selection, SelectionContext, SelectionStrategy
from .probes import _chunks, fisher_layers
from .quant import BatchedInt8, Numerics
from .trainer import (
    _NORM_TYPES,
    OPTIMIZERS,
    SCHEDULES,
    CohortJob,
    LocalResult,
    Prepared,
    _add_to_union,
    _Masks,
    _set_norm_modes,
    batches,
    carried_selection,
    carry_selection,
    channel_mask,
    flash_shortfall,
    no_step_reason,
    select_and_charge,
    step_cap,
)

#: ``env`` below is a :class:`~fedelastic.environment.RunEnvironment`, untyped here: the environment
#: resolves its training path through this module (an import back would be a cycle).
RunEnvironment = Any

_SOURCE = "<vectorised training>"

#: The strategies' probes the vectorised path runs (None: a strategy without a probe).
PROBES = (None, "importance", "fisher")


def _refuse(key: str, expected: str, got: object, source: str = _SOURCE) -> ConfigError:
    return ConfigError(source, key, f"{expected} (vectorised training)", got)


class _Client:
    """One client's host side, step by step: ``train_local``'s loop without the tensors."""

    def __init__(
        self,
        info: ModelInfo,
        strategy: SelectionStrategy,
        cost: CostModel,
        n: int,
        *,
        epochs: int,
        batch_size: int,
        lr: float,
        max_steps: int,
        seed: int | list[int],
        lr_schedule: str,
        norm_tensors: list[np.ndarray],
        batch_stats: bool,
        prepared: Prepared,
        int8: bool = False,
    ):
        if strategy.probe not in PROBES:
            raise _refuse("train.strategy", f"a strategy without a probe or with one of {PROBES[1:]}", type(strategy).__name__)
        self.info, self.strategy, self.cost = info, strategy, cost
        self.prepared = prepared  # its price cache: a cohort's clients mostly select alike
        self.rng = np.random.default_rng(seed)  # seed_everything's stream; torch's RNG is not used (no dropout)
        self.rng.integers(2**62)
        self.order = list(batches(n, batch_size, epochs, self.rng, max_steps))
        self.result = LocalResult(fits=True, num_examples=n)
        self.union = np.zeros(info.num_tensors)
        self.whole = np.zeros(info.num_tensors, dtype=bool)  # train_local's union of the round's selections
        self.channel_union: dict[int, tuple[int, np.ndarray]] = {}
        # the client's current weights (its slice of the stacked ones): Sparse Update picks input
        # channels by their norm when a selection is applied; set once they are stacked
        self.weights: _Row | None = None
        self.elem: dict[int, torch.Tensor] = {}  # channel-sparse tensors: the trained elements (broadcastable)
        self.losses: list[float] = []
        self.failed = ""
        self.selection: Selection | None = None
        self.ctx: SelectionContext | None = None
        self.step_time = self.step_macs = self.step_compute = 0.0
        self.steps_per_epoch = -(-n // batch_size)
        self.memory = cost.device.memory_train_bytes.value
        self.lr, self.lr_schedule = lr, lr_schedule
        self.kept, self.offset = carried_selection(strategy, info)  # from an earlier round
        self.last: int | None = None  # the step of the last selection made here
        self.note = ""
        # per norm layer of ``info``: does it run on batch statistics (``_Applied``'s rule; all do
        # before the first selection, as ``Prepared.set_norm_modes`` leaves them)
        self.norm_tensors, self.batch_stats = norm_tensors, batch_stats
        self.norms = (batch_stats,) * len(norm_tensors)
        self.int8 = int8

    def since(self, step: int) -> int:
        """Steps run since the last selection, before ``step`` (across rounds for a carried one)."""
        return self.offset + step if self.last is None else step - self.last

    def lr_at(self, step: int) -> float:
        return self.lr * 0.5 * (1 + np.cos(np.pi * step / len(self.order))) if self.lr_schedule == "cosine" else self.lr

    def begin(self, step: int) -> list[tuple[np.ndarray, int]] | None:
        """Before ``step``: None if the selection stands, else the probe's (scope, micro-batch) pieces to run (maybe none)."""
        due = self.strategy.should_reselect(self.since(step), self.steps_per_epoch)
        if self.selection is not None and not due:
            return None
        if self.kept is not None and not due:  # carried from an earlier round: no probe, no selector work
            self._apply(self.kept, self.prepared.prices(self.cost, self.kept)[0])
            return None
        info, cost, result, probe = self.info, self.cost, self.result, self.strategy.probe
        self.ctx = ctx = SelectionContext(info, cost, step, self.rng)
        self.last = step
        if probe is None:
            return []
        ctx.importance, ctx.fisher = np.zeros(info.num_tensors), {}
        scope = self.strategy.probe_scope(ctx)
        if scope is not None and not np.any(scope):  # nothing can be selected: no probe runs
            return []
        pieces = cost.probe_segments(probe, self.memory, scope)
        if not pieces:
            need = cost.probe_memory(probe, 1, np.arange(info.num_tensors) == info.num_tensors - 1)
            result.probe_peak_memory_bytes = max(result.probe_peak_memory_bytes, need.total_bytes)
            result.peak_memory_bytes = max(result.peak_memory_bytes, need.total_bytes)
            self.failed = (
                f"the {probe} probe needs {need.total_bytes:.0f} bytes for one sample of the last tensor; "
                f"the device has {self.memory:.0f}"
            )
            return []
        scopes = []
        for piece, micro in pieces:
            probe_peak = cost.probe_memory(probe, micro, piece).total_bytes
            result.probe_peak_memory_bytes = max(result.probe_peak_memory_bytes, probe_peak)
            result.peak_memory_bytes = max(result.peak_memory_bytes, probe_peak)
            probe_s = cost.probe_time_s(probe, micro, piece)
            result.overhead_time_s += probe_s
            result.probe_time_s += probe_s
            scopes.append((np.ones(info.num_tensors, bool) if piece is None else np.asarray(piece, bool), micro))
        result.probes += 1
        return scopes

    def finish(self) -> None:
        """Select with what the probe put in ``ctx`` (summed over its pieces), price it, check memory."""
        ctx, cost, result, strategy = self.ctx, self.cost, self.result, self.strategy
        assert ctx is not None
        selection, peak = select_and_charge(strategy, ctx, cost, result, self.prepared)
        self.note = ctx.note
        if peak > ctx.memory_budget_bytes:
            why = f" ({self.note})" if self.note else ""
            self.failed = f"the selection needs {peak:.0f} bytes; the device has {self.memory:.0f}{why}"
            return
        short = flash_shortfall(cost, selection)
        if short:
            self.failed = short
            return
        result.selections += 1
        self._apply(selection, peak)

    def _apply(self, selection: Selection, peak: float) -> None:
        """Train ``selection`` from now on (its peak memory already checked)."""
        self.selection = self.kept = selection
        self.result.peak_memory_bytes = max(self.result.peak_memory_bytes, peak)
        weights = self.weights
        assert weights is not None
        masks = _Masks(self.info, weights, selection)  # train_local's channel masks, on the current weights
        _add_to_union(selection, masks, self.union, self.whole, self.channel_union)
        self.elem = {}
        for k, (axis, kept) in masks.masks.items():
            shape = [1] * weights[k].dim()
            shape[axis] = len(kept)
            self.elem[k] = kept.to(weights[k].device).view(shape)
        self.norms = tuple(self.batch_stats and bool(np.any(selection.ratios[k] > 0)) for k in self.norm_tensors)
        _, self.step_time, self.step_macs, self.step_compute = self.prepared.prices(self.cost, selection)

    def group(self) -> tuple:
        """Clients of one key run a step in one call: their norm layers' modes are the same, and
        int8 clients run apart from fp32 ones."""
        return (self.norms, self.int8)

    def trains(self) -> bool:
        return not self.failed and self.selection is not None and bool(self.selection.mask.any())

    def count_step(self, loss: float) -> None:
        self.losses.append(loss)
        self.result.train_time_s += self.step_time
        self.result.macs += self.step_macs
        self.result.compute_time_s += self.step_compute
        self.result.steps += 1


class _Row:
    """Client ``i``'s current weights, by tensor index: views of its slice of the stacked tensors."""

    def __init__(self, stacked: dict[str, torch.Tensor], names: list[str], i: int):
        self.stacked, self.names, self.i = stacked, names, i

    def __getitem__(self, k: int) -> torch.Tensor:
        return self.stacked[self.names[k]][self.i]


class _MaskedNorms:
    """Norm layers on batch statistics of a call's valid samples only (``w > 0``), so that clients
    with batches of different sizes share one padded call: mean and biased variance over the valid
    samples' positions, the running statistics moved as torch's BatchNorm moves them (momentum, or
    a cumulative average with ``momentum=None``; the unbiased variance; ``num_batches_tracked``).
    Torch's own forward runs for a norm layer in eval mode."""

    def __init__(self, model: nn.Module):
        self.modules = [m for m in model.modules() if isinstance(m, _NORM_TYPES)]
        self.w: torch.Tensor | None = None  # inside a call: one client's sample weights

    def _forward(self, m: Any, x: torch.Tensor) -> torch.Tensor:
        if not m.training:
            return type(m).forward(m, x)
        assert self.w is not None
        dims = [0, *range(2, x.dim())]
        # as torch's CPU kernel: statistics accumulated in float64, then y = x * alpha + beta in x's dtype
        xd = x.double()
        wv = (self.w > 0).double().view(-1, *([1] * (x.dim() - 1)))
        n = (wv.sum() * (x[0, 0].numel() if x.dim() > 2 else 1)).clamp_min(1)  # an empty micro-batch: no nan
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean = (xd * wv).sum(dims) / n
        var = ((xd - mean.view(shape)) ** 2 * wv).sum(dims) / n
        if m.track_running_stats:
            m.num_batches_tracked.add_(1)
            mom = 1.0 / m.num_batches_tracked.double() if m.momentum is None else m.momentum
            with torch.no_grad():
                unbiased = var.detach() * n / (n - 1).clamp_min(1)
                m.running_mean.copy_(mom * mean.detach() + (1 - mom) * m.running_mean)
                m.running_var.copy_(mom * unbiased + (1 - mom) * m.running_var)
        invstd = (1 / torch.sqrt(var + m.eps)).to(x.dtype)
        alpha = invstd * m.weight if m.affine else invstd
        beta = (m.bias - mean.to(x.dtype) * alpha) if m.affine else -mean.to(x.dtype) * alpha
        return x * alpha.view(shape) + beta.view(shape)

    @contextmanager
    def installed(self) -> Iterator[None]:
        for m in self.modules:
            m.forward = functools.partial(self._forward, m)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for m in self.modules:
                m.__dict__.pop("forward", None)


class _Taps:
    """The Fisher probe's taps: each scored conv/linear layer's output multiplied by ones, one per
    sample and output channel, that are an input of the batched call. Their gradient is
    ``sum_d a[n, o, d] * dL/da[n, o, d]`` (``fisher_probe``'s inner sum over the channel's
    positions), and the gradient below is unchanged (``a * 1``)."""

    def __init__(self, model: nn.Module, info: ModelInfo):
        modules = dict(model.named_modules())
        self.modules = {li: modules[layer.name] for li, layer in enumerate(info.layers) if layer.kind in ("conv", "linear")}
        self.z: dict[int, torch.Tensor] = {}  # inside a call: one client's ones (samples x channels)

    def loss(self, loss_fn):
        """``loss_fn`` with the ones as a last argument (batched by ``vmap`` like the others)."""

        def tapped(params, bufs_, x, y, w, denom, q, z):
            self.z = z
            return loss_fn(params, bufs_, x, y, w, denom, q)

        return tapped

    def _hook(self, li: int, module: nn.Module, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
        z, ones = self.z[li], [1] * (out.dim() - 2)
        if isinstance(module, nn.modules.conv._ConvNd):  # channels after the samples, then positions
            return out * z.reshape(*z.shape, *ones)
        return out * z.reshape(z.shape[0], *ones, z.shape[1])  # a linear's channels come last

    @contextmanager
    def on(self, layers: Mapping[int, Any]) -> Iterator[None]:
        """Taps on ``layers`` inside the block."""
        handles = [self.modules[li].register_forward_hook(functools.partial(self._hook, li)) for li in layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self.z = {}


#: Pooling layers :func:`grouped_forward` runs on the grouped ``[samples, clients x channels, H, W]`` layout (before ``Flatten`` only).
_POOLS = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
#: Leaf modules :func:`grouped_forward` runs on the clients' stacked activations as they are (elementwise, or per channel).
_AS_IS = (nn.ReLU, nn.ReLU6, nn.Identity, nn.Dropout, *_POOLS)


def grouped_plan(model: nn.Module, sample_dims: int) -> list[tuple[str, nn.Module]] | None:
    """The leaves of ``model`` if :func:`grouped_forward` runs it on samples of ``sample_dims`` dimensions, else None.

    Covered: a plain ``nn.Sequential`` (nested ones too) of ``Conv2d`` (zero padding), ``Linear`` after
    ``Flatten``, and the activations and pooling of ``_AS_IS``, no hooks, no custom ``forward``; the
    rest (norm layers among it) runs under ``vmap``. Call it before any forward is patched (int8, norms).
    """
    leaves: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, m: nn.Module) -> bool:
        if m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__:
            return False
        if isinstance(m, nn.Sequential):
            same = type(m).forward is nn.Sequential.forward
            return same and all(walk(f"{prefix}{k}.", c) for k, c in m.named_children())
        leaves.append((prefix[:-1], m))
        return True

    if sample_dims not in (1, 3) or not walk("", model):
        return None
    conv = sample_dims == 3  # [C, H, W] samples: the grouped layout until Flatten
    for _, m in leaves:
        if isinstance(m, nn.Flatten) and m.start_dim == 1 and m.end_dim == -1:
            conv = False
        elif not (
            (isinstance(m, nn.Conv2d) and conv and m.padding_mode == "zeros")
            or (isinstance(m, nn.Linear) and not conv)
            or (isinstance(m, _AS_IS) and (conv or not isinstance(m, _POOLS)) and not getattr(m, "return_indices", False))
        ):
            return None
    return None if conv else leaves  # the logits must come out as [clients, samples, classes]


#: Positions (H x W) from which a grouped convolution runs channels-last (``grouped_forward``): on a CPU
#: (torch 2.13, oneDNN, 1 thread; the peers CNN's layers, 35 clients x 8 samples; ``python
#: benchmarks/vmap_round.py --layers``) forward + weight + input gradient took 0.3-0.8x the CPU of the
#: default layout at 8x8 (the max pooling after it 0.4x) and 1.4x at 4x4 (its gradients 2x).
CHANNELS_LAST = 64


def grouped_forward(leaves: list[tuple[str, nn.Module]], params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The clients' logits ``[clients, samples, classes]`` from their samples ``x`` (``[clients, samples, *sample]``)
    and stacked ``params``, through ``leaves`` (:func:`grouped_plan`) without ``vmap``.

    ``vmap`` turns a client-batched convolution into one grouped convolution anyway, but each of its
    calls pays its dispatch (several ms a step call on a CPU: more than a small call's compute). Here
    the activations are ``[samples, clients x channels, H, W]`` through the convolutions (each one
    convolution of ``clients x groups`` groups, as ``vmap``'s) and ``[clients, samples, features]``
    after ``Flatten`` (each linear one ``baddbmm``): per client, the model's own operations.
    """
    b, n = x.shape[:2]
    h = x.transpose(0, 1).reshape(n, -1, *x.shape[3:]) if x.dim() == 5 else x
    for name, m in leaves:
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            w, bias = params[f"{name}.weight"], params.get(f"{name}.bias")
            if isinstance(m, nn.Linear):
                wt = w.transpose(1, 2)
                h = torch.bmm(h, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), h, wt)
            else:
                h = h.contiguous(memory_format=torch.channels_last if h[0, 0].numel() >= CHANNELS_LAST else torch.contiguous_format)
                bias = None if bias is None else bias.reshape(-1)
                h = F.conv2d(h, w.reshape(-1, *w.shape[2:]), bias, m.stride, m.padding, m.dilation, b * m.groups)
        elif isinstance(m, nn.Flatten):
            h = h.reshape(n, b, -1).transpose(0, 1) if h.dim() == 4 else h
        else:
            h = m(h)
    return h


def cross_entropy_terms(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``cross_entropy(logits, y, reduction="none")``: the same values, written as log-softmax and a gather.

    Under ``vmap``, torch's ``nll_loss`` runs a Python decomposition whose first call imports
    sympy and torch's symbolic shapes (~480 modules, 0.7 s of CPU: most of a vectorised run's
    first round); log-softmax and gather have batching rules of their own.
    """
    return -torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def _check_numerics(nm: Numerics | None, source: str = _SOURCE, device: str = "") -> None:
    """Refuse what :class:`~fedelastic.train.quant.BatchedInt8` does not emulate, naming the key."""
    if nm is None or nm.dtype == "fp32":
        return
    on = f" (device {device} trains in {nm.dtype})" if device else ""
    if nm.dtype != "int8":
        raise _refuse("train.numerics", f'"fp32" or int8 devices{on}', "device", source)
    for key, value, default in (
        ("train.qas", nm.qas, True),
        ("train.quantized_gradients", nm.quantized_gradients, False),
        ("train.master_weights", nm.master_weights, "fp32"),
    ):
        if value != default:
            raise _refuse(key, f"{default!r} for int8 devices{on}", value, source)


def _check_model(model: nn.Module) -> None:
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            raise _refuse("model.name", "a model without active dropout", f"{name}: {type(m).__name__}(p={m.p})")


#: A vectorised step call's fixed cost, in padded samples: on a CPU a call over ``B`` clients padded to
#: ``W`` samples costs about ``c0 + a x B x W`` of CPU (the peers' CNN, 1 thread; ``python
#: benchmarks/vmap_width.py``, benchmarks/studies/throughput.md): c0 / a measured 80 and 123 on a loaded
#: host. The split it drives is coarse (a handful of widths), so the constant need not be exact.
CALL_SAMPLES = 80


def by_width(rows: list[int], width: np.ndarray, dev: torch.device) -> list[list[int]]:
    """Clients ``rows`` split into step calls by their batch widths (``width[i]``), to pad less.

    A call pads every client to its widest batch; on a CPU padding costs as much as real samples,
    so clients of similar widths run together: the split of the widths (sorted) that minimises
    ``sum(CALL_SAMPLES + clients x widest)`` over the calls. On an accelerator padding is nearly
    free and each call costs a launch: one call.
    """
    w = width[rows]
    values = np.unique(w)
    if dev.type != "cpu" or len(values) < 2:
        return [rows]
    upto = np.searchsorted(np.sort(w), values, side="right").tolist()  # clients of width <= values[k]
    best, cut = [0.0], []  # best[k + 1]: least cost of the clients of width <= values[k]; cut[k]: its last call's first width
    for k, top in enumerate(values.tolist()):
        options = [best[j] + CALL_SAMPLES + (upto[k] - (upto[j - 1] if j else 0)) * top for j in range(k + 1)]
        j = int(np.argmin(options))
        best.append(options[j])
        cut.append(j)
    bounds, k = [], len(values) - 1
    while k >= 0:
        bounds.append(values[cut[k]])
        k = cut[k] - 1
    bounds.sort()
    calls: list[list[int]] = [[] for _ in bounds]
    for i, wi in zip(rows, w.tolist()):
        calls[int(np.searchsorted(bounds, wi, side="right")) - 1].append(i)
    return calls


def _ordered_samples(
    datasets: list[ArrayDataset], orders: list[list[np.ndarray]], dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Every client's samples, one client after another, and a zero sample (label 0) last: (x, y,
    index, widths), where client ``i``'s step ``t`` takes the samples ``index[i, t, :widths[i, t]]``
    (the rest of the row points at the zero sample; width 0: no such step). A step's padded batch is
    then one gather, and each sample is held once whatever the epochs."""
    horizon = max((len(o) for o in orders), default=0)
    widest = max((len(b) for o in orders for b in o), default=0)
    total = sum(len(d) for d in datasets)
    index = np.full((len(orders), horizon, widest), total, np.int64)
    widths = np.zeros((len(orders), horizon), np.int64)
    at = 0
    for i, (d, order) in enumerate(zip(datasets, orders)):
        for t, b in enumerate(order):
            index[i, t, : len(b)] = at + b
            widths[i, t] = len(b)
        at += len(d)
    x0, y0 = np.asarray(datasets[0].x), np.asarray(datasets[0].y)
    xs = np.concatenate([*(np.asarray(d.x) for d in datasets), np.zeros((1, *x0.shape[1:]), x0.dtype)])
    ys = np.concatenate([*(np.asarray(d.y) for d in datasets), np.zeros(1, y0.dtype)])
    return torch.from_numpy(xs).to(dev), torch.from_numpy(ys).to(dev), index, widths


def train_cohort_vmap(
    model: nn.Module,
    info: ModelInfo,
    strategies: list[SelectionStrategy],
    costs: list[CostModel],
    datasets: list[ArrayDataset],
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    max_steps: list[int] | int = 0,
    seeds: list[int | list[int]],
    bn_mode: str = "frozen",
    optimizer: str = "sgd",
    lr_schedule: str = "constant",
    numerics: list | None = None,
) -> list[LocalResult]:
    """Train every client ``i`` from ``model``'s weights on ``datasets[i]`` (see the module doc).

    The arguments are ``train_local``'s, one entry per client in ``strategies``, ``costs``,
    ``datasets``, ``seeds`` (and ``max_steps`` if a list). ``model`` is left unchanged; it sets
    the device and dtype of the computation. Returns one :class:`LocalResult` per client, as
    ``train_local`` would; ``host_wall_s`` is the cohort's wall time shared out by steps.
    """
    start = time.perf_counter()
    n_clients = len(datasets)
    if not (len(strategies) == len(costs) == len(seeds) == n_clients):
        raise ValueError("strategies, costs, datasets and seeds need one entry per client")
    if not n_clients:
        return []
    caps = max_steps if isinstance(max_steps, list) else [max_steps] * n_clients
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {optimizer!r}")
    if lr_schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule: expected one of {SCHEDULES}, got {lr_schedule!r}")
    numerics = numerics or [None] * n_clients
    for nm in numerics:
        _check_numerics(nm)
    for cost in costs:
        if bn_mode != cost.bn_mode:
            raise ValueError(f"bn_mode {bn_mode!r} differs from the cost model's {cost.bn_mode!r}")
    _check_model(model)
    modules = dict(model.named_modules())
    norm_layers = [layer for layer in info.layers if isinstance(modules[layer.name], _NORM_TYPES)]
    norm_tensors = [np.asarray(layer.tensors, np.int64) for layer in norm_layers]
    batch_stats = bn_mode == "train" and any(isinstance(m, _NORM_TYPES) for m in model.modules())
    prepared = Prepared(model, info)
    clients = [
        _Client(
            info,
            s,
            c,
            len(d),
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            max_steps=cap,
            seed=seed,
            lr_schedule=lr_schedule,
            norm_tensors=norm_tensors,
            batch_stats=batch_stats,
            prepared=prepared,
            int8=nm is not None and nm.dtype == "int8",
        )
        for s, c, d, cap, seed, nm in zip(strategies, costs, datasets, caps, seeds, numerics)
    ]
    int8 = BatchedInt8(model, info, n_clients)
    masked = _MaskedNorms(model)
    _set_norm_modes(model, bn_mode)
    names = list(info.tensor_names)
    given = dict(model.named_parameters())
    dev = given[names[0]].device

    def per_client(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach().unsqueeze(0).repeat(n_clients, *([1] * v.dim())).contiguous() for k, v in tensors.items()}

    stacked = per_client(given)
    for i, c in enumerate(clients):
        c.weights = _Row(stacked, names, i)
    bufs = {k: torch.zeros_like(v) for k, v in stacked.items()} if momentum > 0 else {}
    # norm statistics: each client's own when its norm layers run on batch statistics, else shared
    buffers = dict(model.named_buffers())
    buffers = per_client(buffers) if batch_stats else {k: v.detach() for k, v in buffers.items()}
    xs, ys, index, widths = _ordered_samples(datasets, [c.order for c in clients], dev)

    def loss_fn(params, bufs_, x, y, w, denom, q):
        int8.call(q, w)
        masked.w = w
        out = functional_call(model, (params, bufs_), (x,))
        return (cross_entropy_terms(out, y) * w).sum() / denom, int8.out

    batched_loss = vmap(loss_fn, in_dims=(0, 0 if batch_stats else None, 0, 0, 0, 0, 0))
    plan = grouped_plan(model, xs.dim() - 1)  # before int8 and the norms patch the modules' forward

    def grouped_loss(params, bufs_, x, y, w, denom, q):
        """``batched_loss`` without ``vmap`` (:func:`grouped_forward`), for fp32 calls of a model it covers."""
        return (cross_entropy_terms(grouped_forward(plan, params, x), y) * w).sum(1) / denom, {}

    def step_fn(params, bufs_, x, y, w, sel, trained=None, denom=None):
        """Every client's (gradients, loss); gradients of the ``trained`` tensors only (default all).

        One batched forward pass (vmap over the clients), then one backward pass of the sum of the
        clients' losses: a client's loss depends on its own slice of the stacked parameters only, so
        the gradient of the sum is every client's own gradient. Autograd computes only what leads to
        the ``trained`` tensors (it stops below the deepest of them, skipping the others' dW). A
        norm layer in train mode updates ``bufs_`` (the clients' own statistics) in place; int8
        clients (``sel``) keep the activation quantisation their first forward calibrated."""
        keep = {k: v.detach().requires_grad_() for k, v in params.items() if trained is None or k in trained}
        with torch.enable_grad():
            denom = w.sum(1) if denom is None else denom
            loss = grouped_loss if plan is not None and not int8.on else batched_loss
            losses, used = loss({**params, **keep}, bufs_, x, y, w, denom, int8.state(sel))
            grads = torch.autograd.grad(losses.sum(), list(keep.values()))
        int8.update(sel, used)
        return dict(zip(keep, grads)), losses.detach()

    def set_modes(norms: tuple, in_int8: bool) -> None:
        """The norm layers' modes of a call's clients (``_Applied``'s, per client), and their numerics."""
        for layer, on in zip(norm_layers, norms):
            modules[layer.name].training = on
        int8.on = in_int8

    def rows_buffers(sel: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The buffers of a call over clients ``sel`` (all: None): their own copies if per client."""
        if not batch_stats:
            return buffers
        return buffers if sel is None else {k: v[sel] for k, v in buffers.items()}

    def batch(rows: list[int], t: int):
        """Step ``t``'s batches of clients ``rows``, padded with zero-weight samples to the widest:
        one gather from the clients' samples in batch order (padding reads the zero sample at the end)."""
        n = widths[rows, t]
        idx = torch.from_numpy(index[rows, t, : int(n.max())]).to(dev)
        valid = np.arange(idx.shape[1]) < n[:, None]
        return xs[idx], ys[idx], torch.from_numpy(valid.astype(np.float32)).to(dev)

    def sgd(p, g, buf, lr_t, on):
        """One optimizer step of a stacked tensor, for the clients where ``on`` (None: all): (new values, new momentum)."""
        shape = (-1,) + (1,) * (p.dim() - 1)
        lr_col = lr_t.to(p.dtype).to(dev).view(shape)
        if optimizer == "sgdw" and weight_decay:
            new_p = p * (1 - lr_t * weight_decay).to(p.dtype).to(dev).view(shape)
        else:
            new_p = p
            if weight_decay:
                g = g + weight_decay * p
        new_buf = None
        if momentum > 0:
            new_buf = buf * momentum + g
            g = new_buf
        if on is None:
            return new_p - lr_col * g, new_buf
        keep = on.view(shape) if on.dim() == 1 else on  # per client, or per element (channel-sparse)
        new_p = torch.where(keep, new_p - lr_col * g, p)
        return new_p, None if new_buf is None else torch.where(keep, new_buf, buf)

    def probe(rows: list[int], scopes: np.ndarray, micro: int, t: int) -> np.ndarray:
        """``importance_probe`` of clients ``rows`` on step ``t``'s batch, each over its scope.

        On batch statistics the batch runs in ``importance_probe``'s micro-batches (each its own
        statistics; the clients' statistics are left as they were), and in int8 too (the first
        calibrates); else it runs whole (the same gradient)."""
        sel = torch.as_tensor(rows, device=dev)
        params = {k: v[sel] for k, v in stacked.items()}
        x, y, w = batch(rows, t)
        parts = _chunks(x.shape[1], micro) if any(clients[rows[0]].norms) or int8.on else [slice(None)]
        denom = w.sum(1)
        lr_t = torch.tensor([clients[i].lr_at(t) for i in rows], dtype=torch.float64)
        on = torch.as_tensor(scopes, device=dev)
        scope = {names[k] for k in np.flatnonzero(scopes.any(0))}

        def grads_at(at: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            total: dict[str, torch.Tensor] = {}
            for part in parts:  # accumulated as the loop's backward over micro-batches
                g, _ = step_fn(at, rows_buffers(sel), x[:, part], y[:, part], w[:, part], sel, scope, denom)
                total = g if not total else {k: total[k] + g[k] for k in g}
            return total

        with torch.no_grad():  # the grad transform differentiates all the same; nothing else records a graph
            grads = grads_at(params)
            moved = dict(params)
            for k, name in enumerate(names):
                if name in scope:
                    moved[name] = sgd(params[name], grads[name], bufs[name][sel] if bufs else None, lr_t, on[:, k])[0]
            grads2 = grads_at(moved)
            zero = torch.zeros(len(rows), device=dev)
            sums = [-(grads2[n] * (moved[n] - params[n])).flatten(1).sum(1) if n in scope else zero for n in names]
        return torch.where(on, torch.stack(sums, 1), 0).double().cpu().numpy()

    taps = _Taps(model, info)
    tapped_loss = vmap(taps.loss(loss_fn), in_dims=(0, 0 if batch_stats else None, 0, 0, 0, 0, 0, 0))

    def fisher(rows: list[int], scopes: np.ndarray, micro: int, t: int) -> list[dict[int, np.ndarray]]:
        """``fisher_probe`` of clients ``rows`` on step ``t``'s batch, each over its scope.

        Each scored layer's output is multiplied by ones (``_Taps``), whose gradient is the sum over
        the layer's positions of ``a * dL/da`` per sample and channel; in micro-batches as ``probe``."""
        sel = torch.as_tensor(rows, device=dev)
        params = {k: v[sel] for k, v in stacked.items()}
        x, y, w = batch(rows, t)
        parts = _chunks(x.shape[1], micro) if any(clients[rows[0]].norms) or int8.on else [slice(None)]
        denom = w.sum(1)
        layers = [fisher_layers(info, scope) for scope in scopes]
        scored = sorted(set().union(*layers))
        sums = {li: torch.zeros(len(rows), info.layers[li].out_channels, dtype=torch.float64, device=dev) for li in scored}
        with torch.no_grad():
            for part in parts:
                width = x[:, part].shape[1]
                ones = {li: torch.ones(len(rows), width, info.layers[li].out_channels, device=dev, requires_grad=True) for li in scored}
                with taps.on(ones), torch.enable_grad():
                    q = int8.state(sel)
                    losses, used = tapped_loss(params, rows_buffers(sel), x[:, part], y[:, part], w[:, part], denom, q, ones)
                    grads = torch.autograd.grad(losses.sum(), list(ones.values()), allow_unused=True)
                int8.update(sel, used)
                for li, g in zip(ones, grads):
                    if g is None:  # a layer the forward did not run: no score, as fisher_probe's
                        sums.pop(li, None)
                    elif li in sums:
                        sums[li] += (g.double() ** 2).sum(1)
        sizes = [len(clients[i].order[t]) for i in rows]
        return [
            {li: (sums[li][r] / (2 * n)).cpu().numpy() for li in mine if li in sums}
            for r, (mine, n) in enumerate(zip(layers, sizes))
        ]

    def grouped(keyed: dict[int, tuple]) -> list[tuple[tuple, list[int]]]:
        """Clients split into calls: those of one key run together (``_Client.group``)."""
        out: dict[tuple, list[int]] = {}
        for i, key in keyed.items():
            out.setdefault(key, []).append(i)
        return list(out.items())

    with int8.installed(), masked.installed():  # int8 only in calls of int8 clients
        horizon = max((len(c.order) for c in clients), default=0)
        for t in range(horizon):
            active = [i for i, c in enumerate(clients) if t < len(c.order) and not c.failed]
            pending = {i: pieces for i in active if (pieces := clients[i].begin(t)) is not None}
            probing = [i for i, pieces in pending.items() if pieces and not clients[i].failed]
            for j in range(max((len(pending[i]) for i in probing), default=0)):  # a memory-split probe: piece by piece
                at_j = [i for i in probing if len(pending[i]) > j]
                keys = {
                    i: (*clients[i].group(), pending[i][j][1] * (any(clients[i].norms) or clients[i].int8), clients[i].strategy.probe)
                    for i in at_j
                }  # fmt: skip
                for (norms, in_int8, micro, kind), rows in grouped(keys):
                    set_modes(norms, in_int8)
                    scopes = np.stack([pending[i][j][0] for i in rows])
                    if kind == "fisher":
                        for i, scores in zip(rows, fisher(rows, scopes, micro, t)):
                            clients[i].ctx.fisher.update(scores)  # type: ignore[union-attr]
                    else:
                        for i, imp in zip(rows, probe(rows, scopes, micro, t)):
                            clients[i].ctx.importance += imp  # type: ignore[union-attr,operator]
            for i in pending:
                if not clients[i].failed:
                    clients[i].finish()
            for (norms, in_int8), group in grouped({i: clients[i].group() for i in active if clients[i].trains()}):
                set_modes(norms, in_int8)
                for rows in by_width(group, widths[:, t], dev):
                    every = len(rows) == n_clients
                    sel = torch.as_tensor(rows, device=dev)
                    x, y, w = batch(rows, t)
                    params = stacked if every else {k: v[sel] for k, v in stacked.items()}
                    masks_np = np.stack([clients[i].selection.mask for i in rows])  # type: ignore[union-attr]
                    stats = rows_buffers(None if every else sel)
                    grads, losses = step_fn(params, stats, x, y, w, sel, {names[k] for k in np.flatnonzero(masks_np.any(0))})
                    lr_t = torch.tensor([clients[i].lr_at(t) for i in rows], dtype=torch.float64)
                    masks = torch.as_tensor(masks_np, device=dev)
                    sparse = set().union(*(clients[i].elem for i in rows))  # the tensors some client trains in part
                    with torch.no_grad():
                        if batch_stats and not every:  # the clients' statistics this step moved
                            for stat, v in stats.items():
                                buffers[stat][sel] = v
                        for k, name in enumerate(names):
                            if not masks_np[:, k].any():
                                continue
                            if k in sparse:  # channel-sparse for some: a mask per element
                                shape = params[name].shape[1:]
                                on = torch.stack([clients[i].elem.get(k, masks[r, k]).expand(shape) for r, i in enumerate(rows)])
                            else:
                                on = None if masks_np[:, k].all() else masks[:, k]
                            buf = (bufs[name] if every else bufs[name][sel]) if bufs else None
                            new_p, new_buf = sgd(params[name], grads[name], buf, lr_t, on)
                            if every:
                                stacked[name].copy_(new_p)
                                if new_buf is not None:
                                    bufs[name].copy_(new_buf)
                            else:
                                stacked[name][sel] = new_p
                                if new_buf is not None:
                                    bufs[name][sel] = new_buf
                    for i, loss in zip(rows, losses.tolist()):
                        clients[i].count_step(loss)

    wall = time.perf_counter() - start
    total_steps = max(1, sum(c.result.steps for c in clients))
    final = {name: stacked[name].detach().cpu().numpy() for name in names}  # each client's row: a view
    results = []
    for i, c in enumerate(clients):
        r = c.result
        r.train_time_s += r.overhead_time_s
        r.train_loss = float(np.mean(c.losses)) if c.losses else float("nan")
        r.host_wall_s = wall * r.steps / total_steps
        if c.failed:
            r.fits, r.reason = False, c.failed
        else:
            r.ratios = c.union
            r.trained = {names[k]: final[names[k]][i] for k in np.flatnonzero(c.union > 0)}
            for k in np.flatnonzero(c.union > 0):
                mask = None if c.whole[k] else channel_mask(stacked[names[k]].shape[1:], *c.channel_union[k])
                if mask is not None:
                    r.channel_masks[names[k]] = mask
            if batch_stats:  # norm running statistics travel with a trained norm layer, as train_local's
                for layer, tensors in zip(norm_layers, norm_tensors):
                    if np.any(c.union[tensors] > 0):
                        for stat in ("running_mean", "running_var"):
                            r.trained[f"{layer.name}.{stat}"] = buffers[f"{layer.name}.{stat}"][i].cpu().numpy().copy()
            carry_selection(c.strategy, None if c.note else c.kept, c.since(len(c.order)))
            if not r.steps and c.order:
                r.reason = no_step_reason(c.strategy, c.note)
        results.append(r)
    return results


#: Forward MACs a sample above which ``vectorize = "auto"`` keeps the per-client loop: on a CPU a
#: batched convolution (a grouped one) loses to separate ones as the model grows. Measured with
#: the shipped scenarios' training (small_cnn, BatchNorm on batch statistics, an int8 share; one
#: step a client, batch 16; benchmarks/studies/vectorised.md, "Where vectorising stops paying"):
#: 2.27x the loop's CPU at 39k MACs, 1.74x at 152k, 1.21x at 600k, 0.61x at 2.4M (crossover near
#: 0.9M); a model without norm layers in fp32 gains longer (1.3x at 1.2M, 0.83x at 4.8M).
AUTO_MAX_MACS = 800_000


def choose_path(env: RunEnvironment) -> tuple[bool, str]:
    """(train vectorised?, why): ``simulation.vectorize`` resolved for ``env``'s run.

    ``true`` is checked (:func:`check_vectorizable` raises, naming the key); ``"auto"`` takes the
    vectorised path where it is eligible and its model is small enough to gain (:data:`AUTO_MAX_MACS`),
    else the per-client loop, and says which key kept it there.
    """
    from ..sim.aggregators import proximal_mu

    sim = env.scenario.simulation
    if sim.vectorize is False:
        return False, "per-client: simulation.vectorize = false"
    if sim.vectorize is True:
        check_vectorizable(env)
        return True, "vectorised: simulation.vectorize = true"
    if sim.node_mode != "cohort":
        return False, f'per-client: simulation.node_mode = "{sim.node_mode}" (vectorising needs cohorts)'
    if proximal_mu(env.scenario) > 0:
        return False, "per-client: server.aggregator = fedprox (the vectorised step has no proximal term)"
    try:
        check_vectorizable(env)
    except ConfigError as exc:
        need = exc.expected.removesuffix(" (vectorised training)")
        return False, f"per-client: {exc.key} (vectorised training needs {need}, got {exc.got!r})"
    macs = env.info.hooked_macs
    if macs > AUTO_MAX_MACS:
        return False, f"per-client: the model's {macs:,} MACs a sample exceed {AUTO_MAX_MACS:,} (batched steps lose on a CPU)"
    return True, f'vectorised: simulation.vectorize = "auto", eligible and {macs:,} MACs a sample (<= {AUTO_MAX_MACS:,})'


def check_vectorizable(env: RunEnvironment) -> None:
    """Raise :class:`ConfigError` (naming the scenario file and key) if ``env``'s scenario cannot
    be trained vectorised: what :func:`train_cohort_vmap` refuses, checked before any training."""
    from .quant import device_numerics

    src = env.scenario.source or "<scenario>"
    t = env.scenario.train
    if env.strategy().probe not in PROBES:
        raise _refuse("train.strategy", f"a strategy without a probe or with one of {PROBES[1:]}", t.strategy, src)
    for device in sorted(set(env.devices)):
        _check_numerics(device_numerics(t, env.profile(device).train_dtype), src, device)
    try:
        _check_model(env.new_model())
    except ConfigError as exc:
        raise _refuse(exc.key, exc.expected.removesuffix(" (vectorised training)"), exc.got, src) from None


def train_partitions_vmap(env: RunEnvironment, model: nn.Module, jobs: list[CohortJob]) -> list[LocalResult]:
    """:func:`fedelastic.fl.client.train_partition` for a cohort of jobs, in one vectorised call.

    Each job gets the scenario's training settings, its device's cost model and numerics, its
    partition's data of that round and the seed ``[seed, round, pid]``, as ``train_partition``
    gives them; all start from ``model``'s weights (the global model), which stay unchanged.
    """
    from .quant import device_numerics

    t = env.scenario.train
    caps = [step_cap(t.max_steps, j.max_steps) for j in jobs]
    return train_cohort_vmap(
        model,
        env.info,
        [j.strategy for j in jobs],
        [env.cost(env.devices[j.pid]) for j in jobs],
        [env.client_data(j.pid, j.server_round) for j in jobs],
        epochs=t.local_epochs,
        batch_size=t.batch_size,
        lr=t.lr,
        momentum=t.momentum,
        weight_decay=t.weight_decay,
        max_steps=caps,
        seeds=[[env.scenario.seed, j.server_round, j.pid] for j in jobs],
        bn_mode=env.bn_mode,
        optimizer=t.optimizer,
        lr_schedule=t.lr_schedule,
        numerics=[device_numerics(t, env.profile(env.devices[j.pid]).train_dtype) for j in jobs],
    )
