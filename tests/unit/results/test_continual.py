"""Continual streams: metrics against hand computations, buffers, drift onsets, and in-process runs."""

import base64
import json
import math
import re
import warnings

import numpy as np
import pandas as pd
import pytest

from fedelastic.comparisons.report import continual_sections, write_html
from fedelastic.data import ArrayDataset, FederatedData
from fedelastic.data.shifts import Shift
from fedelastic.data.stream import Stream, StreamConfig, domain_at, domain_onsets, replay_buffer, segments
from fedelastic.errors import ConfigError
from fedelastic.fl.runner import run_scenario
from fedelastic.results.continual import report
from fedelastic.results.continual_metrics import collapse, summarise, top_share
from tests.support import SMALL_STREAM


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


# rounds 0..3, tasks arriving in rounds 1, 2, 3: each task trains one round (end[j] = start[j])
R3 = np.array([[0.1, 0.1, 0.1], [0.8, 0.2, 0.1], [0.85, 0.9, 0.3], [0.5, 0.7, 0.8]])


def test_forgetting_per_task_is_the_best_accuracy_since_learned_minus_the_final_by_hand():
    s = summarise(R3, [1, 2, 3], np.arange(4.0), recover_share=0.9)
    per = s["per_task"]
    assert [t["end_round"] for t in per] == [1, 2, 3]
    assert [t["accuracy_at_end"] for t in per] == pytest.approx([0.8, 0.9, 0.8])
    assert [t["final_accuracy"] for t in per] == pytest.approx([0.5, 0.7, 0.8])
    # task 0: best of R[1, 0] = 0.8 and R[2, 0] = 0.85 (not its own end), minus R[3, 0] = 0.5
    assert per[0]["forgetting"] == pytest.approx(0.35)
    assert per[1]["forgetting"] == pytest.approx(0.9 - 0.7)
    assert math.isnan(per[2]["forgetting"])  # the last task is still being trained
    assert s["forgetting"] == pytest.approx((0.35 + 0.2) / 2)
    assert s["backward_transfer"] == pytest.approx(((0.5 - 0.8) + (0.7 - 0.9)) / 2)


def test_a_recovery_is_searched_only_after_its_shift():
    # task 1 arrives in round 3 and is already above the target (0.9 * R[2, 0] = 0.72) in round 2,
    # before its shift; after it, round 3 has 0.5 and round 4 has 0.8
    R = np.array([[0.1, 0.1], [0.5, 0.6], [0.8, 0.9], [0.7, 0.5], [0.7, 0.8]])
    clock = np.array([0.0, 2.0, 4.0, 7.0, 11.0])
    (shift,) = summarise(R, [1, 3], clock, recover_share=0.9)["shifts"]
    assert shift["target_accuracy"] == pytest.approx(0.72)
    assert shift["recovered_round"] == 4 and shift["rounds_to_recover"] == 2
    assert shift["time_to_recover_s"] == pytest.approx(11.0 - 4.0)
    assert shift["recovery"] == "recovered in round 4"


@pytest.mark.parametrize("pre", [0.0, float("nan")])
def test_a_shift_whose_target_is_zero_or_undefined_is_not_a_recovery(pre):
    # the accuracy on task 0 just before task 1 arrives (round 2) is 0 (a collapsed model) or missing
    R = np.array([[0.0, 0.0], [0.3, 0.0], [pre, 0.0], [0.0, 0.0]])
    s = summarise(R, [1, 3], np.arange(4.0), recover_share=0.9)
    (shift,) = s["shifts"]
    assert shift["recovery"].startswith("n/a") and "before the shift" in shift["recovery"]
    assert all(math.isnan(shift[k]) for k in ("target_accuracy", "recovered_round", "time_to_recover_s"))
    assert s["per_task"][1]["recovery"] == shift["recovery"]
    assert s["per_task"][0]["recovery"].startswith("n/a")


def test_collapse_is_a_share_above_the_threshold_on_three_classes_or_more():
    assert top_share(np.array([3, 95, 2, 0])) == (1, pytest.approx(0.95))
    assert top_share(np.array([40, 30, 30])) == (0, pytest.approx(0.4))
    hists = {  # round: predicted-class histogram on the seen tasks' test data, and the classes that data has
        0: ([0, 0, 100], 5),  # the initial model: not the run's doing
        1: ([1, 92, 7], 5),  # 0.92 > 0.9
        2: ([10, 90, 0], 5),  # exactly 0.9: not above
        3: ([0, 0, 97], 2),  # two classes only
        4: ([96, 2, 2], 3),
    }
    tops = {r: top_share(np.array(h)) for r, (h, _) in hists.items()}
    entry = collapse(
        np.array(list(hists)),
        np.array([tops[r][0] for r in hists]),
        np.array([tops[r][1] for r in hists]),
        np.array([n for _, n in hists.values()]),
    )
    assert entry is not None
    assert entry["rounds"] == [1, 4] and entry["predicted_class"] == [1, 0]
    assert entry["share"] == pytest.approx([0.92, 0.96])
    assert collapse(np.array([1, 2]), np.array([0, 0]), np.array([0.5, 0.9]), np.array([10, 10])) is None


