"""A run's fleet, pure numpy: who is online and charged, each client's links and full-training times,
built from the deadline budgets (:mod:`~fedelastic.sim.deadline`), availability (:mod:`~fedelastic.sim.availability`),
batteries (:mod:`~fedelastic.sim.battery`), links (:mod:`~fedelastic.sim.network`) and trace files (:mod:`~fedelastic.sim.traces`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .._shim import forward_names
from ..cost.costmodel import link_times_s
from .availability import Availability, SessionAvailability
from .battery import Batteries
from .deadline import full_round_time_s
from .network import link_factors
from .traces import load_availability_trace, load_network_trace


class Fleet:
    """A run's devices on the clock: who is online and charged, each client's links and full-training times.

    Built from the scenario and, per partition, its device's profile and cost model, its local
    steps and the train strategy (``new_strategy()``: a fresh one, for its probes).
    """

    def __init__(
        self, scenario: Any, profiles: list, costs: list, steps: list[int], num_tensors: int, new_strategy: Callable
    ):
        self.scenario, self.profiles, self.costs, self.steps = scenario, profiles, costs, steps
        self.num_tensors, self.new_strategy = num_tensors, new_strategy
        n, av, net, sc = len(profiles), scenario.availability, scenario.network, scenario
        self.windows: Availability | None = None  # None: the profiles' per-round availability draw
        if av.model in ("sessions", "diurnal"):
            amplitude = av.diurnal_amplitude if av.model == "diurnal" else 0.0
            self.windows = SessionAvailability(n, sc.seed, av.mean_session_s, av.mean_offline_s, amplitude, av.day_s)
        elif av.model == "trace":
            self.windows = load_availability_trace(av.trace, n, av.period_s)
        self.probability = np.array([a.value if (a := p.availability) is not None else 1.0 for p in profiles])
        if net.model == "trace":
            self.up_bps, self.down_bps = load_network_trace(net.trace, n)
        else:
            factor = link_factors(net.model, n, sc.seed, net.sigma)
            self.up_bps = np.array([p.uplink_bit_per_s.value for p in profiles]) * factor
            self.down_bps = np.array([p.downlink_bit_per_s.value for p in profiles]) * factor
        b = sc.battery
        self.batteries = (
            Batteries(n, b.capacity_j, b.min_fraction, b.recharge_w, b.charge_from_s, b.charge_until_s, b.day_s)
            if b.capacity_j > 0
            else None
        )

    def __len__(self) -> int:
        return len(self.profiles)

    def comm_s(self, pid: int, bytes_down: float, bytes_up: float) -> tuple[float, float]:
        stream = self.scenario.stream
        if stream is not None and not stream.federated:  # a fleet of one: nothing is sent
            return 0.0, 0.0
        latency = self.profiles[pid].latency_s.value
        return link_times_s(bytes_down, bytes_up, self.down_bps[pid], self.up_bps[pid], latency)

    def full_comm_s(self, pid: int) -> float:
        cost = self.costs[pid]
        return sum(self.comm_s(pid, cost.bytes_down(), cost.bytes_up(np.ones(self.num_tensors))))

    def full_step_s(self, pid: int) -> float:
        return float(self.costs[pid].full_step_time_s())

    def full_round_s(self, pid: int) -> float:
        """Download, full local training and full upload (no probes)."""
        return full_round_time_s(self.full_comm_s(pid), self.steps[pid], self.costs[pid].full_step_time_s())

    def probe_s(self, pid: int) -> float:
        """Emulated time of the probes the train strategy runs in one round of ``steps[pid]`` steps."""
        strategy, cost = self.new_strategy(), self.costs[pid]
        if strategy.probe is None:
            return 0.0
        selections = 1 + sum(strategy.should_reselect(s) for s in range(1, self.steps[pid]))
        return float(selections * cost.probe_time_s(strategy.probe))  # one pass over the batch, every tensor

    def online(self, pid: int, t: float) -> bool:
        return self.windows is None or self.windows.online(pid, t)

    def reachable(self, t: float, draws: np.ndarray | None) -> list[int]:
        """The partitions that can train at ``t``, in order: with ``draws`` (one per partition; the
        profiles' availability), those whose draw is below their probability, else those online;
        of these, the charged ones. Linear in the fleet, in numpy where there are no batteries or windows."""
        if draws is None:
            ids = [p for p in range(len(self)) if self.windows is None or self.windows.online(p, t)]
        else:
            ids = np.flatnonzero(draws < self.probability).tolist()
        return ids if self.batteries is None else [p for p in ids if self.batteries.can_train(p, t)]

    def forget_before(self, t: float) -> None:
        """The clock is at ``t`` and never goes back: online windows that ended before it may go."""
        if self.windows is not None:
            self.windows.forget_before(t)

    def charged(self, pid: int, t: float) -> bool:
        """Whether the client's battery (if it has one) lets it train at ``t``."""
        return self.batteries is None or self.batteries.can_train(pid, t)

    def battery_fraction(self, pid: int, t: float) -> float:
        return float("nan") if self.batteries is None else self.batteries.fraction(pid, t)

    def ready_at(self, pid: int, t: float) -> float:
        """The earliest time from ``t`` at which ``pid`` is online and charged (``inf``: never)."""
        for _ in range(1000):
            online_t = self.next_online(pid, t)
            charged_t = online_t if self.batteries is None else self.batteries.ready_at(pid, online_t)
            if math.isinf(charged_t) or (charged_t == online_t and self.online(pid, charged_t)):
                return charged_t
            t = charged_t
        return math.inf

    def drain(self, pid: int, t: float, energy_j: float) -> None:
        if self.batteries is not None:
            self.batteries.drain(pid, t, energy_j)

    def offline_at(self, pid: int, t: float) -> float:
        return math.inf if self.windows is None else self.windows.offline_at(pid, t)

    def next_online(self, pid: int, t: float) -> float:
        return t if self.windows is None else self.windows.next_online(pid, t)


# names that moved out of this module (issue 39) import from here for one release
__getattr__ = forward_names(__name__, ("fedelastic.sim.availability", "fedelastic.sim.battery", "fedelastic.sim.deadline", "fedelastic.sim.network", "fedelastic.sim.traces"))
