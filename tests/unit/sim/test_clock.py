"""The simulated clock and the fleet's dynamics, against hand computations."""

import math

import numpy as np
import pandas as pd
import pytest

from fedelastic.errors import ConfigError
from fedelastic.sim.availability import SessionAvailability, TraceAvailability
from fedelastic.sim.clock import Trip, run_async, staleness_weight, sync_round
from fedelastic.sim.deadline import (
    deadline_from_quantile,
    deadline_rho,
    deadline_rho_steps,
    deadline_steps,
    local_steps,
)
from fedelastic.sim.network import link_factors
from fedelastic.sim.traces import load_availability_trace, load_network_trace

# three clients dispatched at t = 100: (down, train, up) seconds
A = Trip(0, 100.0, 1.0, 4.0, 1.0)  # arrives 106
B = Trip(1, 100.0, 2.0, 10.0, 2.0)  # arrives 114
C = Trip(2, 100.0, 0.5, 2.0, 0.5)  # arrives 103


def test_three_client_synchronous_round():
    assert (B.start_s, B.finish_s, B.arrival_s) == (102.0, 112.0, 114.0)
    end, status = sync_round([A, B, C], 100.0)
    assert end == 114.0 and status == {0: "counted", 1: "counted", 2: "counted"}


def test_deadline_round():
    end, status = sync_round([A, B, C], 100.0, deadline_s=8.0)
    assert end == 108.0  # B has not arrived: the server waits until the deadline
    assert status == {0: "counted", 1: "late", 2: "counted"}
    assert B.busy_until(108.0) == (2.0, 6.0, 0.0)  # B's work so far, wasted
    end, _ = sync_round([A, C], 100.0, deadline_s=8.0)
    assert end == 106.0  # everyone is in before the deadline: no need to wait for it


def test_offline_client_sends_nothing_and_over_commitment_keeps_the_first():
    c_off = Trip(2, 100.0, 0.5, 2.0, 0.5, offline_s=102.0)
    end, status = sync_round([A, B, c_off], 100.0)
    assert end == 114.0 and status[2] == "offline"
    assert c_off.busy_until(200.0) == (0.5, 1.5, 0.0)
    end, status = sync_round([A, B, C], 100.0, keep_first=2)
    assert end == 106.0 and status == {0: "counted", 1: "extra", 2: "counted"}
    silent = Trip(1, 100.0, 2.0, 0.0, 0.1, carries_update=False)  # too slow: reports at 102.1
    end, status = sync_round([A, silent], 100.0)
    assert end == 106.0 and status[1] == "no_update"


def test_async_buffer_by_hand():
    # concurrency 2, buffer 2, clients 0, 1, 2 take 3, 5, 4 s; the least-dispatched idle client goes first.
    durations = {0: 3.0, 1: 5.0, 2: 4.0}
    dispatched = {0: 0, 1: 0, 2: 0}
    log, aggregations, discarded = [], [], []

    def pick(t, busy, free):
        idle = sorted((p for p in durations if p not in busy), key=lambda p: (dispatched[p], p))
        return idle[:free], math.inf

    def launch(ids, t, version):
        for p in ids:
            dispatched[p] += 1
            log.append((t, p, version))
        return [Trip(p, t, 0.0, durations[p], 0.0, version=version) for p in ids]

    def aggregate(version, t, buffer):
        aggregations.append((version, t, [(a.trip.partition_id, a.staleness) for a in buffer]))

    end = run_async(
        concurrency=2,
        buffer_size=2,
        aggregations=2,
        pick=pick,
        launch=launch,
        aggregate=aggregate,
        discard=lambda trip, t, why: discarded.append((trip.partition_id, t, why)),
    )
    assert log == [(0.0, 0, 0), (0.0, 1, 0), (3.0, 2, 0), (5.0, 0, 1), (7.0, 1, 1)]
    assert aggregations == [(1, 5.0, [(0, 0), (1, 0)]), (2, 8.0, [(2, 1), (0, 0)])]
    assert discarded == [(1, 8.0, "cancelled")] and end == 8.0


