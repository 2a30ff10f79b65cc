"""The round engine: a round's :meth:`~RoundEngine.plan` and, from the clients' replies, its :meth:`~RoundEngine.settle`.

Pure Python/numpy. The transport (Flower messages, :mod:`fedelastic.fl.server`) only encodes a
:class:`Plan` for the clients and decodes their answers into :class:`Reply` objects.

* **plan**: the clients available at the clock's time (the profiles' seeded availability draw,
  or online windows; charged batteries), a seeded sample of them (the policy's sample size), the
  round's deadline and each client's :class:`~fedelastic.sim.policies.Assignment`.
* **settle**: every reply becomes a :class:`~fedelastic.sim.clock.Trip`; the policy closes the
  round; each client is charged the energy it spent (pro rata up to the close for a late or
  rejected one) and its idle wait; the counted updates (finite ones only) are FedNova-normalised
  when the policy cuts steps, and aggregated by the run's aggregator.
* **run_async**: FedBuff's loop on the clock (policy ``async``), launching clients through a callback.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cost.bands import trip_energy_band_j
from .aggregate import ClientUpdate, aggregate_buffered, aggregate_partial, fednova_rescale
from .clock import EXTRA, LATE, NO_UPDATE, Arrival, Trip
from .clock import run_async as clock_run_async
from .deadline import deadline_from_quantile
from .fleet import Fleet
from .policies import Assignment, Async, Policy, make_policy
from .records import COUNTED, FAILED, REJECTED, ClientRecord, RoundSummary, idle_rows, reported, summarize

_CHECKED_MAX = (
    1 << 22
)  # elements of one tensor's stacked updates that nonfinite_tensors checks in one call (16 MB of float32)


def nonfinite_tensors(replies: Sequence[Mapping[str, np.ndarray]]) -> list[set[str]]:
    """For each reply's arrays, the names of its floating tensors that hold a NaN or an inf.

    ``np.isfinite(value).all()`` per tensor per reply, with one numpy call per tensor for the
    replies whose copies of it agree in shape and dtype (stacked, at most ``_CHECKED_MAX``
    elements at once).
    """
    groups: dict[tuple[str, tuple[int, ...], str], list[int]] = {}
    for i, arrays in enumerate(replies):
        for name, value in arrays.items():
            if value.dtype.kind == "f":  # kind "f": np.floating
                groups.setdefault((name, value.shape, value.dtype.str), []).append(i)
    bad: list[set[str]] = [set() for _ in replies]
    for (name, shape, _), members in groups.items():
        step = max(1, _CHECKED_MAX // max(1, math.prod(shape)))
        for k in range(0, len(members), step):
            chunk = members[k : k + step]
            stacked = np.stack([replies[i][name] for i in chunk])
            for i, finite in zip(chunk, np.isfinite(stacked).reshape(len(chunk), -1).all(axis=1)):
                if not finite:
                    bad[i].add(name)
    return bad


def nonfinite_reason(metrics: Mapping, arrays: Mapping[str, np.ndarray], nonfinite: set[str]) -> str:
    """'' if a reply is finite, else why it is rejected (its first NaN/inf tensor, or its loss)."""
    loss = float(metrics["train-loss"])
    for name in arrays if nonfinite else ():  # the first in the reply's order, as the reply listed them
        if name in nonfinite:
            return f"non-finite update: tensor {name!r} holds NaN/inf (train loss {loss:g}); update rejected"
    if metrics["fits"] and int(metrics["steps"]) and not np.isfinite(loss):
        return f"non-finite update: train loss is {loss:g}; update rejected"
    return ""


def trip_energy_j(cost: Any, trip: Trip, until_s: float, metrics: Mapping) -> float:
    """Energy a trip spent up to ``until_s`` (or until it went offline), each phase pro rata
    (training: its MACs and its compute-bound seconds, energy by phase)."""
    down, train, up = trip.busy_until(until_s)
    share = lambda done, whole: done / whole if whole > 0 else 1.0  # noqa: E731
    moved = metrics["emulated-bytes-down"] * share(down, trip.down_s) + metrics["emulated-bytes-up"] * share(
        up, trip.up_s
    )
    trained = share(train, trip.train_s)
    return cost.energy_j(
        train, up, down, metrics["emulated-macs"] * trained, moved, metrics["emulated-compute-time-s"] * trained
    )


@dataclass
class Reply:
    """A client's answer, decoded: its figures (the wire's hyphenated keys), the arrays it trained
    and their channel masks, why its selection did not fit, and why it was rejected ('' : finite)."""

    pid: int
    metrics: dict
    arrays: Mapping[str, np.ndarray]
    masks: Mapping[str, np.ndarray] = field(default_factory=dict)
    fits_reason: str = ""
    rejected: str = ""


@dataclass
class Plan:
    """A synchronous round: its clients (ascending) and what each is asked (rho, step cap)."""

    round: int
    clients: list[int]
    deadline_s: float | None
    assignments: dict[int, Assignment]


Aggregate = Callable[[dict[str, np.ndarray], list[ClientUpdate]], dict[str, np.ndarray]]


class RoundEngine:
    """The simulation's rules for one run: its clock, its fleet's state, its policy and its totals."""

    def __init__(
        self, scenario: Any, fleet: Fleet, devices: list[str], tensor_names: Sequence[str],
        *, aggregate: Aggregate | None = None, warn: Callable[..., None] | None = None,
    ):  # fmt: skip
        self.sc, self.fleet, self.devices = scenario, fleet, devices
        self.policy: Policy = make_policy(scenario.server)
        self.tensor_names = set(tensor_names)
        self.aggregate: Aggregate = aggregate or (lambda current, updates: aggregate_partial(current, updates))
        self.warn = warn or logging.getLogger(__name__).warning
        self.sim_time_s = 0.0
        self.total_energy_j = 0.0
        self.summary = RoundSummary(policy=self.policy.name)  # round 0: the initial model
        self.deadline_s: float | None = None
        self.assignments: dict[int, Assignment] = {}
        self.unavailable = 0
        self._warned_no_steps = False

    # ---- plan ---------------------------------------------------------------------------------
    def sample(self, rnd: int) -> list[int]:
        """Partition ids trained in round ``rnd``: available devices, then a seeded sample of them.

        With the 'profile' availability model a device whose profile declares
        ``availability.probability = p`` is reachable in a round with probability p (a seeded draw
        per round and partition); with online windows, the devices online at the round's start.
        With batteries, only devices charged above their floor. If no device is online and
        charged, the clock first moves to the next time one is.
        """
        fleet, n = self.fleet, len(self.fleet)
        rng = np.random.default_rng([self.sc.seed, rnd, 0x5A])
        t = self.sim_time_s
        fleet.forget_before(t)
        if not any(fleet.online(p, t) and fleet.charged(p, t) for p in range(n)):
            t = min(fleet.ready_at(p, t) for p in range(n))
            if math.isinf(t):
                raise RuntimeError(f"no client is online and charged at {self.sim_time_s:.1f} s or later")
            self.sim_time_s = float(t)
        available = fleet.reachable(t, rng.random(n) if fleet.windows is None else None)
        self.unavailable = n - len(available)
        k = self.policy.sample_size(self.sc.server.clients_per_round or n, n)
        if k >= len(available):
            return available
        return sorted(rng.choice(available, size=k, replace=False).tolist())

    def plan(self, rnd: int) -> Plan:
        """Round ``rnd``'s clients, deadline (``server.deadline``, or the quantile of their full round times) and assignments."""
        chosen = self.sample(rnd)
        server = self.sc.server
        self.deadline_s = None
        if server.deadline > 0:
            self.deadline_s = server.deadline
        elif server.deadline_quantile > 0 and chosen:
            self.deadline_s = deadline_from_quantile(
                [self.fleet.full_round_s(p) for p in chosen], server.deadline_quantile
            )
        self.assignments = {p: self.policy.assign(p, self.deadline_s, self.fleet) for p in chosen}
        return Plan(rnd, chosen, self.deadline_s, self.assignments)

    # ---- settle -------------------------------------------------------------------------------
    def trip(self, reply: Reply, dispatch_s: float, version: int) -> Trip:
        """The reply's trip on the clock; a rejected (non-finite) update is waited for, but not used."""
        m, pid = reply.metrics, reply.pid
        down_s, up_s = self.fleet.comm_s(pid, m["emulated-bytes-down"], m["emulated-bytes-up"])
        return Trip(
            pid, dispatch_s, down_s, m["emulated-train-time-s"], up_s,
            offline_s=self.fleet.offline_at(pid, dispatch_s),
            version=version,
            carries_update=bool(m["fits"]) and not m["too-slow"] and not reply.rejected,
        )  # fmt: skip

    def record(
        self,
        rnd: int,
        reply: Reply,
        trip: Trip,
        status: str,
        energy: float,
        idle: float,
        staleness: int,
        error: str = "",
    ) -> ClientRecord:
        """The client's row: the figures it reported (:func:`~fedelastic.sim.records.reported`), and the engine's."""
        m, pid = reply.metrics, trip.partition_id
        profile = self.fleet.profiles[pid]
        a = self.assignments.get(pid, Assignment())
        if m["too-slow"]:
            status = "too_slow"
        elif not m["fits"]:
            status = "not_fitting"
        counted = status == COUNTED
        return ClientRecord(
            rnd, pid, self.devices[pid], profile.device_class, self.sc.train.strategy, bool(m["fits"]),
            **reported(m),
            emulated_train_time_s=trip.train_s,
            emulated_comm_time_s=trip.down_s + trip.up_s,
            emulated_energy_j=energy,
            emulated_idle_energy_j=idle,
            emulated_energy_band_j=trip_energy_band_j(profile, energy, idle, trip.train_s, m["emulated-train-time-band-s"]),
            device_memory_bytes=profile.memory_train_bytes.value,
            policy=self.policy.name,
            status=status,
            counted=counted,
            rho=a.rho,
            step_cap=a.step_cap,
            model_version=trip.version,
            staleness=staleness,
            dispatch_s=trip.dispatch_s,
            start_s=trip.start_s,
            finish_s=trip.finish_s,
            arrival_s=trip.arrival_s if trip.completes else float("nan"),
            wasted_energy_j=0.0 if counted else energy,
            uplink_bit_per_s=self.fleet.up_bps[pid],
            downlink_bit_per_s=self.fleet.down_bps[pid],
            battery_fraction=self.fleet.battery_fraction(pid, trip.dispatch_s),
            fits_reason=reply.fits_reason,
            error=error,
        )  # fmt: skip

    def failed(self, rnd: int, pid: int, reason: str) -> ClientRecord:
        """A failed client's row (an error, or no reply): nothing is silently dropped."""
        self.warn("client %s failed: %s", pid, reason)
        device = self.devices[pid] if pid >= 0 else ""
        device_class = self.fleet.profiles[pid].device_class if device else ""
        return ClientRecord.failed(rnd, pid, device, device_class, self.sc.train.strategy, self.policy.name, reason)

    def settle(
        self, rnd: int, replies: Sequence[Reply], failures: Mapping[int, str], current: dict[str, np.ndarray]
    ) -> tuple[list[ClientRecord], dict[str, np.ndarray]]:
        """Close round ``rnd`` from its replies (ascending partition id) and failures (partition -> why).

        Returns every client's row (the failed ones last, by partition) and the new global state;
        moves the clock to the round's end and adds the round's energy to the totals.
        """
        start = self.sim_time_s
        trips = [self.trip(r, start, rnd - 1) for r in replies]
        k = self.sc.server.clients_per_round or self.sc.num_clients
        end, status = self.policy.close(trips, start, self.deadline_s, k)
        rows = []
        for reply, trip in zip(replies, trips):
            state, bad = status[trip.partition_id], reply.rejected
            cost = self.fleet.costs[trip.partition_id]
            # a late or surplus client is told to stop when the round closes (a rejected one too)
            energy = trip_energy_j(cost, trip, end if state in (LATE, EXTRA) or bad else math.inf, reply.metrics)
            waited = end - trip.arrival_s if trip.completes and trip.arrival_s <= end else 0.0
            idle = cost.device.power_idle_w.value * waited
            if bad and state == NO_UPDATE:  # it arrived (a late one is not looked at: it is 'late')
                state = LATE if trip.arrival_s > end else REJECTED
            error = bad if state == REJECTED else ""
            rows.append(self.record(rnd, reply, trip, state, energy, idle, 0, error))
            self.fleet.drain(trip.partition_id, end, energy + idle)
        counted = [(reply, row) for reply, row in zip(replies, rows) if row.counted]
        updates = [self.update(r) for r, _ in counted]
        if self.sc.server.fednova and self.policy.renormalises():
            updates = fednova_rescale(current, updates, [int(row.steps) for _, row in counted], self.tensor_names)
        new_state = self.aggregate(current, updates)
        self.sim_time_s = float(end)  # plain floats: the checkpoint keeps them (torch weights_only load)
        self.summary = self.summarize(rows, len(failures), start, end)
        self.total_energy_j += float(self.summary.round_energy_j)
        return rows + [self.failed(rnd, p, why) for p, why in sorted(failures.items())], new_state

    @staticmethod
    def update(reply: Reply) -> ClientUpdate:
        """A counted reply's update, weighted by its number of examples."""
        return ClientUpdate(float(reply.metrics["num-examples"]), reply.arrays, reply.masks)

    def summarize(self, rows: list[ClientRecord], failed: int, start_s: float, end_s: float) -> RoundSummary:
        idle = idle_rows(rows)
        if idle and not self._warned_no_steps:
            self._warned_no_steps = True
            first = idle[0]
            self.warn(
                "%d client(s) in round %d trained nothing (0 steps), e.g. partition %d on %s: %s; "
                "they count as 'trained nothing', not as trained (warned once per run)",
                len(idle), first.round, first.partition_id, first.device,
                first.fits_reason or "no trainable step fits its budget",
            )  # fmt: skip
        return summarize(rows, failed, self.unavailable, self.policy.name, start_s, end_s, self.deadline_s)

    # ---- asynchronous rounds (FedBuff) ------------------------------------------------------------
    def run_async(
        self,
        initial: dict[str, np.ndarray],
        launch: Callable[[list[int], int, int, dict[str, np.ndarray]], tuple[list[Reply], dict[int, str]]],
        on_aggregate: Callable[[int, dict[str, np.ndarray], list[ClientRecord]], bool],
    ) -> list[ClientRecord]:
        """FedBuff on the clock: up to ``concurrency`` clients in flight, an aggregation every ``buffer_size`` arrivals.

        ``launch(ids, dispatch, version, state)`` trains clients ``ids`` from model ``version``,
        ``state`` (``dispatch``: the first of their unique dispatch numbers, the training seeds) and returns their replies and failures; ``on_aggregate(version, state,
        rows)`` receives each new model and the rows since the last one, and returns True to end the
        run there (a callback's stop). Returns the rows of the trips still in flight or buffered at
        the end (their work so far is wasted).
        """
        sc, n, policy = self.sc, len(self.fleet), self.policy
        assert isinstance(policy, Async)
        concurrency = policy.concurrency(sc.server.clients_per_round, n)
        buffer_size = policy.buffer_size(concurrency)
        discount = policy.discount()
        fleet, rng = self.fleet, np.random.default_rng([sc.seed, 0xA5])
        states = {0: initial}
        version, last_t, dispatched, failures = 0, 0.0, 0, 0
        replies: dict[Trip, Reply] = {}
        pending: list[ClientRecord] = []  # rows since the last aggregation

        def pick(t: float, busy: frozenset[int], free: int) -> tuple[list[int], float]:
            fleet.forget_before(t)
            idle = [p for p in range(n) if p not in busy]
            ready = [p for p in idle if fleet.online(p, t) and fleet.charged(p, t)]
            later = min((fleet.ready_at(p, t) for p in idle if p not in ready), default=math.inf)
            if fleet.windows is None:  # the profile's probability, drawn per dispatch; re-drawn a minute later
                draws = rng.random(len(idle))
                drawn = {p for p, d in zip(idle, draws) if d < fleet.probability[p]}
                if any(p not in drawn for p in ready):
                    later = min(later, t + 60.0)
                ready = [p for p in ready if p in drawn]
            self.unavailable = n - len(busy) - len(ready)
            if len(ready) > free:
                ready = sorted(rng.choice(ready, size=free, replace=False).tolist())
            return ready, later

        def start(ids: list[int], t: float, v: int) -> list[Trip]:
            nonlocal dispatched, failures
            got, failed = launch(ids, dispatched + 1, v, states[v])
            dispatched += len(ids)
            for p, why in sorted(failed.items()):
                failures += 1
                if failures > 10 * n + sc.server.rounds * buffer_size:
                    raise RuntimeError("asynchronous run: clients keep failing")
                pending.append(self.failed(version + 1, p, why))
            trips = []
            for reply in got:
                trip = self.trip(reply, t, v)
                replies[trip] = reply
                trips.append(trip)
            return trips

        def discard(trip: Trip, t: float, why: str) -> None:
            reply = replies.pop(trip)
            energy = trip_energy_j(fleet.costs[trip.partition_id], trip, t, reply.metrics)
            bad = reply.rejected
            why = REJECTED if bad and why == NO_UPDATE else why  # it arrived; a cancelled one was never looked at
            error = bad if why == REJECTED else ""
            pending.append(self.record(version + 1, reply, trip, why, energy, 0.0, version - trip.version, error))
            fleet.drain(trip.partition_id, t, energy)

        def aggregate(v: int, t: float, buffer: list[Arrival]) -> bool:
            nonlocal version, last_t
            rows, updates, bases, discounts = [], [], [], []
            for a in buffer:
                reply = replies.pop(a.trip)
                energy = trip_energy_j(fleet.costs[a.trip.partition_id], a.trip, math.inf, reply.metrics)
                rows.append(self.record(v, reply, a.trip, COUNTED, energy, 0.0, a.staleness))
                fleet.drain(a.trip.partition_id, a.trip.arrival_s, energy)
                updates.append(self.update(reply))
                bases.append(states[a.trip.version])
                discounts.append(discount(a.staleness))
            states[v] = aggregate_buffered(states[version], updates, bases, discounts)
            in_use = {trip.version for trip in replies} | {v}
            for old in [k for k in states if k not in in_use]:
                del states[old]
            rows = pending + rows
            pending.clear()
            self.deadline_s = None
            failed = sum(r.status == FAILED for r in rows)
            self.summary = self.summarize([r for r in rows if r.status != FAILED], failed, last_t, t)
            self.total_energy_j += float(self.summary.round_energy_j)
            self.sim_time_s, last_t, version = float(t), t, v
            return on_aggregate(v, states[v], rows)

        end = clock_run_async(
            concurrency=concurrency, buffer_size=buffer_size, aggregations=sc.server.rounds,
            pick=pick, launch=start, aggregate=aggregate, discard=discard,
        )  # fmt: skip
        for row in pending:  # updates still in flight or buffered at the end
            row.round = version
        self.total_energy_j += float(sum(r.emulated_energy_j for r in pending if r.status != FAILED))
        assert end == self.sim_time_s
        return pending
