"""Availability, pure numpy: each client is online during intervals of the simulated clock, generated
sessions (exponential on/off, optionally diurnal) or a trace file. A client is asked whether it is
online at ``t`` and when it next goes offline, as FedScale's ``is_active(t)`` does.
"""

from __future__ import annotations

import bisect
import math

import numpy as np


class Availability:
    """Online intervals ``[start, end)`` per client, generated as far as they are asked for.

    The server moves a floor with its clock (:meth:`forget_before`): intervals that ended before
    it are dropped as new ones are generated, so the state stays bounded over a long simulated
    time (kept, the intervals of 10,000 clients would grow by ~16 MB per simulated day).
    Asking about a time before the floor is an error, never a wrong answer.
    """

    KEEP = 64  # a client's intervals are pruned only once it holds this many

    def __init__(self, num_clients: int):
        self.num_clients = num_clients
        self._starts: list[list[float]] = [[] for _ in range(num_clients)]
        self._ends: list[list[float]] = [[] for _ in range(num_clients)]
        self._horizon = [0.0] * num_clients  # intervals are known up to here
        self._floor = -math.inf  # no question will be asked about an earlier time

    def forget_before(self, t: float) -> None:
        """Promise that no later question is about a time before ``t`` (the floor only rises)."""
        self._floor = max(self._floor, t)

    def _prune(self, pid: int) -> None:
        starts, ends = self._starts[pid], self._ends[pid]
        drop = bisect.bisect_left(ends, self._floor)  # ends are sorted: these intervals ended before the floor
        if drop:
            del starts[:drop], ends[:drop]

    def _extend(self, pid: int) -> None:
        """Append the next intervals of ``pid`` and raise its horizon."""
        raise NotImplementedError

    def _add(self, pid: int, start: float, end: float) -> None:
        starts, ends = self._starts[pid], self._ends[pid]
        if end <= start:
            return
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)  # touching windows merge
        else:
            starts.append(start)
            ends.append(end)

    def _cover(self, pid: int, t: float) -> None:
        if t < self._floor:
            raise ValueError(f"availability of client {pid} asked at {t} s, before the clock's floor {self._floor} s")
        while self._horizon[pid] <= t:
            if len(self._starts[pid]) >= self.KEEP:
                self._prune(pid)
            self._extend(pid)

    def _index(self, pid: int, t: float) -> int:
        self._cover(pid, t)
        return bisect.bisect_right(self._starts[pid], t) - 1

    def online(self, pid: int, t: float) -> bool:
        i = self._index(pid, t)
        return i >= 0 and t < self._ends[pid][i]

    def offline_at(self, pid: int, t: float) -> float:
        """When ``pid``, online at ``t``, next goes offline (``t`` if it is offline now)."""
        if not self.online(pid, t):
            return t
        i = self._index(pid, t)
        while self._ends[pid][i] >= self._horizon[pid]:  # the window may continue into the next chunk
            if math.isinf(self._horizon[pid]):
                return math.inf
            self._extend(pid)
        return self._ends[pid][i]

    def next_online(self, pid: int, t: float) -> float:
        """``t`` if ``pid`` is online then, else when it next comes online (``inf``: never)."""
        if self.online(pid, t):
            return t
        i = self._index(pid, t)
        while i + 1 >= len(self._starts[pid]):
            if math.isinf(self._horizon[pid]):
                return math.inf
            self._extend(pid)
        return self._starts[pid][i + 1]


class AlwaysOnline(Availability):
    def _extend(self, pid: int) -> None:
        self._add(pid, 0.0, math.inf)
        self._horizon[pid] = math.inf


class SessionAvailability(Availability):
    """Alternating online sessions and offline gaps, exponentially distributed.

    A client starts online with the stationary probability ``session / (session + offline)``.
    With ``diurnal_amplitude = a`` an offline gap starting at time ``t`` has mean
    ``mean_offline_s * (1 + a * cos(2 pi (t / day_s + phase)))``, with a per-client phase (its
    time zone): clients come back quickly at their day's peak and slowly at its trough.
    """

    def __init__(
        self,
        num_clients: int,
        seed: int,
        mean_session_s: float,
        mean_offline_s: float,
        diurnal_amplitude: float = 0.0,
        day_s: float = 86400.0,
    ):
        super().__init__(num_clients)
        self.mean_session_s, self.mean_offline_s = mean_session_s, mean_offline_s
        self.amplitude, self.day_s = diurnal_amplitude, day_s
        self._rngs = [np.random.default_rng([seed, pid, 0xA7A1]) for pid in range(num_clients)]
        self._phase = [float(rng.random()) for rng in self._rngs]
        p_online = mean_session_s / (mean_session_s + mean_offline_s)
        self._online_first = [bool(rng.random() < p_online) for rng in self._rngs]

    def _gap_mean(self, pid: int, t: float) -> float:
        return self.mean_offline_s * (1 + self.amplitude * math.cos(2 * math.pi * (t / self.day_s + self._phase[pid])))

    def _extend(self, pid: int) -> None:
        rng, t = self._rngs[pid], self._horizon[pid]
        if t == 0.0 and not self._online_first[pid]:
            t = float(rng.exponential(self._gap_mean(pid, 0.0)))
        for _ in range(16):
            end = t + float(rng.exponential(self.mean_session_s))
            self._add(pid, t, end)
            t = end + float(rng.exponential(self._gap_mean(pid, end)))
        self._horizon[pid] = t


class TraceAvailability(Availability):
    """Online windows read from a trace, repeated every ``period_s``."""

    def __init__(self, windows: list[list[tuple[float, float]]], period_s: float):
        super().__init__(len(windows))
        self.period_s = period_s
        self.windows: list[list[tuple[float, float]]] = []
        for spans in windows:  # touching windows merge, so a client online all period is always online
            merged: list[tuple[float, float]] = []
            for start, end in sorted(spans):
                if merged and start <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], end))
                else:
                    merged.append((start, end))
            self.windows.append(merged)
        self._cycle = [0] * len(windows)

    def _extend(self, pid: int) -> None:
        windows = self.windows[pid]
        if not windows:
            self._horizon[pid] = math.inf
            return
        if windows[0][0] <= 0 and windows[-1][1] >= self.period_s and len(windows) == 1:
            self._add(pid, 0.0, math.inf)  # online for the whole period, every period
            self._horizon[pid] = math.inf
            return
        base = self._cycle[pid] * self.period_s
        for start, end in windows:
            self._add(pid, base + start, base + end)
        self._cycle[pid] += 1
        self._horizon[pid] = base + self.period_s
