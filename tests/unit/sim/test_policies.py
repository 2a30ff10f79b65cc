"""Server policies on a hand-built fleet: each policy's sample size, assignments, round close and FedNova flag.

A new policy is one class in fedelastic/sim/policies.py and one row in CASES.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from fedelastic.sim.clock import Trip
from fedelastic.sim.policies import POLICIES, Assignment, make_policy


@dataclass
class HandFleet:
    """Three clients: (comm s, full step s, steps) = A (1, 0.25, 4), B (2, 0.5, 4), C (1, 0.5, 8); no probes."""

    comm = (1.0, 2.0, 1.0)
    step = (0.25, 0.5, 0.5)
    steps = (4, 4, 8)

    def full_comm_s(self, pid: int) -> float:
        return self.comm[pid]

    def full_step_s(self, pid: int) -> float:
        return self.step[pid]

    def probe_s(self, pid: int) -> float:
        return 0.0


# the replies' trips (dispatched at 0): A arrives at 2.0, B at 4.0, C exactly at 3.0
TRIPS = [Trip(0, 0.0, 0.5, 1.0, 0.5), Trip(1, 0.0, 1.0, 2.0, 1.0), Trip(2, 0.0, 0.5, 2.0, 0.5)]
NONE = Assignment()
C, L, E = "counted", "late", "extra"


@dataclass
class Case:
    policy: str
    options: dict  # the [server] keys it reads
    sample: int  # sample size for clients_per_round = 2 of 3
    assigned: list[Assignment]  # under a deadline of 3 s, by hand from the fleet above
    deadline: float | None  # the deadline the round closes under
    keep: int  # clients_per_round at the close
    end: float
    status: list[str]
    renormalises: bool


CASES = [
    Case("wait_all", {}, 2, [NONE] * 3, 3.0, 2, 4.0, [C, C, C], False),  # the deadline is ignored
    Case("deadline_drop", {}, 2, [NONE] * 3, 3.0, 2, 3.0, [C, L, C], False),  # C at exactly 3 s is in time
    # steps: floor((3 - comm) / step), at most steps: A min(4, 8), B 2, C 4
    Case("deadline_fewer_steps", {}, 2, [Assignment(step_cap=4), Assignment(step_cap=2), Assignment(step_cap=4)],
         3.0, 2, 3.0, [C, L, C], True),
    # rho = (3 - comm) / (steps x step), at most 1: A 2/1 -> 1, B 1/2, C 2/4
    Case("deadline_elastic", {"min_rho": 0.0}, 2, [Assignment(1.0), Assignment(0.5), Assignment(0.5)],
         3.0, 2, 3.0, [C, L, C], False),
    # below min_rho 0.75: steps = floor(budget / (0.75 x step)), rho = budget / (steps x step):
    # B: floor(1 / 0.375) = 2, 1 / (2 x 0.5) = 1; C: floor(2 / 0.375) = 5, 2 / (5 x 0.5) = 0.8
    Case("deadline_elastic", {"min_rho": 0.75}, 2, [Assignment(1.0), Assignment(1.0, 2), Assignment(0.8, 5)],
         3.0, 2, 3.0, [C, L, C], True),
    # ceil(2 x 1.3) = 3 sampled; the round closes at the 2nd arrival (C at 3 s); B is surplus
    Case("overcommit", {"overcommit": 1.3}, 3, [NONE] * 3, None, 2, 3.0, [C, E, C], False),
    # with a deadline of 2.5 s and keep 1: A counted at 2 s, C late, B late
    Case("overcommit", {"overcommit": 1.3}, 3, [NONE] * 3, 2.5, 1, 2.0, [C, L, L], False),
    Case("async", {}, 2, [NONE] * 3, None, 2, 4.0, [C, C, C], False),  # its dispatches train fully
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.policy}-{i}" for i, c in enumerate(CASES)])
def test_policy_on_a_hand_built_fleet(case):
    policy = make_policy(SimpleNamespace(policy=case.policy, **case.options))
    assert policy.name == case.policy
    assert policy.sample_size(2, 3) == case.sample
    assigned = [policy.assign(p, 3.0, HandFleet()) for p in range(3)]
    for got, want in zip(assigned, case.assigned):
        assert got.step_cap == want.step_cap
        assert (math.isnan(got.rho) and math.isnan(want.rho)) or got.rho == pytest.approx(want.rho, rel=1e-12)
    end, status = policy.close(TRIPS, 0.0, case.deadline, case.keep)
    assert end == pytest.approx(case.end, rel=1e-12)
    assert [status[p] for p in range(3)] == case.status
    assert policy.renormalises() == case.renormalises


def test_every_registered_policy_has_a_test_row():
    builtin = {"wait_all", "deadline_drop", "deadline_fewer_steps", "deadline_elastic", "overcommit", "async"}
    assert {c.policy for c in CASES} == set(POLICIES) == builtin


def test_async_concurrency_buffer_and_staleness_discount():
    policy = make_policy(SimpleNamespace(policy="async", concurrency=0, buffer_size=0, staleness="inverse_sqrt"))
    assert policy.concurrency(6, 10) == 6 and policy.concurrency(0, 10) == 10  # clients_per_round, or all
    assert policy.buffer_size(6) == 3 and policy.buffer_size(1) == 1  # half the concurrency, at least 1
    assert policy.discount()(3) == pytest.approx(0.5)  # 1 / sqrt(1 + 3)
    flat = make_policy(SimpleNamespace(policy="async", concurrency=4, buffer_size=2, staleness="none"))
    assert (flat.concurrency(6, 10), flat.buffer_size(4), flat.discount()(3)) == (4, 2, 1.0)


def test_a_registered_policy_is_a_scenario_value_and_an_unknown_one_a_config_error(tmp_path):
    from fedelastic.errors import ConfigError
    from fedelastic.scenario import parse_scenario
    from fedelastic.sim.policies import Policy, register
    from tests.support import small_scenario_dict

    @register
    class FirstHalf(Policy):  # a user's policy: the round closes at the first half of the arrivals
        name = "first_half"
        deadline = "optional"

        def close(self, trips, start_s, deadline_s, k):
            return super().close(trips, start_s, deadline_s, max(1, len(trips) // 2))

    try:
        sc = parse_scenario(small_scenario_dict(tmp_path, server={"policy": "first_half", "deadline": 5.0}), src="p.toml")
        assert make_policy(sc.server).name == "first_half"
    finally:
        del POLICIES["first_half"]
    with pytest.raises(ConfigError, match=r"server\.policy"):
        parse_scenario(small_scenario_dict(tmp_path, server={"policy": "first_half"}), src="p.toml")
    with pytest.raises(ConfigError, match=r"server\.deadline"):  # deadline_drop requires one
        parse_scenario(small_scenario_dict(tmp_path, server={"policy": "deadline_drop"}), src="p.toml")
