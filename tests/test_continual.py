"""Continual streams: metrics against hand computations, buffers, drift onsets, and in-process runs."""

import json

import numpy as np
import pandas as pd
import pytest

from fedelastic.continual import summarise
from fedelastic.data import ArrayDataset, FederatedData
from fedelastic.data.shifts import Shift
from fedelastic.data.stream import Stream, StreamConfig, domain_at, domain_onsets, replay_buffer, segments
from fedelastic.errors import ConfigError
from fedelastic.fl.runner import run_scenario


def test_two_task_metrics_by_hand():
    R = np.array([[0.1, 0.2], [0.5, 0.1], [0.8, 0.3], [0.6, 0.5], [0.6, 0.9]])
    clock = np.array([0.0, 1.0, 3.0, 6.0, 10.0])
    s = summarise(R, [1, 3], clock, recover_share=0.9)
    assert s["final_accuracy"] == pytest.approx(0.75)
    assert s["average_accuracy"] == pytest.approx((0.8 + 0.75) / 2)
    assert s["backward_transfer"] == pytest.approx(0.6 - 0.8)
    assert s["forgetting"] == pytest.approx(0.8 - 0.6)
    assert s["forward_transfer"] == pytest.approx(0.3 - 0.2)
    (shift,) = s["shifts"]
    # target 0.9 * R[2, 0] = 0.72; R[t, 1] for t >= 2 is 0.3, 0.5, 0.9: reached in round 4
    assert shift["target_accuracy"] == pytest.approx(0.72)
    assert shift["recovered_round"] == 4 and shift["rounds_to_recover"] == 2
    assert shift["time_to_recover_s"] == pytest.approx(10.0 - 3.0)


def test_three_task_metrics_by_hand_and_a_shift_never_recovered():
    R = np.array([[0, 0, 0], [0.9, 0.1, 0.0], [0.5, 0.8, 0.2], [0.7, 0.4, 0.6]])
    s = summarise(R, [1, 2, 3], np.arange(4.0), recover_share=0.8)
    assert s["forgetting"] == pytest.approx(((0.9 - 0.7) + (0.8 - 0.4)) / 2)
    assert s["backward_transfer"] == pytest.approx(((0.7 - 0.9) + (0.4 - 0.8)) / 2)
    assert s["forward_transfer"] == pytest.approx(((0.1 - 0) + (0.2 - 0)) / 2)
    assert s["average_accuracy"] == pytest.approx((0.9 + (0.5 + 0.8) / 2 + (0.7 + 0.4 + 0.6) / 3) / 3)
    assert s["final_accuracy"] == pytest.approx((0.7 + 0.4 + 0.6) / 3)
    first, second = s["shifts"]
    assert first["rounds_to_recover"] == 1  # target 0.8 * R[1, 0] = 0.72; R[1, 1] = 0.1, R[2, 1] = 0.8
    assert np.isnan(second["time_to_recover_s"])  # target 0.8 * R[2, 1] = 0.64; R[2, 2] = 0.2, R[3, 2] = 0.6


def test_fifo_keeps_the_newest_items():
    arrivals = [np.array([[i, 0], [i + 10, 0]]) for i in range(5)]
    kept = replay_buffer(arrivals, 3, "fifo", np.random.default_rng(0))
    assert kept[:, 0].tolist() == [13, 4, 14]


def test_reservoir_keeps_every_item_with_equal_probability():
    n, size, trials = 60, 6, 3000
    counts = np.zeros(n)
    arrivals = [np.array([[i, 0] for i in range(r * 6, r * 6 + 6)]) for r in range(10)]
    for t in range(trials):
        kept = replay_buffer(arrivals, size, "reservoir", np.random.default_rng(t))
        assert len(kept) == size and len(np.unique(kept[:, 0])) == size
        counts[kept[:, 0]] += 1
    share = counts / trials  # each item kept with probability size / n = 0.1 (binomial sd ~ 0.0055)
    assert np.abs(share - size / n).max() < 0.025


