"""Sparse Update (Lin et al., NeurIPS 2022, "On-device training under 256KB memory"): a static scheme.

The scheme is fixed before training, from the model and the device's memory budget only (no
probe), and is the same for every task and every step:

1. **Biases of the last ``bias_last_k`` layers.** A layer's bias is its conv/linear ``bias`` or,
   for a norm layer, its ``beta`` (deployed int8 models fold batch norm into the conv, whose bias
   is then the norm's beta). Counted from the output over the layers that have one; added from
   the output down while they fit the memory budget.
2. **Weights of at most ``max_weight_layers`` conv/linear layers**, each at a channel ratio from
   ``channel_ratios``, trained on the *first* ``ceil(r * channels)`` output channels (the static
   choice of TinyEngine). The layers and ratios come from a greedy search against the memory
   budget: starting from the biases, repeatedly take the move with the largest value gained per
   byte of peak training memory added (:meth:`CostModel.peak_memory_bytes`) among the moves that
   keep the selection within ``memory_fraction`` of the device's memory. A move raises one
   layer's ratio to the next option (a layer not yet chosen may only be started while fewer than
   ``max_weight_layers`` are). The value of layer ``i`` at ratio ``r`` is ``r * depth_i``, with
   ``depth_i = (position among the weight layers, from the input, + 1) / number of weight
   layers``: 1 for the head, smaller toward the input, following the paper's finding that layers
   near the output contribute most per byte. A move that adds no memory ranks first. The search
   stops when no move fits.

Memory is the cost model's (ALGORITHMS.md section 4): a weight needs its layer's input saved, a
bias only the ops' masks, nothing is saved below the deepest trained layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedelastic.config import check, field
from fedelastic.selection import Selection, SelectionContext, SelectionStrategy, register

BIAS_ROLES = ("bias", "norm_bias")


@dataclass(frozen=True)
class SparseUpdateConfig:
    """Options of :class:`SparseUpdate`."""

    bias_last_k: int = field(6, help="train the biases of the last k layers that have one (>= 0)")
    max_weight_layers: int = field(
        4, help="at most this many conv/linear layers get (part of) their weights trained (>= 0)"
    )
    channel_ratios: tuple[float, ...] = field(
        (0.125, 0.25, 0.5, 1.0), help="channel ratios a trained weight may use, each in (0, 1]; at least one"
    )
    memory_fraction: float = field(1.0, help="fraction of the device's training memory the scheme may use, in (0, 1]")

    def __post_init__(self) -> None:
        check(isinstance(self.bias_last_k, int) and self.bias_last_k >= 0, "bias_last_k", "an integer >= 0")
        check(
            isinstance(self.max_weight_layers, int) and self.max_weight_layers >= 0,
            "max_weight_layers",
            "an integer >= 0",
        )
        check(
            len(self.channel_ratios) > 0 and all(0 < r <= 1 for r in self.channel_ratios),
            "channel_ratios",
            "a non-empty list of numbers in (0, 1]",
        )
        check(0 < self.memory_fraction <= 1, "memory_fraction", "a number in (0, 1]")


@register
class SparseUpdate(SelectionStrategy):
    """Sparse Update: biases of the last k layers plus a memory-searched static set of partial weights."""

    name = "sparse_update"
    config_cls = SparseUpdateConfig
    respects_memory = True  # shrinks its selection to ctx.memory_budget_bytes (contract tests)

    def select(self, ctx: SelectionContext) -> Selection:
        cfg, info, cost = self.config, ctx.info, ctx.cost
        budget = cfg.memory_fraction * ctx.memory_budget_bytes
        n = info.num_tensors

        # 1. biases of the last k layers, from the output down while they fit
        whole = np.zeros(n)
        bias_layers = [
            li
            for li in range(len(info.layers) - 1, -1, -1)
            if any(info.tensor_roles[k] in BIAS_ROLES for k in info.layers[li].tensors)
        ]
        for li in bias_layers[: cfg.bias_last_k]:
            trial = whole.copy()
            for k in info.layers[li].tensors:
                if info.tensor_roles[k] in BIAS_ROLES:
                    trial[k] = 1
            if cost.peak_memory_bytes(trial) > budget:
                break
            whole = trial

        # 2. greedy search over (weight layer, next ratio) moves by value per byte
        weights = [
            k
            for k in range(n)
            if info.tensor_roles[k] == "weight" and info.layers[info.tensor_layer[k]].kind in ("conv", "linear")
        ]
        depth = {k: (i + 1) / len(weights) for i, k in enumerate(weights)}
        options = sorted(set(cfg.channel_ratios))
        counts = {
            k: sorted(
                {min(int(info.tensor_channels[k]), max(1, math.ceil(r * info.tensor_channels[k]))) for r in options}
            )
            for k in weights
        }
        chosen: dict[int, int] = {}  # weight tensor -> number of first channels trained

        def ratios_of(ch: dict[int, int]) -> np.ndarray:
            r = whole.copy()
            for k, c in ch.items():
                r[k] = c / info.tensor_channels[k]
            return r

        current = cost.peak_memory_bytes(ratios_of(chosen))
        while True:
            best_move, best_key, best_memory = None, (-np.inf, -np.inf), 0.0
            for k in weights:
                c_now = chosen.get(k, 0)
                larger = [c for c in counts[k] if c > c_now]
                if not larger or (c_now == 0 and len(chosen) >= cfg.max_weight_layers):
                    continue
                c_next = larger[0]
                trial = dict(chosen)
                trial[k] = c_next
                memory = cost.peak_memory_bytes(ratios_of(trial))
                if memory > budget:
                    continue
                gain = (c_next - c_now) / info.tensor_channels[k] * depth[k]
                added = memory - current
                key = (np.inf if added <= 0 else gain / added, gain)
                if key > best_key:
                    best_move, best_key, best_memory = (k, c_next), key, memory
            if best_move is None:
                break
            chosen[best_move[0]] = best_move[1]
            current = best_memory

        partial = {k: np.arange(c) for k, c in chosen.items()}
        return Selection.from_channels(info, partial, whole=whole)
