"""The contract every registered selection strategy keeps: :func:`fedelastic.testing.check_strategy`
over the registry (present and future strategies), with the value checks of each built-in, and
the accounting of train time; a strategy written in a notebook passes it, a broken one does not.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import pytest

import fedelastic
from fedelastic.config import check, field
from fedelastic.selection.strategy import REGISTRY, Selection, available, make_strategy
from fedelastic.strategies.budget import BudgetedStrategy, ElasticConfig
from fedelastic.testing import BATCH, SEED, STEPS, _data, _fresh, _setup, check_strategy
from fedelastic.train.trainer import LocalTraining, train_local

STRATEGIES = available()

# Value checks per strategy: options that must be refused, and the key the error must name.
# Type checks (a string for a number, a number for a string...) run for every option of every
# strategy without a row here.
BAD_VALUES: dict[str, list[tuple[dict, str]]] = {
    "elastic_tensor": [
        ({"rho": -1}, "rho"),
        ({"rho": 0.0}, "rho"),
        ({"rho": 1.5}, "rho"),
        ({"interval": 0}, "interval"),
        ({"solver": "simplex"}, "solver"),
        ({"resolution": 0}, "resolution"),
        ({"infeasible": "ignore"}, "infeasible"),
    ],
    "elastic_layer": [({"rho": -1}, "rho"), ({"interval": -3}, "interval")],
    "elastic_artifact": [({"rho": 0.0}, "rho"), ({"solver": "simplex"}, "solver"), ({"resolution": 0}, "resolution")],
    "random_budget": [({"rho": 2.0}, "rho"), ({"interval": 0}, "interval")],
    "static_elastic": [({"rho": -1}, "rho"), ({"resolution": -5}, "resolution")],
    "tinytrain": [
        ({"memory_fraction": 0.0}, "memory_fraction"),
        ({"memory_fraction": 1.2}, "memory_fraction"),
        ({"compute_fraction": -0.1}, "compute_fraction"),
        ({"compute_metric": "flops"}, "compute_metric"),
        ({"channel_ratios": [0.5, 0.0]}, "channel_ratios"),
        ({"interval": -1}, "interval"),
    ],
    "sparse_update": [
        ({"bias_last_k": -1}, "bias_last_k"),
        ({"max_weight_layers": -2}, "max_weight_layers"),
        ({"channel_ratios": []}, "channel_ratios"),
        ({"channel_ratios": [0.25, 2.0]}, "channel_ratios"),
        ({"memory_fraction": 0.0}, "memory_fraction"),
    ],
}




def test_registry_lists_the_project_strategies():
    expected = {
        "full",
        "last_layer",
        "bn_bias",
        "elastic_tensor",
        "elastic_layer",
        "elastic_artifact",
        "tinytrain",
        "sparse_update",
        "random_budget",
        "static_elastic",
    }
    assert expected <= set(STRATEGIES)


@pytest.mark.parametrize("name", STRATEGIES)
def test_strategy_keeps_the_contract(name):
    check_strategy(REGISTRY[name], bad_values=BAD_VALUES.get(name, ()))


def option_names(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(REGISTRY[name].config_cls)}


def matrix_options(name: str) -> dict:
    wanted = {"rho": 0.5, "interval": 3, "interval_unit": "steps"}
    return {k: v for k, v in wanted.items() if k in option_names(name)}


def record(strategy) -> list[Selection]:
    """Make ``strategy`` append every Selection it returns to the returned list (steps: ``selected_at``)."""
    seen: list[Selection] = []
    steps: list[int] = []
    inner = strategy.select

    def select(ctx):
        seen.append(inner(ctx))
        steps.append(ctx.step)
        return seen[-1]

    strategy.selected_at = steps
    strategy.select = select
    return seen


def run(name: str, model_name: str, device: str):
    _, info, cost = _setup(model_name, device)
    strategy = make_strategy(name, matrix_options(name))
    seen = record(strategy)
    local = LocalTraining(epochs=1, batch_size=BATCH, lr=0.1, weight_decay=1e-3, max_steps=STEPS)
    result = train_local(_fresh(model_name, device), info, strategy, cost, _data(), local, seed=SEED)
    return result, strategy, seen, info, cost


@pytest.mark.parametrize("name", STRATEGIES)
def test_train_time_is_steps_probes_and_selector(name):
    """train time = sum of the steps' times + the probes + the selector's work, priced by hand."""
    result, _, _, _, _ = run(name, "small_cnn", "jetson_nano")  # every probe fits whole
    rerun, strategy, seen, info, cost = run(name, "small_cnn", "jetson_nano")
    starts = [*strategy.selected_at, min(STEPS, -(-len(_data()) // BATCH))]
    steps = sum((b - a) for a, b, sel in zip(starts, starts[1:], seen) if sel.mask.any())
    step_time = sum(
        (b - a) * cost.step_time_s(sel.ratios) for a, b, sel in zip(starts, starts[1:], seen) if sel.mask.any()
    )
    ones = np.ones(info.num_tensors)
    per_probe = {
        "importance": 2 * (cost.forward_time_s + cost.backward_time_s(ones) - cost.t_opt.sum()) + cost.t_opt.sum(),
        "fisher": cost.forward_time_s + cost.t_dx[1:].sum() + cost.t_bwd_fixed,
    }
    probes = sum(per_probe[p] for p in probes_run(strategy, len(seen)))
    assert rerun.steps == steps == result.steps
    # fixed schemes do no search; Sparse Update searches offline, before deployment
    searches = getattr(REGISTRY[name], "respects_memory", False) and not REGISTRY[name].offline
    assert (rerun.selector_time_s > 0) == searches
    assert rerun.overhead_time_s == pytest.approx(probes + rerun.selector_time_s)
    assert rerun.train_time_s == pytest.approx(step_time + probes + rerun.selector_time_s)


def probes_run(strategy, selections: int) -> list[str]:
    """The probe of each selection: static_elastic probes only its first."""
    kind = type(strategy).probe
    if kind is None:
        return []
    return [kind] * (1 if strategy.name == "static_elastic" else selections)




# ---- a strategy of one's own, from a notebook --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TopKConfig:
    k: int = field(2, help="train the last k tensors")

    def __post_init__(self):
        check(self.k >= 1, "k", "an integer >= 1")


class LastK(fedelastic.SelectionStrategy):
    """Trains the last ``k`` tensors, as a user would write it in a notebook."""

    name: ClassVar[str] = "test_last_k"
    config_cls = TopKConfig

    def select(self, ctx):
        mask = np.zeros(ctx.info.num_tensors)
        mask[-self.config.k :] = 1
        return Selection.from_mask(mask)


def test_a_notebook_strategy_registers_and_keeps_the_contract():
    try:
        assert fedelastic.register_strategy(LastK) is LastK
        check_strategy(LastK, bad_values=[({"k": 0}, "k")])
        assert make_strategy("test_last_k", {"k": 3}).config.k == 3
    finally:
        REGISTRY.pop("test_last_k", None)


class Unseeded(LastK):
    """Picks its tensors with an unseeded generator: two trainings with one seed differ."""

    name: ClassVar[str] = "test_unseeded"
    draws = iter(range(1, 10**6))

    def select(self, ctx):
        mask = np.zeros(ctx.info.num_tensors)
        mask[-(next(self.draws) % 3 + 1) :] = 1  # not from ctx.rng
        return Selection.from_mask(mask)


@dataclasses.dataclass(frozen=True)
class SilentConfig:
    k: int = 2  # no help text


class Silent(LastK):
    name: ClassVar[str] = "test_silent"
    config_cls = SilentConfig


@pytest.mark.parametrize(("cls", "breach"), [(Unseeded, "(e) one seed"), (Silent, "(d) option k has no help")])
def test_check_strategy_refuses_a_broken_strategy(cls, breach):
    try:
        with pytest.raises(AssertionError, match=breach.replace("(", r"\(").replace(")", r"\)")):
            check_strategy(cls, models=["small_cnn"], devices=["jetson_nano"])
    finally:
        REGISTRY.pop(cls.name, None)


@dataclasses.dataclass(frozen=True)
class PlainErrors:
    k: int = field(2, help="an option checked with a plain ValueError")
    scale: float = field(1.0, help="another")

    def __post_init__(self):
        if self.k < 1:
            raise ValueError("k must be >= 1")
        if self.scale > 10:
            raise ValueError("too large")


class PlainErrorStrategy(LastK):
    name: ClassVar[str] = "test_plain_errors"
    config_cls = PlainErrors


def test_a_plain_value_error_names_the_option_it_is_about():
    from fedelastic.errors import ConfigError

    try:
        fedelastic.register_strategy(PlainErrorStrategy)
        with pytest.raises(ConfigError) as err:
            make_strategy("test_plain_errors", {"k": 0})
        assert err.value.key == "train.options.k" and "k must be >= 1" in str(err.value)
        with pytest.raises(ConfigError) as err:  # names no option: the table is named
            make_strategy("test_plain_errors", {"scale": 11.0}, key="compare.strategies[1]")
        assert err.value.key == "compare.strategies[1].options"
    finally:
        REGISTRY.pop("test_plain_errors", None)


class DeepFirst(BudgetedStrategy):
    """A notebook's budgeted strategy on the public base: deeper tensors score higher."""

    name: ClassVar[str] = "test_deep_first"

    def scores(self, ctx):
        return np.arange(1.0, ctx.info.num_tensors + 1.0)


def test_a_notebook_strategy_on_the_public_budget_base_keeps_the_contract():
    assert DeepFirst.config_cls is ElasticConfig  # the base's options: rho, interval, ...
    try:
        fedelastic.register_strategy(DeepFirst)
        assert make_strategy("test_deep_first", {"rho": 0.6}).config.rho == 0.6
        check_strategy(DeepFirst, models=["small_cnn"], bad_values=[({"rho": 0.0}, "rho")])
    finally:
        REGISTRY.pop("test_deep_first", None)
