"""Fleet dynamics, pure numpy: deadline budgets, availability windows and per-client links.

* **Deadline budgets.** A client with ``steps`` local steps, a full-training step time ``T``,
  a probe overhead ``P`` and a communication time ``C`` finishes full training in
  ``C + P + steps * T``. Under a deadline ``D`` it gets ``rho = (D - C - P) / (steps * T)``
  (at most 1), or, without elastic selection, ``floor((D - C) / T)`` steps.
* **Availability.** Each client is online during intervals of the simulated clock: generated
  sessions (exponential on/off, optionally diurnal) or a trace file. A client is asked whether
  it is online at ``t`` and when it next goes offline, as FedScale's ``is_active(t)`` does.
* **Network.** Each client's uplink and downlink are its profile's nominal figures times a
  factor drawn from a named distribution, or figures read from a trace file.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..costmodel import link_times_s
from ..errors import ConfigError

# ---- deadline budgets ------------------------------------------------------------------------


def local_steps(num_examples: int, batch_size: int, epochs: int, max_steps: int = 0) -> int:
    """Local steps of one round: ``epochs`` passes in batches, capped at ``max_steps`` (0: no cap)."""
    steps = epochs * math.ceil(num_examples / batch_size)
    return min(steps, max_steps) if max_steps else steps


def full_round_time_s(comm_s: float, steps: int, full_step_s: float, probe_s: float = 0.0) -> float:
    """Download, full local training (and its probes) and upload of one client."""
    return comm_s + probe_s + steps * full_step_s


def deadline_rho(deadline_s: float, comm_s: float, steps: int, full_step_s: float, probe_s: float = 0.0) -> float:
    """The step-time fraction that lets a client's round end by ``deadline_s`` (at most 1; <= 0: none)."""
    if steps <= 0:
        return 1.0
    return min(1.0, (deadline_s - comm_s - probe_s) / (steps * full_step_s))


def deadline_rho_steps(
    deadline_s: float, comm_s: float, steps: int, full_step_s: float, probe_s: float, min_rho: float
) -> tuple[float, int]:
    """Rho and steps when rho may not fall below ``min_rho``: fewer steps at ``min_rho`` or more instead.

    Elastic selection shortens only the backward pass, so a step never costs less than its forward
    share; past that point the only way to meet a deadline is fewer steps. Returns ``(rho, steps)``;
    ``steps = 0`` when not one step at ``min_rho`` fits.
    """
    rho = deadline_rho(deadline_s, comm_s, steps, full_step_s, probe_s)
    if rho >= min_rho or steps <= 0:
        return rho, steps
    budget = deadline_s - comm_s - probe_s
    fit = min(steps, math.floor(budget / (min_rho * full_step_s) + 1e-9))
    if fit <= 0:
        return rho, 0
    return min(1.0, budget / (fit * full_step_s)), fit


def deadline_steps(deadline_s: float, comm_s: float, full_step_s: float, steps: int) -> int:
    """How many full-training steps (at most ``steps``) fit before ``deadline_s``."""
    fit = math.floor((deadline_s - comm_s) / full_step_s + 1e-9)
    return int(min(steps, max(fit, 0)))


def deadline_from_quantile(full_times_s: list[float] | np.ndarray, quantile: float) -> float:
    """The deadline as a quantile of the sampled clients' full-training round times."""
    return float(np.quantile(np.asarray(full_times_s, float), quantile))


# ---- availability ----------------------------------------------------------------------------


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


TRACE_AVAILABILITY_COLUMNS = ("client_id", "start_s", "end_s")
TRACE_NETWORK_COLUMNS = ("client_id", "uplink_bit_per_s", "downlink_bit_per_s")


def _read_table(path: str | Path, columns: tuple[str, ...], what: str, src: str | None = None, key: str = ""):
    """The trace table at ``path``; a file that is missing or of another kind is an error naming the
    scenario ``src`` and its ``key`` (a fault inside the file names the file and the column)."""
    import pandas as pd

    path = Path(path)
    where, key = (src, key) if src else (str(path), "file")
    if not path.exists():
        raise ConfigError(where, key, f"an existing {what} file (.csv or .parquet)", str(path))
    if path.suffix == ".parquet":
        frame = pd.read_parquet(path)
    elif path.suffix == ".csv":
        frame = pd.read_csv(path)
    else:
        raise ConfigError(where, key, f"a {what} file ending in .csv or .parquet", str(path))
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ConfigError(path, missing[0], f"columns {list(columns)} (missing)", list(frame.columns))
    for col in columns[1:]:
        values = pd.to_numeric(frame[col], errors="coerce")
        bad = values.isna() | ~np.isfinite(values.fillna(-1)) | (values.fillna(-1) < 0)
        if bad.any():
            raise ConfigError(path, col, "finite non-negative numbers", frame[col][bad].iloc[0])
        frame[col] = values.astype(float)
    return frame


