"""Sparse Update (Lin et al., NeurIPS 2022, "On-device training under 256KB memory"): a static scheme.

The scheme is fixed before training, from the model, the device's memory budget and an offline
*contribution analysis* (no probe), and is the same for every task and every step:

1. **Biases of the last ``bias_last_k`` layers.** A layer's bias is its conv/linear ``bias`` or,
   for a norm layer, its ``beta`` (deployed int8 models fold batch norm into the conv, whose bias
   is then the norm's beta). Counted from the output over the layers that have one; added from
   the output down while they fit the memory budget.
2. **Weights of at most ``max_weight_layers`` conv/linear layers**, each on a ratio of its
   **input** channels from ``channel_ratios``; the trainer keeps the input channels with the
   largest weight norm (tiny-training's ``magnitude+``; a depthwise conv: its own channels), and
   only the kept channels' input activations are saved. Only layers whose bias is updated may
   update their weight (a conv counts when the norm just above it has its beta updated: folded).
3. **Search.** ``search = "contribution"`` (default, the paper's): ``contributions`` is a JSON
   file of accuracy gains measured once offline (:func:`fedelastic.train.contribution.analyse`, on
   source or proxy data; a file measured on the pooled target-task data, a centralised oracle, is
   used only with ``oracle = true``):
   ``"bias"``, the gain of updating the last k biases (k = 1, 2, ...), and ``"weight"``,
   per layer name and ratio, the further gain of that layer's weight at that ratio. The scheme
   maximises the summed gain of the chosen weights (the paper's additivity assumption) under the
   memory budget, by exhaustive search over the layers in range (every layer none or one ratio),
   memory pruning the branches. ``search = "greedy"`` (ablation) fills by gain per byte of peak
   memory, one ratio step at a time. Without a ``contributions`` file the gains are a stand-in,
   not a measurement: ``r * depth_i`` (``depth_i``: position among the weight layers from the
   input, over their number), after the paper's finding that later layers contribute more.

Memory is the cost model's (:meth:`CostModel.memory`, described in the README's "Cost model", with
``input_sparse``): a weight trained on a share of its input channels saves that share of its
input; a bias saves only the ops' masks; nothing is saved below the deepest trained layer.
"""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import numpy as np

from fedelastic.config import check, field
from fedelastic.errors import ConfigError
from fedelastic.modelinfo import ModelInfo
from fedelastic.selection.strategy import Selection, SelectionContext, SelectionStrategy, register

BIAS_ROLES = ("bias", "norm_bias")
_MAX_SCHEMES = 200_000  # exhaustive search cap (the paper's evolutionary search stands in beyond it)


@dataclass(frozen=True)
class SparseUpdateConfig:
    """Options of :class:`SparseUpdate`."""

    bias_last_k: int = field(6, help="train the biases of the last k layers that have one (>= 0)")
    max_weight_layers: int = field(
        4, help="at most this many conv/linear layers (among those with a bias update) train weights (>= 0)"
    )
    channel_ratios: tuple[float, ...] = field(
        (0.125, 0.25, 0.5, 1.0), help="input-channel ratios a trained weight may use, each in (0, 1]; at least one"
    )
    memory_fraction: float = field(1.0, help="fraction of the device's training memory the scheme may use, in (0, 1]")
    search: Literal["contribution", "greedy"] = field(
        "contribution",
        help="'contribution' (the paper's: maximise the measured accuracy gains under memory) or "
        "'greedy' (value per byte; measured gains if given, else a depth heuristic)",
    )
    contributions: str = field(
        "",
        help="JSON file of measured gains (fedelastic.train.contribution.analyse); empty: a depth heuristic "
        "stands in for the measurement (gain r * depth)",
    )
    oracle: bool = field(
        False,
        help="allow a contributions file measured on the pooled target-task data (a 'centralised oracle': "
        "no other strategy sees that data offline); label such a variant as one",
    )

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
        check(self.search in ("contribution", "greedy"), "search", "one of ['contribution', 'greedy']")
        if self.contributions:
            kind = load_contributions(self.contributions)["kind"]  # a bad file fails at configuration time
            check(
                kind != "centralised oracle" or self.oracle,
                "contributions",
                f"gains measured offline on source or proxy data; {self.contributions} is a centralised oracle "
                "(measured on the pooled target-task data): set oracle = true to use it, and label the variant so",
            )


