"""TinyTrain (Kwon et al., ICML 2024): task-adaptive channel-sparse update under memory and compute budgets.

The trainer runs the ``fisher`` probe: ``ctx.fisher[layer]`` is the Fisher potential
``delta_o = 1/(2N) sum_n (sum_d a[n,o,d] g[n,o,d])^2`` of every output channel ``o`` of each
conv/linear layer.

Scores
------
``P_i = sum_o delta_o`` and ``s_i = P_i / ((params_i / max params) * (MACs_i / max MACs))``, with
``params_i`` the layer's parameter count (weight and bias) and ``MACs_i`` its forward MACs per
sample, maxima over the scored layers.

Fill rule (greedy; TinyTrain does not publish its exact rule)
-------------------------------------------------------------
Layers are visited once, by ``s_i`` descending (ties: the layer nearer the output first). Each
visited layer gets its top-``c`` output channels by ``delta_o`` (weight rows and the matching
bias entries), with ``c`` the largest count for which the whole selection so far still meets
**both** budgets:

* memory: ``cost.peak_memory_bytes(ratios) <= memory_fraction * device memory`` (weights, saved
  activations of the trained channels and of the ops above the deepest trained layer, gradients,
  optimizer state, workspace: :meth:`CostModel.memory`);
* compute: the backward work of the selection is at most ``compute_fraction`` of full training's
  backward work, measured as backward MACs (``compute_metric = "macs"``, default, the unit the
  paper reports: dX MACs of the layers above the deepest trained one plus the trained channels'
  dW MACs) or as emulated backward time (``"time"``, :meth:`CostModel.backward_time_s`).

``c`` ranges over every count from 1 to the layer's channels (found by bisection: both budgets
grow monotonically with ``c`` once the layer is in), or, if ``channel_ratios`` is given, over
``ceil(r * channels)`` for those ratios. A layer where not even the smallest count fits is
skipped and the visit goes on, so a cheaper layer further down the ranking can still use what is
left. The update is really channel-sparse: the selection lists channel indices and the trainer
keeps every other channel (and its optimizer state) exactly unchanged.

TinyTrain selects once per task: ``interval = 0`` (default) keeps the first selection for the
whole local training; ``interval > 0`` re-probes and re-selects every ``interval`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedelastic.config import check, field
from fedelastic.selection.strategy import Selection, SelectionContext, SelectionStrategy, register


@dataclass(frozen=True)
class TinyTrainConfig:
    """Options of :class:`TinyTrain`."""

    memory_fraction: float = field(1.0, help="fraction of the device's training memory the update may use, in (0, 1]")
    compute_fraction: float = field(
        0.3, help="backward work budget as a fraction of full training's backward work, in (0, 1]"
    )
    compute_metric: Literal["macs", "time"] = field(
        "macs", help="how backward work is measured: 'macs' (dX + dW MACs, as in the paper) or 'time' (emulated)"
    )
    channel_ratios: tuple[float, ...] = field(
        (), help="allowed fractions of a layer's output channels, each in (0, 1]; empty: any number of top channels"
    )
    interval: int = field(0, help="steps between re-probing and re-selecting; 0 selects once (TinyTrain's default)")

    def __post_init__(self) -> None:
        check(0 < self.memory_fraction <= 1, "memory_fraction", "a number in (0, 1]")
        check(0 < self.compute_fraction <= 1, "compute_fraction", "a number in (0, 1]")
        check(self.compute_metric in ("macs", "time"), "compute_metric", "one of ['macs', 'time']")
        check(all(0 < r <= 1 for r in self.channel_ratios), "channel_ratios", "a list of numbers in (0, 1]")
        check(isinstance(self.interval, int) and self.interval >= 0, "interval", "an integer >= 0")


def layer_scores(ctx: SelectionContext, fisher: dict[int, np.ndarray]) -> dict[int, float]:
    """TinyTrain's multi-objective score ``s_i`` of every conv/linear layer in ``fisher``."""
    info = ctx.info
    layers = [li for li in sorted(fisher) if info.layers[li].kind in ("conv", "linear")]
    params = {li: float(sum(info.tensor_numel[k] for k in info.layers[li].tensors)) for li in layers}
    macs = {li: float(info.layers[li].macs) for li in layers}
    max_params = max(params.values(), default=0.0)
    max_macs = max(macs.values(), default=0.0)
    scores = {}
    for li in layers:
        if params[li] <= 0 or macs[li] <= 0:
            continue
        denom = (params[li] / max_params) * (macs[li] / max_macs)
        scores[li] = float(np.sum(fisher[li])) / denom
    return scores


def _with_channels(ratios: np.ndarray, tensors: list[int], fraction: float) -> np.ndarray:
    """A copy of ``ratios`` with ``tensors`` trained at ``fraction`` of their channels."""
    out = ratios.copy()
    out[tensors] = fraction
    return out