def load_availability_trace(
    path: str | Path, num_clients: int, period_s: float = 0.0, *, src: str | None = None
) -> TraceAvailability:
    """Read online windows from a CSV or Parquet file with columns ``client_id, start_s, end_s``.

    Clients are taken in sorted ``client_id`` order: partition ``p`` gets the ``p``-th one. The
    windows repeat every ``period_s`` (0: the largest ``end_s`` in the file).
    """
    frame = _read_table(path, TRACE_AVAILABILITY_COLUMNS, "availability trace", src, "availability.trace")
    bad = frame[frame.end_s <= frame.start_s]
    if len(bad):
        raise ConfigError(path, "end_s", "end_s > start_s in every row", f"row {bad.index[0] + 2}")
    ids = sorted(frame.client_id.unique(), key=str)
    if len(ids) < num_clients:
        raise ConfigError(path, "client_id", f"at least {num_clients} clients (the fleet's size)", len(ids))
    period = period_s or float(frame.end_s.max())
    if frame.end_s.max() > period:
        raise ConfigError(path, "end_s", f"windows within the period {period} s", float(frame.end_s.max()))
    windows = []
    for cid in ids[:num_clients]:
        rows = frame[frame.client_id == cid].sort_values("start_s")
        spans = list(zip(rows.start_s.tolist(), rows.end_s.tolist()))
        for (_, e0), (s1, _) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ConfigError(path, "start_s", f"non-overlapping windows for client {cid!r}", s1)
        windows.append(spans)
    return TraceAvailability(windows, period)


def fedscale_windows(traces: dict) -> list[tuple[object, float, float]]:
    """Online windows ``(client_id, start_s, end_s)`` from FedScale's client availability traces.

    FedScale keeps, per client, lists ``active`` and ``inactive`` (window ``i`` is
    ``[active[i], inactive[i]]``) repeating every ``finish_time`` seconds. Clients' periods differ;
    ours is one period for all, so each client's windows are repeated with its own period up to
    the longest ``finish_time`` and cut there (that becomes the trace's period).
    """
    horizon = max(float(t["finish_time"]) for t in traces.values())
    rows = []
    for cid, t in traces.items():
        period = float(t["finish_time"])
        if period <= 0 or len(t["active"]) != len(t["inactive"]):
            raise ValueError(f"FedScale trace of client {cid!r}: needs finish_time > 0 and as many active as inactive")
        base = 0.0
        while base < horizon:
            for start, end in zip(t["active"], t["inactive"]):
                lo, hi = base + float(start), min(base + float(end), horizon)
                if hi > lo:
                    rows.append((cid, lo, hi))
            base += period
    return rows


def import_fedscale_availability(pickle_path: str | Path, out_path: str | Path) -> float:
    """Convert a FedScale availability pickle (``{client_id: {active, inactive, finish_time}}``) to our CSV/Parquet.

    Returns the period (the longest ``finish_time``): give it as ``[availability] period_s``, since
    the last window in the file may end before it. Unpickling runs code from the file: use it
    only on files you trust.
    """
    import pickle

    import pandas as pd

    with open(pickle_path, "rb") as fh:
        traces = pickle.load(fh)  # noqa: S301 - a file the user chose to import
    frame = pd.DataFrame(fedscale_windows(traces), columns=list(TRACE_AVAILABILITY_COLUMNS))
    out_path = Path(out_path)
    frame.to_parquet(out_path, index=False) if out_path.suffix == ".parquet" else frame.to_csv(out_path, index=False)
    return max(float(t["finish_time"]) for t in traces.values())


# ---- battery ---------------------------------------------------------------------------------


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


# ---- network ---------------------------------------------------------------------------------


def link_factors(distribution: str, num_clients: int, seed: int, sigma: float) -> np.ndarray:
    """Per-client multipliers of the nominal link rates (one factor per client, up and down alike).

    ``lognormal``: median 1 and log-standard deviation ``sigma`` (0.7 spreads the middle 90% of
    users over a factor of 10); ``nominal``: all ones.
    """
    if distribution == "nominal":
        return np.ones(num_clients)
    return np.random.default_rng([seed, 0x11E7]).lognormal(0.0, sigma, num_clients)


def load_network_trace(path: str | Path, num_clients: int, *, src: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(uplink, downlink) in bit/s per partition, from columns ``client_id, uplink_bit_per_s, downlink_bit_per_s``."""
    frame = _read_table(path, TRACE_NETWORK_COLUMNS, "network trace", src, "network.trace")
    if frame.client_id.duplicated().any():
        raise ConfigError(
            path, "client_id", "one row per client", frame.client_id[frame.client_id.duplicated()].iloc[0]
        )
    frame = frame.sort_values("client_id", key=lambda c: c.astype(str))
    if len(frame) < num_clients:
        raise ConfigError(path, "client_id", f"at least {num_clients} clients (the fleet's size)", len(frame))
    if (frame.uplink_bit_per_s[:num_clients] <= 0).any() or (frame.downlink_bit_per_s[:num_clients] <= 0).any():
        raise ConfigError(path, "uplink_bit_per_s", "positive link rates")
    return (
        frame.uplink_bit_per_s.to_numpy()[:num_clients].copy(),
        frame.downlink_bit_per_s.to_numpy()[:num_clients].copy(),
    )


# ---- a run's fleet ---------------------------------------------------------------------------


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