def test_async_stops_at_the_aggregation_that_asks_and_cancels_the_trips_in_flight():
    # as test_async_buffer_by_hand: 0 and 1 arrive at 3 and 5 (aggregation 1, which asks to stop);
    # 2, dispatched at 3 when 0 returned, is still in flight (until 7): cancelled at 5, nothing sent after
    durations = {0: 3.0, 1: 5.0, 2: 4.0}
    log, aggregations, discarded = [], [], []

    def pick(t, busy, free):
        return sorted(p for p in durations if p not in busy and p not in {q for _, q, _ in log})[:free], math.inf

    def launch(ids, t, version):
        log.extend((t, p, version) for p in ids)
        return [Trip(p, t, 0.0, durations[p], 0.0, version=version) for p in ids]

    def aggregate(version, t, buffer):
        aggregations.append((version, t, [a.trip.partition_id for a in buffer]))
        return True

    end = run_async(
        concurrency=2, buffer_size=2, aggregations=5, pick=pick, launch=launch, aggregate=aggregate,
        discard=lambda trip, t, why: discarded.append((trip.partition_id, t, why)),
    )  # fmt: skip
    assert log == [(0.0, 0, 0), (0.0, 1, 0), (3.0, 2, 0)] and aggregations == [(1, 5.0, [0, 1])]
    assert discarded == [(2, 5.0, "cancelled")] and end == 5.0


def test_async_waits_for_a_client_to_come_online():
    online_from = {0: 0.0, 1: 10.0}
    launched = []

    def pick(t, busy, free):
        ready = [p for p in online_from if online_from[p] <= t and p not in busy][:free]
        later = [online_from[p] for p in online_from if online_from[p] > t]
        return ready, min(later, default=math.inf)

    def launch(ids, t, version):
        launched.extend((t, p) for p in ids)
        return [Trip(p, t, 0.0, 30.0, 0.0, version=version) for p in ids]

    end = run_async(
        concurrency=2, buffer_size=2, aggregations=1, pick=pick, launch=launch,
        aggregate=lambda *a: None, discard=lambda *a: None,
    )  # fmt: skip
    # 0 is dispatched again when it returns at 30; 1, online from 10, completes the buffer at 40
    assert launched == [(0.0, 0), (10.0, 1), (30.0, 0)] and end == 40.0


def test_staleness_weights():
    assert [staleness_weight(s) for s in (0, 3, 8)] == pytest.approx([1.0, 0.5, 1 / 3])


def test_rho_and_steps_from_the_deadline():
    # deadline 8 s, 2 s of communication, 2 s of probes, 4 steps of 1.5 s: (8 - 2 - 2) / 6
    assert deadline_rho(8.0, 2.0, 4, 1.5, probe_s=2.0) == pytest.approx(2 / 3)
    assert deadline_rho(20.0, 2.0, 4, 1.5) == 1.0  # never more than full training
    assert deadline_rho(3.0, 2.0, 4, 1.5, probe_s=2.0) < 0  # not even the probe fits
    # rho may not go below 0.8: 4 s of budget / (0.8 * 1.5 s) -> 3 steps, at rho 4 / (3 * 1.5)
    assert deadline_rho_steps(8.0, 2.0, 4, 1.5, 2.0, min_rho=0.8) == (pytest.approx(4 / 4.5), 3)
    assert deadline_rho_steps(8.0, 2.0, 4, 1.5, 2.0, min_rho=0.5) == (pytest.approx(2 / 3), 4)
    assert deadline_rho_steps(4.5, 2.0, 4, 1.5, 2.0, min_rho=0.5)[1] == 0  # 0.5 s left < one step at 0.75 s
    assert deadline_steps(7.0, 2.0, 1.5, 4) == 3  # floor(5 / 1.5)
    assert deadline_steps(8.0, 2.0, 1.5, 4) == 4
    assert deadline_steps(1.0, 2.0, 1.5, 4) == 0
    assert local_steps(50, 16, 2) == 8 and local_steps(50, 16, 2, max_steps=3) == 3
    assert deadline_from_quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5


