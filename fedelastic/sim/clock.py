"""The simulated clock: every client's trip (download, local training, upload) on one timeline.

Pure Python/numpy, no Flower: the server glue turns each reply into a :class:`Trip` and these
functions decide, in simulated-time order, which trips count and when the server moves on.

* A trip dispatched at ``dispatch_s`` starts training after its download, finishes training,
  then arrives after its upload. A client that goes offline (``offline_s``) before it arrives
  sends nothing; the server learns of it at ``offline_s``.
* :func:`sync_round` closes a synchronous round: every trip, or those in time for a deadline,
  or the first ``keep_first`` arrivals (over-commitment).
* :func:`run_async` is FedBuff's loop: up to ``concurrency`` clients in flight, one aggregation
  every ``buffer_size`` arrivals, each weighted by :func:`staleness_weight`.

Ties are broken by partition id, so the clock is deterministic for a seed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

COUNTED, LATE, OFFLINE, EXTRA, NO_UPDATE, CANCELLED = "counted", "late", "offline", "extra", "no_update", "cancelled"


@dataclass(frozen=True)
class Trip:
    """One client's work on the clock; times in simulated seconds."""

    partition_id: int
    dispatch_s: float
    down_s: float
    train_s: float
    up_s: float
    offline_s: float = math.inf  # when the client next goes offline after dispatch
    version: int = 0  # the model version it trains on
    carries_update: bool = True  # False: it reports that it trained nothing (too slow, did not fit, failed)

    @property
    def start_s(self) -> float:
        return self.dispatch_s + self.down_s

    @property
    def finish_s(self) -> float:
        return self.start_s + self.train_s

    @property
    def arrival_s(self) -> float:
        return self.finish_s + self.up_s

    @property
    def completes(self) -> bool:
        """Whether its reply reaches the server (it stays online until it has uploaded)."""
        return self.arrival_s <= self.offline_s

    @property
    def end_s(self) -> float:
        """When the server learns how the trip ended: its arrival, or its going offline."""
        return min(self.arrival_s, self.offline_s)

    def busy_until(self, t: float) -> tuple[float, float, float]:
        """Seconds spent downloading, training and uploading up to time ``t`` (and before it went offline)."""
        t = min(t, self.offline_s)
        down = min(max(t - self.dispatch_s, 0.0), self.down_s)
        train = min(max(t - self.start_s, 0.0), self.train_s)
        up = min(max(t - self.finish_s, 0.0), self.up_s)
        return down, train, up


def sync_round(
    trips: Sequence[Trip], start_s: float, deadline_s: float | None = None, keep_first: int | None = None
) -> tuple[float, dict[int, str]]:
    """End time of a synchronous round and the status of each trip (by partition id).

    Updates arriving by ``start_s + deadline_s`` count (all of them without a deadline), at most
    the first ``keep_first`` of them. The round ends when the server has heard from every trip,
    at the deadline, or at the ``keep_first``-th counted arrival, whichever comes first.
    """
    # a trip planned to end exactly at the deadline is in time (its times are summed in another order)
    cutoff = (start_s + deadline_s) * (1 + 1e-12) if deadline_s is not None else math.inf
    arrived = sorted(
        (t for t in trips if t.completes and t.carries_update), key=lambda t: (t.arrival_s, t.partition_id)
    )
    in_time = [t for t in arrived if t.arrival_s <= cutoff]
    counted = in_time[:keep_first] if keep_first is not None else in_time
    counted_ids = {t.partition_id for t in counted}
    status = {}
    for t in trips:
        if not t.completes:
            status[t.partition_id] = OFFLINE
        elif not t.carries_update:
            status[t.partition_id] = NO_UPDATE
        elif t.partition_id in counted_ids:
            status[t.partition_id] = COUNTED
        elif t.arrival_s > cutoff:
            status[t.partition_id] = LATE
        else:
            status[t.partition_id] = EXTRA
    if keep_first is not None and len(counted) == keep_first:
        end = counted[-1].arrival_s
    else:
        end = max((t.end_s for t in trips), default=start_s)
        if deadline_s is not None and end > cutoff:
            end = start_s + deadline_s
    return max(end, start_s), status


def staleness_weight(staleness: int) -> float:
    """FedBuff's polynomial staleness discount ``1 / sqrt(1 + s)``."""
    return 1.0 / math.sqrt(1.0 + staleness)


@dataclass(frozen=True)
class Arrival:
    """A trip that reached the server in an asynchronous run."""

    trip: Trip
    staleness: int  # model versions aggregated between its dispatch and its arrival


def run_async(
    *,
    concurrency: int,
    buffer_size: int,
    aggregations: int,
    pick: Callable[[float, frozenset[int], int], tuple[list[int], float]],
    launch: Callable[[list[int], float, int], list[Trip]],
    aggregate: Callable[[int, float, list[Arrival]], bool],
    discard: Callable[[Trip, float, str], None],
) -> float:
    """FedBuff on the clock; returns the time of the last aggregation.

    ``pick(t, busy, free)`` names up to ``free`` idle clients to dispatch at ``t`` and the next
    time another could come online (``inf`` if never); ``launch(ids, t, version)`` runs them and
    returns their trips; ``aggregate(version, t, buffer)`` makes model ``version`` from a full
    buffer (True: the run stops there); ``discard(trip, t, status)`` takes every trip whose update is not used (``offline``,
    ``no_update``, or ``cancelled``: still in flight when the run ends). Events at the same
    instant are all handled before new clients are dispatched.
    """
    t, version, seq = 0.0, 0, 0
    events: list[tuple[float, int, int, Trip | None]] = []  # (time, partition id or -1 for a wake-up, seq, trip)
    busy: set[int] = set()
    buffer: list[Arrival] = []
    wake_at = math.inf

    def fill(now: float) -> None:
        nonlocal seq, wake_at
        free = concurrency - len(busy)
        if free <= 0:
            return
        ids, next_online = pick(now, frozenset(busy), free)
        for trip in launch(ids, now, version) if ids else []:
            busy.add(trip.partition_id)
            heapq.heappush(events, (trip.end_s, trip.partition_id, seq, trip))
            seq += 1
        if len(busy) < concurrency and now < next_online < wake_at:
            wake_at = next_online
            heapq.heappush(events, (next_online, -1, seq, None))
            seq += 1

    fill(t)
    stopped = False
    while version < aggregations and not stopped:
        if not events:
            raise RuntimeError(f"asynchronous run stalled at {t:.1f} s: no client is or will be online")
        t, _, _, trip = heapq.heappop(events)
        if trip is None:
            if t >= wake_at:
                wake_at = math.inf
        else:
            busy.discard(trip.partition_id)
            if not trip.completes:
                discard(trip, t, OFFLINE)
            elif not trip.carries_update:
                discard(trip, t, NO_UPDATE)
            else:
                buffer.append(Arrival(trip, version - trip.version))
                if len(buffer) == buffer_size:
                    version += 1
                    stopped = aggregate(version, t, buffer)
                    buffer = []
        if version < aggregations and not stopped and not (events and events[0][0] == t):
            fill(t)  # after every event at this instant: clients dispatched now get the newest model
    for _, _, _, trip in sorted(events):
        if trip is not None:
            discard(trip, t, CANCELLED)
    for arrival in buffer:
        discard(arrival.trip, t, CANCELLED)
    return t