@cache
def load_contributions(path: str) -> dict:
    """The measured gains in ``path``: ``{"bias": [...], "weight": {layer: {ratio: gain}}, "kind": ...}``.

    ``kind`` is the analysis's (:mod:`fedelastic.train.contribution`): "offline proxy" or "centralised
    oracle"; a file that does not say is "unlabelled".
    """
    try:
        raw = json.loads(Path(path).read_text())
        bias = [float(v) for v in raw["bias"]]
        weight = {str(name): {float(r): float(g) for r, g in gains.items()} for name, gains in raw["weight"].items()}
        kind = str(raw.get("kind", "unlabelled"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            path, "contributions", 'JSON {"bias": [gains], "weight": {layer: {ratio: gain}}}', str(exc)
        ) from None
    return {"bias": bias, "weight": weight, "kind": kind}


def bias_layers(info: ModelInfo) -> list[int]:
    """Layers that have a bias (conv/linear bias or norm beta), from the output down."""
    return [
        li
        for li in range(len(info.layers) - 1, -1, -1)
        if any(info.tensor_roles[k] in BIAS_ROLES for k in info.layers[li].tensors)
    ]


def weights_in_range(info: ModelInfo, updated: set[int]) -> list[int]:
    """Conv/linear weight tensors whose layer gets a bias update (own bias, or the norm above it)."""
    out = []
    for k, role in enumerate(info.tensor_roles):
        li = int(info.tensor_layer[k])
        if role != "weight" or info.layers[li].kind not in ("conv", "linear"):
            continue
        above_is_norm = li + 1 < len(info.layers) and info.layers[li + 1].kind == "norm"
        if li in updated or (above_is_norm and li + 1 in updated):
            out.append(k)
    return out


#: schemes found, per cost model (weakly: a run's cost models go with it), keyed by (config, budget)
_SCHEMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@register
class SparseUpdate(SelectionStrategy):
    """Sparse Update: biases of the last k layers plus an offline-searched static set of input-channel-sparse weights."""

    name = "sparse_update"
    config_cls = SparseUpdateConfig
    respects_memory = True  # shrinks its selection to ctx.memory_budget_bytes (contract tests)
    offline = True  # the scheme is searched offline, before deployment: the device does not pay for it

    def select(self, ctx: SelectionContext) -> Selection:
        """The scheme of this config on ``ctx``'s cost model and memory budget: static, so searched once
        per (cost model, budget, config) in a process and copied out (the search prices tens of thousands
        of candidate schemes)."""
        schemes = _SCHEMES.setdefault(ctx.cost, {}) if ctx.info is ctx.cost.info else {}
        key = (self.config, ctx.memory_budget_bytes)
        if key not in schemes:
            schemes[key] = self._search(ctx)
        found = schemes[key]
        assert found.input_sparse is not None
        return Selection(found.ratios.copy(), input_sparse=found.input_sparse.copy())

    def _search(self, ctx: SelectionContext) -> Selection:
        cfg, info, cost = self.config, ctx.info, ctx.cost
        budget = cfg.memory_fraction * ctx.memory_budget_bytes
        n = info.num_tensors
        input_sparse = np.zeros(n, dtype=bool)

        # 1. biases of the last k layers, from the output down while they fit
        whole = np.zeros(n)
        updated: set[int] = set()
        for li in bias_layers(info)[: cfg.bias_last_k]:
            trial = whole.copy()
            for k in info.layers[li].tensors:
                if info.tensor_roles[k] in BIAS_ROLES:
                    trial[k] = 1
            if cost.peak_memory_bytes(trial) > budget:
                break
            whole = trial
            updated.add(li)

        # 2. weights in the bias range, each on a ratio of its input channels
        weights = weights_in_range(info, updated)
        input_sparse[weights] = True
        options = sorted(set(cfg.channel_ratios))
        gains = self._gains(info, weights, options)

        def ratios_of(chosen: dict[int, float]) -> np.ndarray:
            r = whole.copy()
            for k, ratio in chosen.items():
                r[k] = ratio
            return r

        def memory(chosen: dict[int, float]) -> float:
            return cost.peak_memory_bytes(ratios_of(chosen), input_sparse)

        if cfg.search == "contribution":
            chosen = self._exhaustive(weights, options, gains, memory, budget)
        else:
            chosen = self._greedy(weights, options, gains, memory, budget)
        return Selection(ratios_of(chosen), input_sparse=input_sparse)

    def _gains(self, info: ModelInfo, weights: list[int], options: list[float]) -> dict[int, dict[float, float]]:
        """Gain of each (weight, ratio): measured (from ``contributions``) or the depth heuristic."""
        cfg = self.config
        if cfg.contributions:
            measured = load_contributions(cfg.contributions)["weight"]
            out = {}
            for k in weights:
                layer = info.layers[int(info.tensor_layer[k])].name
                if layer not in measured or any(r not in measured[layer] for r in options):
                    raise ConfigError(
                        cfg.contributions,
                        f"weight.{layer}",
                        f"measured gains for every ratio in {options}",
                        sorted(measured.get(layer, {})),
                    )
                out[k] = {r: measured[layer][r] for r in options}
            return out
        every = [k for k, role in enumerate(info.tensor_roles) if role == "weight"]
        depth = {k: (i + 1) / len(every) for i, k in enumerate(every)}
        return {k: {r: r * depth[k] for r in options} for k in weights}

    def _exhaustive(self, weights, options, gains, memory, budget) -> dict[int, float]:
        """The scheme of largest summed gain within ``budget`` and ``max_weight_layers``."""
        cfg = self.config
        best: dict[int, float] = {}
        best_gain = 0.0
        size = sum(math.comb(len(weights), j) * len(options) ** j for j in range(cfg.max_weight_layers + 1))
        if size > _MAX_SCHEMES:
            return self._greedy(weights, options, gains, memory, budget)

        def visit(i: int, chosen: dict[int, float], gain: float) -> None:
            nonlocal best, best_gain
            if gain > best_gain:
                best, best_gain = dict(chosen), gain
            if i == len(weights) or len(chosen) == cfg.max_weight_layers:
                return
            for j in range(i, len(weights)):
                k = weights[j]
                for r in options:  # memory grows with the ratio: stop at the first that does not fit
                    chosen[k] = r
                    if memory(chosen) > budget:
                        del chosen[k]
                        break
                    visit(j + 1, chosen, gain + gains[k][r])
                    del chosen[k]

        visit(0, {}, 0.0)
        return best

    def _greedy(self, weights, options, gains, memory, budget) -> dict[int, float]:
        """Repeatedly raise one layer's ratio to its next option, by gain per byte of memory added."""
        cfg = self.config
        chosen: dict[int, float] = {}
        current = memory(chosen)
        while True:
            best_move, best_key, best_memory = None, (-np.inf, -np.inf), 0.0
            for k in weights:
                r_now = chosen.get(k, 0.0)
                larger = [r for r in options if r > r_now]
                if not larger or (r_now == 0 and len(chosen) >= cfg.max_weight_layers):
                    continue
                trial = dict(chosen)
                trial[k] = larger[0]
                mem = memory(trial)
                if mem > budget:
                    continue
                gain = gains[k][larger[0]] - (gains[k][r_now] if r_now else 0.0)
                added = mem - current
                key = (np.inf if added <= 0 else gain / added, gain)
                if gain > 0 and key > best_key:
                    best_move, best_key, best_memory = (k, larger[0]), key, mem
            if best_move is None:
                return chosen
            chosen[best_move[0]] = best_move[1]
            current = best_memory