def test_drift_onsets_are_per_client_seeded_and_bounded():
    cfg = StreamConfig(domains=(Shift(), Shift(rotation=15), Shift(rotation=30)), domain_rounds=5, onset_jitter=3)
    onsets = np.array([domain_onsets(cfg, seed=0, client=c) for c in range(40)])
    assert ((onsets[:, 0] >= 6) & (onsets[:, 0] <= 9)).all() and ((onsets[:, 1] >= 11) & (onsets[:, 1] <= 14)).all()
    assert len(np.unique(onsets[:, 0])) > 1  # not synchronised
    np.testing.assert_array_equal(onsets[3], domain_onsets(cfg, seed=0, client=3))
    c = 7
    assert [domain_at(cfg, 0, c, r) for r in (1, onsets[c, 0] - 1, onsets[c, 0], onsets[c, 1])] == [0, 0, 1, 2]


def test_segments_start_at_every_task_or_domain_change():
    cfg = StreamConfig(tasks=((0, 1), (2, 3)), task_rounds=4, domains=(Shift(), Shift(rotation=90)), domain_rounds=6)
    segs = segments(cfg, rounds=10, all_classes=(0, 1, 2, 3))
    assert [(s.start, s.task, s.domain) for s in segs] == [(1, 0, 0), (5, 1, 0), (7, 1, 1)]
    assert segs[2].classes == (2, 3) and segs[2].shift.rotation == 90


def _toy_data():
    rng = np.random.default_rng(0)
    x = rng.random((40, 1, 4, 4)).astype(np.float32)
    y = np.repeat(np.arange(4), 10)
    return FederatedData(
        ArrayDataset(x, y), ArrayDataset(x.copy(), y.copy()), [np.arange(0, 40, 2), np.arange(1, 40, 2)]
    )


def test_class_incremental_buffer_holds_the_current_task_and_items_keep_their_domain():
    data = _toy_data()
    cfg = StreamConfig(
        tasks=((0, 1), (2, 3)),
        task_rounds=3,
        domains=(Shift(), Shift(rotation=90)),
        domain_rounds=4,
        samples_per_round=4,
        buffer_size=6,
        buffer_policy="fifo",
    )
    stream = Stream(cfg, data, rounds=8, seed=0)
    for r in (1, 2, 3):
        assert set(data.train.y[stream.buffer(0, r)[:, 0]]) <= {0, 1}
    assert set(data.train.y[stream.buffer(1, 7)[:, 0]]) <= {2, 3}
    items = stream.buffer(0, 5)  # round 4 in domain 0 (last two of its 4), round 5 in domain 1 (its 4)
    assert items[:, 1].tolist() == [0, 0, 1, 1, 1, 1]
    ds = stream.client_data(0, 5)
    np.testing.assert_allclose(ds.x[:2], data.train.x[items[:2, 0]])
    np.testing.assert_allclose(ds.x[2:], np.rot90(data.train.x[items[2:, 0]], 1, axes=(2, 3)), atol=1e-5)
    assert all(np.isin(data.train.y[p], [0, 1, 2, 3]).all() for p in data.partitions)


def test_a_task_with_unknown_labels_is_an_error():
    with pytest.raises(ValueError, match=r"stream.tasks\[1\]"):
        Stream(StreamConfig(tasks=((0,), (9,))), _toy_data(), rounds=4, seed=0)


ONE = {"raspberry_pi_4": 0, "jetson_nano": 1, "stm32h743": 0}  # the fixture merges fleets
STREAM = {
    "tasks": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]],
    "task_rounds": 2,
    "domains": [{}, {"rotation": 90}],
    "domain_rounds": 3,
    "onset_jitter": 1,
    "samples_per_round": 16,
    "buffer_size": 32,
    "eval_samples": 60,
}