def test_forward_transfer_follows_the_definition_and_is_na_for_new_classes():
    # task 1 is task 0's classes in a new domain, task 2 brings new classes
    R = np.array([[0.2, 0.15, 0.05], [0.9, 0.6, 0.0], [0.8, 0.9, 0.0], [0.7, 0.8, 0.6]])
    classes = [(0, 1, 2), (0, 1, 2), (3, 4)]
    s = summarise(R, [1, 2, 3], np.arange(4.0), 0.9, classes)
    per = s["per_task"]
    assert per[1]["forward_transfer"] == pytest.approx(0.6 - 0.15)  # R[start - 1, 1] - R[0, 1]
    assert math.isnan(per[2]["forward_transfer"]) and "3,4" in per[2]["forward_transfer_note"]
    assert s["forward_transfer"] == pytest.approx(0.45) and "[2]" in s["forward_transfer_note"]
    only_new = summarise(R, [1, 2, 3], np.arange(4.0), 0.9, [(0,), (1,), (2,)])
    assert math.isnan(only_new["forward_transfer"]) and only_new["forward_transfer_note"].startswith("n/a")
    # without the labels (a table from before they were recorded) every task gets the difference
    assert summarise(R, [1, 2, 3], np.arange(4.0), 0.9)["forward_transfer"] == pytest.approx((0.45 + (0.0 - 0.05)) / 2)


def _hand_run(folder, R, starts, classes, seen_share):
    """A run folder with only ``tasks.parquet``, from a hand-made matrix; seen tasks' top share per round."""
    rows = []
    for t in range(R.shape[0]):
        for j in range(R.shape[1]):
            rows.append(
                {
                    "round": t,
                    "sim_time_s": 2.0 * t,
                    "task": j,
                    "task_label": f"t{j}",
                    "start_round": starts[j],
                    "accuracy": R[t, j],
                    "classes": classes[j],
                    "seen_predicted_class": 4,
                    "seen_predicted_share": seen_share[t],
                    "seen_classes": 5,
                }
            )
    folder.mkdir()
    pd.DataFrame(rows).to_parquet(folder / "tasks.parquet")
    return folder


def test_continual_json_warns_once_on_a_collapse(tmp_path):
    run = _hand_run(tmp_path / "run", R3, [1, 2, 3], ["0,1", "2,3", "4"], [1.0, 0.5, 0.95, 0.99])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        report(run, recover_share=0.9)
        summary = report(run, recover_share=0.9)
    assert [str(w.message).count("collapsed") for w in caught] == [1]
    assert "round 2" in str(caught[0].message) and "class 4" in str(caught[0].message)
    saved = json.loads((run / "continual.json").read_text())
    assert saved["collapse"]["rounds"] == [2, 3] and saved["collapse"]["share"] == pytest.approx([0.95, 0.99])
    assert [t["forgetting"] for t in saved["per_task"]] == [pytest.approx(0.35), pytest.approx(0.2), None]
    assert summary["per_task"][2]["label"] == "t2"


def test_the_html_page_shows_the_matrix_forgetting_transfer_and_the_task_figure(tmp_path):
    run = _hand_run(tmp_path / "run", R3, [1, 2, 3], ["0,1", "2,3", "4"], [0.2, 0.5, 0.5, 0.5])
    page = "".join(continual_sections(run))
    for heading in ("Accuracy matrix", "Forgetting and transfer", "Accuracy per task over simulated time"):
        assert heading in page
    # the task-end rows of R3: initial, after task 0 (round 1), 1 (round 2), 2 (round 3)
    for label, row in (("initial model (round 0)", 0), ("after task 0 (round 1)", 1), ("after task 2 (round 3)", 3)):
        cells = r"\s*".join(f"<td>{v:.3f}</td>" for v in R3[row])
        assert re.search(rf"<td>{re.escape(label)}</td>\s*{cells}", page), label
    assert "<td>0.275</td>" in page  # forgetting: (0.35 + 0.2) / 2
    assert "<td>0.350</td>" in page and "n/a: class-incremental, classes 2,3" in page
    assert "collapsed" not in page
    images = [base64.b64decode(d) for d in re.findall(r'base64,([^"]+)"', page)]
    assert len(images) == 2 and all(len(i) > 5_000 for i in images)
    collapsed = _hand_run(tmp_path / "collapsed", R3, [1, 2, 3], ["0,1", "2,3", "4"], [0.2, 0.95, 0.5, 0.5])
    assert "collapsed to one class in 1 round(s), first in round 1" in "".join(continual_sections(collapsed))


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