@register
class TinyTrain(SelectionStrategy):
    """TinyTrain: top Fisher channels of the best-scored layers within memory and compute budgets."""

    name = "tinytrain"
    config_cls = TinyTrainConfig
    probe = "fisher"
    respects_memory = True  # shrinks its selection to ctx.memory_budget_bytes (contract tests)

    def should_reselect(self, step: int, steps_per_epoch: int = 0) -> bool:
        interval = self.config.interval
        return interval > 0 and step > 0 and step % interval == 0

    def carries_selection(self) -> bool:
        """With an interval, it runs across local trainings; ``interval = 0`` selects at the start of each."""
        return self.config.interval > 0

    def probe_scope(self, ctx: SelectionContext) -> np.ndarray | None:
        """None (every layer) unless not even the smallest channel share of any layer fits the
        budgets: then no probe runs, and ``ctx.note`` says why, with the figures."""
        ctx.note = self._nothing_fits(ctx)
        return np.zeros(ctx.info.num_tensors, dtype=bool) if ctx.note else None

    def _budgets(self, ctx: SelectionContext):
        """(memory budget in bytes, backward work of a selection, compute budget in that work's unit)."""
        cfg, info, cost = self.config, ctx.info, ctx.cost
        if cfg.compute_metric == "macs":
            fwd_macs = cost.step_macs(np.zeros(info.num_tensors))

            def work(r: np.ndarray) -> float:
                return cost.step_macs(r) - fwd_macs
        else:

            def work(r: np.ndarray) -> float:
                return cost.backward_time_s(r)

        return cfg.memory_fraction * ctx.memory_budget_bytes, work, cfg.compute_fraction * work(np.ones(info.num_tensors))

    def _nothing_fits(self, ctx: SelectionContext) -> str:
        """Why no layer can train even its smallest channel share within both budgets; "" if one can."""
        info, cost, device = ctx.info, ctx.cost, ctx.cost.device.name
        memory_budget, work, compute_budget = self._budgets(ctx)
        forward = cost.peak_memory_bytes(np.zeros(info.num_tensors))
        if forward > memory_budget:
            return f"the forward pass alone needs {forward:.0f} bytes on device {device!r}; the budget is {memory_budget:.0f}"
        need_memory = need_work = np.inf
        for layer in reversed(info.layers):  # from the output: the layers that need least
            tensors = [k for k in layer.tensors if info.tensor_roles[k] in ("weight", "bias")]
            if layer.kind not in ("conv", "linear") or not tensors:
                continue
            num = int(info.tensor_channels[tensors[0]])
            smallest = min((max(1, math.ceil(r * num)) for r in self.config.channel_ratios), default=1)
            r = _with_channels(np.zeros(info.num_tensors), tensors, min(smallest, num) / num)
            memory, done = cost.peak_memory_bytes(r), work(r)
            if memory <= memory_budget and done <= compute_budget:
                return ""
            need_memory, need_work = min(need_memory, memory), min(need_work, done)
        if need_memory > memory_budget:
            return (
                f"no layer's smallest channel share fits memory on device {device!r}: the least needs "
                f"{need_memory:.0f} bytes, the budget is {memory_budget:.0f}"
            )
        return (
            f"no layer's smallest channel share fits the compute budget on device {device!r}: the least needs "
            f"{need_work:.4g}, the budget is {compute_budget:.4g} ({self.config.compute_metric})"
        )

    def select(self, ctx: SelectionContext) -> Selection:
        if ctx.fisher is None:
            raise ValueError(f"strategy {self.name!r} needs ctx.fisher from the 'fisher' probe")
        info, cost = ctx.info, ctx.cost
        memory_budget, work, compute_budget = self._budgets(ctx)

        def feasible(r: np.ndarray) -> bool:
            return cost.peak_memory_bytes(r) <= memory_budget and work(r) <= compute_budget

        cfg = self.config
        scores = layer_scores(ctx, ctx.fisher)
        # by score descending; ties: nearer the output first
        order = sorted(scores, key=lambda li: (-scores[li], -li))
        ratios = np.zeros(info.num_tensors)
        channels: dict[int, np.ndarray] = {}
        for li in order:
            tensors = [k for k in info.layers[li].tensors if info.tensor_roles[k] in ("weight", "bias")]
            delta = np.asarray(ctx.fisher[li], dtype=float)
            num = len(delta)
            if not tensors or any(info.tensor_channels[k] != num for k in tensors):
                continue  # channel count does not match the tensors' dim 0: not channel-selectable
            rank = np.argsort(-delta, kind="stable")
            counts = sorted({min(num, max(1, math.ceil(ratio * num))) for ratio in cfg.channel_ratios})
            best = self._largest_feasible(
                counts or None, num, lambda c, t=tensors, n=num, r=ratios: feasible(_with_channels(r, t, c / n))
            )
            if best == 0:
                continue
            ratios = _with_channels(ratios, tensors, best / num)
            for k in tensors:
                channels[k] = np.sort(rank[:best])
        return Selection.from_channels(info, channels)

    @staticmethod
    def _largest_feasible(counts: list[int] | None, num: int, ok) -> int:
        """Largest count in ``counts`` (or in 1..num by bisection when None) with ``ok(count)``; 0 if none."""
        if counts is not None:
            for c in reversed(counts):
                if ok(c):
                    return c
            return 0
        lo, hi = 0, num  # ok(lo) holds (0: nothing added), find the largest ok count
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo
