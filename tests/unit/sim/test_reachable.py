"""Which partitions a round may sample (``Fleet.reachable``), against hand-made draws and a per-partition loop."""

from types import SimpleNamespace as NS

import numpy as np

from fedelastic.sim.fleet import Fleet


def fleet(probabilities: list[float | None], capacity_j: float = 0.0) -> Fleet:
    profiles = [
        NS(
            availability=None if p is None else NS(value=p),
            uplink_bit_per_s=NS(value=1e6),
            downlink_bit_per_s=NS(value=1e6),
        )
        for p in probabilities
    ]
    scenario = NS(
        seed=0,
        availability=NS(model="profile"),
        network=NS(model="nominal", sigma=0.0),
        battery=NS(
            capacity_j=capacity_j,
            min_fraction=0.5,
            recharge_w=0.0,
            charge_from_s=0.0,
            charge_until_s=0.0,
            day_s=86400.0,
        ),
    )
    n = len(profiles)
    return Fleet(scenario, profiles, [None] * n, [1] * n, 1, lambda: None)


def test_a_draw_below_its_profiles_probability_makes_a_partition_reachable():
    f = fleet([0.3, None, 0.0, 0.7, 1.0])  # no availability section: always reachable
    draws = np.array([0.3, 0.999, 0.0, 0.69, 0.5])  # 0.3 is not below 0.3; 0.0 is not below 0.0
    assert f.reachable(0.0, draws) == [1, 3, 4]
    assert f.reachable(0.0, None) == [0, 1, 2, 3, 4]  # no draws and no windows: everyone is online


def test_a_drained_battery_leaves_a_reachable_partition_out():
    f = fleet([None] * 4, capacity_j=10.0)
    f.drain(2, 0.0, 6.0)  # 4 J of 10 left, below min_fraction 0.5, and no recharging
    assert f.reachable(1.0, np.zeros(4)) == [0, 1, 3]


def test_the_vectorised_rule_equals_a_loop_over_a_large_fleet():
    rng = np.random.default_rng(5)
    probs = rng.choice([0.2, 0.5, 0.9, 1.0], size=20_000).tolist()
    f, draws = fleet(probs), rng.random(20_000)
    assert f.reachable(0.0, draws) == [p for p in range(20_000) if draws[p] < probs[p]]
