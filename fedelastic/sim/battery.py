"""Batteries, pure numpy: each client's charge on the simulated clock."""

from __future__ import annotations

import math

import numpy as np


class Batteries:
    """Per-client battery charge on the simulated clock.

    Every client starts full. Its training trips drain it; it charges at ``recharge_w`` during a
    daily window ``[charge_from_s, charge_until_s)`` of a ``day_s`` day (plugged in at night, say),
    up to ``capacity_j``. Below ``min_fraction`` of its capacity a client refuses to train.
    """

    def __init__(
        self,
        num_clients: int,
        capacity_j: float,
        min_fraction: float,
        recharge_w: float,
        charge_from_s: float,
        charge_until_s: float,
        day_s: float,
    ):
        self.capacity_j, self.min_fraction, self.recharge_w = capacity_j, min_fraction, recharge_w
        self.charge_from_s, self.charge_until_s, self.day_s = charge_from_s, charge_until_s, day_s
        self.level_j = np.full(num_clients, float(capacity_j))
        self._at = np.zeros(num_clients)

    def _plugged_before(self, t: float) -> float:
        """Seconds spent charging in ``[0, t)``."""
        per_day = self.charge_until_s - self.charge_from_s
        days, into = divmod(t, self.day_s)
        return days * per_day + min(max(into - self.charge_from_s, 0.0), per_day)

    def _charge(self, pid: int, t: float) -> None:
        if t > self._at[pid]:
            gained = self.recharge_w * (self._plugged_before(t) - self._plugged_before(self._at[pid]))
            self.level_j[pid] = min(self.capacity_j, self.level_j[pid] + gained)
            self._at[pid] = t

    def fraction(self, pid: int, t: float) -> float:
        self._charge(pid, t)
        return float(self.level_j[pid] / self.capacity_j)

    def can_train(self, pid: int, t: float) -> bool:
        return self.fraction(pid, t) >= self.min_fraction

    def ready_at(self, pid: int, t: float) -> float:
        """The earliest time from ``t`` at which ``pid`` may train (``inf`` if it never recharges)."""
        need = self.min_fraction * self.capacity_j - self.level_j[pid]
        if t < self._at[pid] or need <= 0:
            return max(t, float(self._at[pid]))
        per_day = self.charge_until_s - self.charge_from_s
        if self.recharge_w <= 0 or per_day <= 0:
            return math.inf
        target = self._plugged_before(float(self._at[pid])) + need / self.recharge_w  # seconds plugged in, from 0
        day = math.ceil(target / per_day) - 1
        return max(t, day * self.day_s + self.charge_from_s + (target - day * per_day))

    def drain(self, pid: int, t: float, energy_j: float) -> None:
        """Take ``energy_j`` spent by a trip that ended at ``t``."""
        self._charge(pid, t)
        self.level_j[pid] = max(0.0, self.level_j[pid] - energy_j)