def test_a_continual_run_writes_the_accuracy_matrix_and_its_summary(make_scenario):
    sc = make_scenario(server={"rounds": 4}, stream=STREAM)
    run_dir = run_scenario(sc, run_id="cont")
    tasks = pd.read_csv(run_dir / "tasks.csv")
    # segments: round 1 (task 0, clean), 3 (task 1, clean), 4 (task 1, rotated)
    assert sorted(tasks.start_round.unique()) == [1, 3, 4]
    assert len(tasks) == 5 * 3 and set(tasks["round"]) == {0, 1, 2, 3, 4}
    rounds = pd.read_csv(run_dir / "rounds.csv")
    seen = tasks[tasks.seen].groupby("round").accuracy.mean()
    np.testing.assert_allclose(rounds.set_index("round").test_accuracy, seen.reindex(rounds["round"]))
    summary = json.loads((run_dir / "continual.json").read_text())
    R = tasks.pivot(index="round", columns="task", values="accuracy").to_numpy()
    assert summary["final_accuracy"] == pytest.approx(R[4].mean())
    assert summary["forgetting"] == pytest.approx(np.mean([max(R[2, 0], R[3, 0]) - R[4, 0], R[3, 1] - R[4, 1]]))
    assert len(summary["shifts"]) == 2 and (run_dir / "tasks_vs_time.png").stat().st_size > 10_000
    clients = pd.read_csv(run_dir / "clients.csv")
    assert (clients.num_examples <= 32).all() and (clients.groupby("round").num_examples.max().iloc[0] == 16)


def test_a_fleet_of_one_sends_nothing_and_pays_no_communication(make_scenario):
    alone = make_scenario(fleet=ONE, server={"rounds": 2}, stream={**STREAM, "federated": False})
    shared = make_scenario(fleet=ONE, server={"rounds": 2}, stream=STREAM)
    a = pd.read_csv(run_scenario(alone, run_id="one") / "clients.csv")
    b = pd.read_csv(run_scenario(shared, run_id="fed") / "clients.csv")
    assert (
        (a.emulated_comm_time_s == 0).all() and (a.emulated_bytes_up == 0).all() and (a.emulated_bytes_down == 0).all()
    )
    assert (b.emulated_comm_time_s > 0).all()
    # same training (same seeds), so the only energy difference is the radio's
    np.testing.assert_allclose(a.train_loss, b.train_loss)
    assert (a.emulated_energy_j < b.emulated_energy_j).all()
    rounds = pd.read_csv(run_scenario(alone, run_id="one2") / "rounds.csv")
    np.testing.assert_allclose(rounds.round_time_s.iloc[1:], a.emulated_train_time_s)


def test_fleet_of_one_needs_one_device(make_scenario):
    with pytest.raises(ConfigError, match="stream.federated"):
        make_scenario(stream={**STREAM, "federated": False})


def test_misplaced_data_keys_and_a_hue_shift_of_grey_images_are_errors(make_scenario):
    with pytest.raises(ConfigError, match="data.size"):
        make_scenario(data={"size": 100})  # digits: nothing to generate
    with pytest.raises(ConfigError, match="data.label_column"):
        make_scenario(data={"label_column": "y"})
    with pytest.raises(ConfigError, match="data.partition_by"):
        make_scenario(data={"partition_by": "writer_id"})
    sc = make_scenario(stream={**STREAM, "domains": [{}, {"hue": 90}]})
    from fedelastic.fl.env import RunEnvironment

    with pytest.raises(ConfigError, match=r"stream.domains\[1\].hue"):
        _ = RunEnvironment(sc).stream


@pytest.mark.ray
def test_a_stream_on_ray_computes_what_it_computes_in_process(make_scenario):
    # buffers are replayed from (seed, client, round), so any actor builds the same one
    stream = {**STREAM, "buffer_policy": "reservoir"}
    ray = make_scenario(server={"rounds": 3}, stream=stream, simulation={"backend": "ray", "num_cpus_per_client": 1})
    local = make_scenario(server={"rounds": 3}, stream=stream)
    a, b = run_scenario(ray, run_id="ray"), run_scenario(local, run_id="local")
    pd.testing.assert_frame_equal(pd.read_parquet(a / "tasks.parquet"), pd.read_parquet(b / "tasks.parquet"))
    drop = ["host_wall_s"]
    pd.testing.assert_frame_equal(
        pd.read_parquet(a / "clients.parquet").drop(columns=drop),
        pd.read_parquet(b / "clients.parquet").drop(columns=drop),
    )