def test_trace_windows_repeat_and_merge_across_the_period():
    av = TraceAvailability([[(0.0, 10.0), (20.0, 30.0)], [(0.0, 40.0)], [(0.0, 5.0), (30.0, 40.0)]], 40.0)
    assert av.online(0, 5.0) and not av.online(0, 15.0) and not av.online(0, 39.0)
    assert av.offline_at(0, 5.0) == 10.0 and av.offline_at(0, 15.0) == 15.0
    assert av.next_online(0, 15.0) == 20.0 and av.next_online(0, 35.0) == 40.0
    assert av.offline_at(0, 45.0) == 50.0
    assert av.offline_at(1, 123.0) == math.inf
    assert av.offline_at(2, 35.0) == 45.0  # online from 30 until 5 s into the next period


def test_sessions_are_online_the_stationary_share_and_reproducible():
    av = SessionAvailability(400, seed=1, mean_session_s=600.0, mean_offline_s=1800.0)
    times = np.linspace(0, 50_000, 40)
    share = np.mean([[av.online(p, t) for t in times] for p in range(400)])
    assert share == pytest.approx(0.25, abs=0.03)
    again = SessionAvailability(400, seed=1, mean_session_s=600.0, mean_offline_s=1800.0)
    assert [again.offline_at(p, 1000.0) for p in range(50)] == [av.offline_at(p, 1000.0) for p in range(50)]
    # mean online session length, measured from the generated windows
    lengths = [av.offline_at(p, t) - t for p in range(400) for t in [av.next_online(p, 20_000.0)]]
    assert np.mean(lengths) == pytest.approx(600.0, rel=0.1)


def test_availability_trace_import(tmp_path):
    path = tmp_path / "avail.csv"
    pd.DataFrame({"client_id": ["b", "a", "a", "c"], "start_s": [5, 0, 50, 0], "end_s": [15, 20, 100, 100]}).to_csv(
        path, index=False
    )
    av = load_availability_trace(path, 2)  # partitions 0, 1 <- clients a, b
    assert av.period_s == 100.0 and av.offline_at(0, 60.0) == 100.0 + 20.0 and av.next_online(1, 0.0) == 5.0
    pq = tmp_path / "avail.parquet"
    pd.read_csv(path).to_parquet(pq)
    assert load_availability_trace(pq, 2).windows == av.windows
    with pytest.raises(ConfigError, match="at least 4 clients"):
        load_availability_trace(path, 4)
    pd.DataFrame({"client_id": [1], "start_s": [5], "end_s": [2]}).to_csv(path, index=False)
    with pytest.raises(ConfigError, match="end_s"):
        load_availability_trace(path, 1)
    pd.DataFrame({"client_id": [1, 1], "start_s": [0, 5], "end_s": [10, 20]}).to_csv(path, index=False)
    with pytest.raises(ConfigError, match="non-overlapping"):
        load_availability_trace(path, 1)
    pd.DataFrame({"client_id": [1], "begin": [0]}).to_csv(path, index=False)
    with pytest.raises(ConfigError, match="start_s"):
        load_availability_trace(path, 1)


def test_network_factors_and_trace(tmp_path):
    f = link_factors("lognormal", 20_000, seed=0, sigma=0.7)
    assert np.median(f) == pytest.approx(1.0, rel=0.03)
    assert np.quantile(f, 0.95) / np.quantile(f, 0.05) == pytest.approx(math.exp(2 * 1.6449 * 0.7), rel=0.06)
    assert (link_factors("nominal", 3, 0, 0.7) == 1).all()
    path = tmp_path / "net.csv"
    pd.DataFrame({"client_id": [2, 1], "uplink_bit_per_s": [1e6, 2e6], "downlink_bit_per_s": [5e6, 8e6]}).to_csv(
        path, index=False
    )
    up, down = load_network_trace(path, 2)
    assert up.tolist() == [2e6, 1e6] and down.tolist() == [8e6, 5e6]
    pd.DataFrame({"client_id": [1], "uplink_bit_per_s": ["fast"], "downlink_bit_per_s": [1]}).to_csv(path, index=False)
    with pytest.raises(ConfigError, match="uplink_bit_per_s"):
        load_network_trace(path, 1)


