"""Server aggregators: FedAdam and FedYogi against hand computations, the rule for untrained coordinates, config errors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from fedelastic.errors import ConfigError
from fedelastic.sim.aggregate import ClientUpdate, aggregate_partial
from fedelastic.sim.aggregators import AGGREGATORS, Aggregator, make_aggregator

OPTIONS = {"eta": 1.0, "beta_1": 0.5, "beta_2": 0.75, "tau": 0.5}


def _two_steps(name: str) -> tuple[dict, dict, Aggregator]:
    agg = make_aggregator(SimpleNamespace(aggregator=name, aggregator_options=OPTIONS), ["w", "b"])
    x0 = {"w": np.array([1.0, 2.0]), "b": np.array([3.0]), "count": np.array(7, np.int64)}
    # step 1: one client trains all of w (b untouched: no update carries it)
    x1 = agg(x0, [ClientUpdate(1.0, {"w": np.array([1.5, 1.0])})])
    # step 2: one client trains element 0 of w only (channel mask over dim 0); its value at element 1 is ignored
    x2 = agg(x1, [ClientUpdate(2.0, {"w": np.array([2.0, 99.0])}, {"w": np.array([1.0, 0.0])})])
    return x1, x2, agg


def test_fedadam_two_steps_by_hand():
    x1, x2, agg = _two_steps("fedadam")
    # step 1: delta = (0.5, -1); m = 0.5 delta = (0.25, -0.5); v = 0.25 delta^2 = (0.0625, 0.25)
    # x = x + m / (sqrt(v) + 0.5) = (1 + 0.25 / 0.75, 2 - 0.5 / 1.0)
    assert x1["w"].tolist() == pytest.approx([1 + 1 / 3, 1.5], abs=1e-15)
    # step 2, element 0: delta = 2 - 4/3 = 2/3; m = 0.5 * 0.25 + 0.5 * 2/3; v = 0.75 * 0.0625 + 0.25 * 4/9
    m0, v0 = 0.125 + 1 / 3, 0.046875 + 1 / 9
    assert x2["w"][0] == pytest.approx(4 / 3 + m0 / (math.sqrt(v0) + 0.5), abs=1e-14)
    # element 1 no client trained: it keeps its value and its moments
    assert x2["w"][1] == 1.5
    assert agg.m["w"].tolist() == pytest.approx([m0, -0.5]) and agg.v["w"].tolist() == pytest.approx([v0, 0.25])
    # tensors no update carries, and non-float arrays, are left as they were; no moments for them
    assert x2["b"].tolist() == [3.0] and int(x2["count"]) == 7 and "b" not in agg.m


def test_fedyogi_two_steps_by_hand():
    x1, x2, agg = _two_steps("fedyogi")
    # step 1 from v = 0: v - 0.25 delta^2 sign(0 - delta^2) = 0.25 delta^2, as Adam
    assert x1["w"].tolist() == pytest.approx([1 + 1 / 3, 1.5], abs=1e-15)
    # step 2, element 0: v = 0.0625 - 0.25 * 4/9 * sign(0.0625 - 4/9) = 0.0625 + 1/9 (Adam's would be 0.046875 + 1/9)
    m0, v0 = 0.125 + 1 / 3, 0.0625 + 1 / 9
    assert x2["w"][0] == pytest.approx(4 / 3 + m0 / (math.sqrt(v0) + 0.5), abs=1e-14)
    assert x2["w"][1] == 1.5 and agg.v["w"].tolist() == pytest.approx([v0, 0.25])


def test_yogi_second_moment_shrinks_when_it_exceeds_the_squared_update():
    agg = make_aggregator(SimpleNamespace(aggregator="fedyogi", aggregator_options={}), ["w"])
    # v = 1, delta = 0.5: v - (1 - 0.99) * 0.25 * sign(1 - 0.25) = 1 - 0.0025
    assert agg.second_moment(np.array([1.0]), np.array([0.5])).tolist() == pytest.approx([0.9975])


def test_fedavg_and_fedprox_are_the_partial_average():
    x = {"w": np.array([1.0, 2.0])}
    ups = [ClientUpdate(1.0, {"w": np.array([3.0, 4.0])}), ClientUpdate(3.0, {"w": np.array([5.0, 0.0])}, {"w": np.array([1.0, 0.0])})]
    for name in ("fedavg", "fedprox"):
        got = make_aggregator(SimpleNamespace(aggregator=name, aggregator_options={}), ["w"])(x, ups)
        # element 0: (1*3 + 3*5) / 4; element 1: only the first client trained it
        assert got["w"].tolist() == [4.5, 4.0] == aggregate_partial(x, ups)["w"].tolist()


def test_server_optimizer_state_round_trips_for_resume():
    _, _, agg = _two_steps("fedadam")
    fresh = make_aggregator(SimpleNamespace(aggregator="fedadam", aggregator_options=OPTIONS), ["w", "b"])
    fresh.load_state(agg.state())
    x = {"w": np.array([0.0, 0.0]), "b": np.array([0.0])}
    ups = [ClientUpdate(1.0, {"w": np.array([1.0, -1.0])})]
    assert fresh(x, ups)["w"].tolist() == agg(x, ups)["w"].tolist()


def test_unknown_aggregator_or_option_is_a_config_error():
    with pytest.raises(ConfigError, match="server.aggregator"):
        make_aggregator(SimpleNamespace(aggregator="fedsgd", aggregator_options={}), [])
    with pytest.raises(ConfigError, match="server.aggregator_options.lr"):
        make_aggregator(SimpleNamespace(aggregator="fedadam", aggregator_options={"lr": 0.1}), [])
    with pytest.raises(ConfigError, match="server.aggregator_options.eta"):
        make_aggregator(SimpleNamespace(aggregator="fedadam", aggregator_options={"eta": "fast"}), [])
    assert {"fedavg", "fedprox", "fedadam", "fedyogi"} <= set(AGGREGATORS)