def test_a_continual_run_writes_the_accuracy_matrix_and_its_summary(make_scenario):
    sc = make_scenario(server={"rounds": 4}, stream=SMALL_STREAM)
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
    assert all(s["recovered_round"] is None or s["recovered_round"] >= s["shift_round"] for s in summary["shifts"])
    assert [t["task"] for t in summary["per_task"]] == [0, 1, 2]
    # classes in the seen tasks' test data: digits 0-4 until task 1 (5-9) arrives in round 3
    assert tasks.groupby("round").seen_classes.first().tolist() == [5, 5, 5, 10, 10]
    assert tasks.predicted_share.between(0, 1).all() and tasks.predicted_class.between(0, 9).all()
    per_round = tasks.groupby("round").seen_predicted_share.first()
    collapsed = [r for r, share in per_round.items() if r >= 1 and share > 0.9]
    assert (summary["collapse"] or {"rounds": []})["rounds"] == collapsed
    page = write_html(run_dir).read_text()
    assert "Accuracy matrix" in page and "Forgetting and transfer" in page
    assert "".join(f"<td>{v:.3f}</td>" for v in R[4]) in re.sub(r">\s+<", "><", page)
    clients = pd.read_csv(run_dir / "clients.csv")
    assert (clients.num_examples <= 32).all() and (clients.groupby("round").num_examples.max().iloc[0] == 16)


def test_a_fleet_of_one_sends_nothing_and_pays_no_communication(make_scenario):
    alone = make_scenario(fleet=ONE, server={"rounds": 2}, stream={**SMALL_STREAM, "federated": False})
    shared = make_scenario(fleet=ONE, server={"rounds": 2}, stream=SMALL_STREAM)
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
        make_scenario(stream={**SMALL_STREAM, "federated": False})


def test_misplaced_data_keys_and_a_hue_shift_of_grey_images_are_errors(make_scenario):
    with pytest.raises(ConfigError, match="data.size"):
        make_scenario(data={"size": 100})  # digits: nothing to generate
    with pytest.raises(ConfigError, match="data.label_column"):
        make_scenario(data={"label_column": "y"})
    with pytest.raises(ConfigError, match="data.partition_by"):
        make_scenario(data={"partition_by": "writer_id"})
    sc = make_scenario(stream={**SMALL_STREAM, "domains": [{}, {"hue": 90}]})
    from fedelastic.environment import RunEnvironment

    with pytest.raises(ConfigError, match=r"stream.domains\[1\].hue"):
        _ = RunEnvironment(sc).stream


def test_a_stream_evaluation_pools_prediction_and_label_counts_over_the_seen_tasks():
    """The collapse check's input on a stream: counted by hand for a model that always says class 2."""
    from types import SimpleNamespace

    import torch

    from fedelastic.data import ArrayDataset
    from fedelastic.results.continual import evaluate_stream

    class AlwaysTwo(torch.nn.Module):
        def forward(self, x):
            out = torch.zeros(len(x), 5)
            out[:, 2] = 1.0
            return out

    x = np.zeros((6, 1, 2, 2), np.float32)
    sets = [ArrayDataset(x[:4], np.array([0, 1, 1, 0])), ArrayDataset(x[:3], np.array([3, 4, 4])),
            ArrayDataset(x[:2], np.array([2, 2]))]  # fmt: skip
    segments = [SimpleNamespace(start=s, label=f"t{j}", task=j, domain="clean", classes=c)
                for j, (s, c) in enumerate([(1, (0, 1)), (3, (3, 4)), (5, (2,))])]  # fmt: skip
    env = SimpleNamespace(stream=SimpleNamespace(segments=segments, eval_sets=sets))
    rows, accuracy, _, predicted, actual = evaluate_stream(env, AlwaysTwo(), 3, 1.5)  # tasks 0 and 1 seen
    assert predicted.tolist() == [0, 0, 7, 0, 0]
    assert actual.tolist() == [2, 2, 0, 1, 2]
    assert accuracy == pytest.approx(0.0)
    assert [r["seen"] for r in rows] == [True, True, False]