def test_async_handles_simultaneous_arrivals_before_dispatching():
    log = []

    def launch(ids, t, version):
        log.extend((t, p, version) for p in ids)
        return [Trip(p, t, 0.0, 2.0, 0.0, version=version) for p in ids]

    def pick(t, busy, free):
        return [p for p in range(3) if p not in busy][:free], math.inf

    run_async(
        concurrency=2, buffer_size=2, aggregations=2, pick=pick, launch=launch,
        aggregate=lambda *a: None, discard=lambda *a: None,
    )  # fmt: skip
    # 0 and 1 both arrive at 2 s: the aggregation comes first, so both new trips train on version 1
    assert log == [(0.0, 0, 0), (0.0, 1, 0), (2.0, 0, 1), (2.0, 1, 1)]


def test_fedscale_availability_import(tmp_path):
    import pickle

    from fedelastic.sim.traces import import_fedscale_availability

    traces = {
        7: {"active": [0, 30], "inactive": [10, 35], "finish_time": 40},
        3: {"active": [5], "inactive": [25], "finish_time": 100},
    }
    (tmp_path / "fs.pkl").write_bytes(pickle.dumps(traces))
    period = import_fedscale_availability(tmp_path / "fs.pkl", tmp_path / "av.csv")
    assert period == 100.0 and len(pd.read_csv(tmp_path / "av.csv")) == 6  # 5 windows of client 7, 1 of client 3
    av = load_availability_trace(tmp_path / "av.csv", 2, period)  # partition 0 <- client 3, 1 <- client 7
    # client 7 repeats every 40 s within the 100 s period: windows 0-10, 30-35, 40-50, 70-75, 80-90
    assert av.windows[1] == [(0.0, 10.0), (30.0, 35.0), (40.0, 50.0), (70.0, 75.0), (80.0, 90.0)]
    assert av.offline_at(0, 10.0) == 25.0 and av.next_online(0, 30.0) == 105.0


def test_battery_drains_refuses_and_recharges_on_schedule():
    from fedelastic.sim.battery import Batteries

    # 100 J, refuses below 30%, charges at 2 W from 60 s to 80 s of every 100 s day
    b = Batteries(
        2, capacity_j=100.0, min_fraction=0.3, recharge_w=2.0, charge_from_s=60.0, charge_until_s=80.0, day_s=100.0
    )
    b.drain(0, 10.0, 75.0)
    assert b.fraction(0, 10.0) == 0.25 and not b.can_train(0, 50.0)  # nothing charged before 60 s
    assert b.fraction(0, 65.0) == pytest.approx(0.35)  # 5 s plugged in at 2 W
    assert b.can_train(0, 65.0) and b.fraction(0, 170.0) == pytest.approx(0.25 + 0.4 + 0.2)  # 20 s + 10 s
    assert b.fraction(0, 1000.0) == 1.0 and b.fraction(1, 5.0) == 1.0  # never above capacity; others untouched
    b.drain(0, 1010.0, 90.0)  # 10 J left: 20 J (10 s plugged) short of 30%
    assert b.ready_at(0, 1010.0) == 1070.0 and b.ready_at(0, 2000.0) == 2000.0 and b.ready_at(1, 7.0) == 7.0
    b.drain(0, 1010.0, 10.0)  # empty: 30 J = 15 s plugged, 20 s of them on day 10, so 15 s into day 10's window
    assert b.ready_at(0, 1010.0) == 1075.0
    b.drain(1, 1075.0, 100.0)  # 30 J more than the 5 s left in day 10's window: 10 s into day 11's
    assert b.ready_at(1, 1075.0) == 1170.0
