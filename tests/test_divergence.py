"""Divergence is a status: the detector on hand-built sequences, and runs that diverge end to end.

A run whose training breaks down stops after that round (or goes on with
``simulation.on_divergence = "continue"``), ends with status 'diverged' and the round and
reason in status.json, and `fedelastic run` exits 4. A client whose update is rejected
(non-finite) is charged what its device spent and the round waits for it.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from fedelastic.divergence import Detector, collapse_share, weight_norm
from fedelastic.errors import ConfigError
from fedelastic.results import read_status

from .test_faults import only_run_dir, run_cli, scenario_file

# -- the detector, on hand-built sequences -----------------------------------------------------


def test_a_loss_ten_times_its_first_value_diverges():
    d = Detector(loss_factor=10)
    assert d.observe(1, train_loss=2.3) == "" and d.observe(2, train_loss=2.1) == ""
    reason = d.observe(3, train_loss=40.0)  # 40 > 10 x 2.3
    assert "40" in reason and "2.3" in reason
    assert (d.first.round, d.first.reason) == (3, reason)
    assert d.observe(4, train_loss=1.0) == "" and d.first.round == 3  # the first divergence is kept


def test_a_loss_below_the_factor_does_not_diverge():
    d = Detector(loss_factor=10)
    for rnd, loss in enumerate([2.3, 5.0, 22.9], start=1):  # 22.9 < 23.0
        assert d.observe(rnd, train_loss=loss) == ""
    assert d.first is None


def test_the_initial_test_loss_is_the_reference_with_ln_classes_as_its_floor():
    d = Detector(loss_factor=10, classes=10)
    d.observe(0, test_loss=0.02)  # a pretrained model: tiny loss; the floor ln(10) = 2.303 is the reference
    assert d.observe(1, train_loss=0.5) == ""  # new classes: 25 x 0.02, yet no divergence
    assert d.observe(2, train_loss=23.0) == "" and d.observe(3, train_loss=23.1) != ""  # 10 x 2.3026 = 23.03
    fresh = Detector(loss_factor=10, classes=10)
    fresh.observe(0, test_loss=2.3)
    assert fresh.observe(1, train_loss=1.26e13) != ""  # a first round that already exploded is caught


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_diverges(bad):
    d = Detector()
    assert d.observe(1, train_loss=bad) == f"the mean train loss is {bad:g}" and d.first.round == 1


def test_a_norm_above_the_factor_or_non_finite_diverges():
    d = Detector(norm_factor=100)
    assert d.observe(0, norm=8.0) == ""  # the reference
    assert d.observe(1, norm=9.0) == "" and d.observe(2, norm=799.0) == ""
    assert "900" in d.observe(3, norm=900.0) and d.first.round == 3
    assert "nan" in Detector().observe(1, norm=math.nan)


def test_a_majority_of_rejected_updates_diverges():
    d = Detector(rejected_share=0.5)
    assert d.observe(1, trained=4, rejected=1) == "" and d.observe(2, trained=4, rejected=2) == ""
    assert d.observe(3, trained=4, rejected=3) == "3 of 4 clients that trained sent non-finite updates"
    assert Detector().observe(1, trained=1, rejected=1) != ""


def test_predictions_that_collapse_to_one_class_diverge():
    d = Detector(collapse_share=0.95)
    balanced = np.array([34, 33, 33])
    assert d.observe(0, predicted=np.array([100, 0, 0]), actual=balanced) == ""  # collapsed from the start
    assert d.observe(1, predicted=np.array([0, 100, 0]), actual=balanced) == ""  # still: never spread
    assert d.observe(2, predicted=np.array([40, 30, 30]), actual=balanced) == ""
    assert d.observe(3, predicted=np.array([94, 3, 3]), actual=balanced) == ""  # 94% < 95%
    assert d.observe(4, predicted=np.array([2, 96, 2]), actual=balanced) == "96.0% of the test predictions are class 1"


def test_collapse_needs_three_classes_and_a_test_set_that_is_not_one_class():
    two = Detector()
    two.observe(0, predicted=np.array([50, 50]), actual=np.array([50, 50]))
    assert two.observe(1, predicted=np.array([100, 0]), actual=np.array([50, 50])) == ""
    skewed = Detector()
    skewed.observe(0, predicted=np.array([50, 25, 25]), actual=np.array([96, 2, 2]))
    assert skewed.observe(1, predicted=np.array([100, 0, 0]), actual=np.array([96, 2, 2])) == ""
    assert collapse_share(np.array([3, 1])) == 0.75 and collapse_share(np.zeros(3)) == 0.0


def test_a_threshold_of_zero_turns_its_check_off():
    d = Detector(loss_factor=0, norm_factor=0, collapse_share=0)
    d.observe(0, norm=1.0, predicted=np.array([40, 30, 30]), actual=np.array([34, 33, 33]))
    assert d.observe(1, train_loss=1.0) == ""
    assert d.observe(2, train_loss=1e9, norm=1e9, predicted=np.array([100, 0, 0]), actual=np.array([34, 33, 33])) == ""
    assert d.observe(3, norm=math.inf) != ""  # a non-finite figure always diverges


def test_weight_norm_by_hand():
    state = {"w": np.array([3.0, 4.0], dtype=np.float32), "steps": np.array([7]), "bn.var": np.array([12.0])}
    assert weight_norm(state, {"w"}) == 5.0  # sqrt(9 + 16); the int tensor and the unnamed buffer left out
    assert weight_norm(state) == 13.0  # sqrt(9 + 16 + 144)
    assert math.isnan(weight_norm({**state, "bn.var": np.array([np.nan])}, {"w"}))  # a NaN buffer, named or not
    assert math.isnan(weight_norm({"w": np.array([np.inf, 0.0])}))


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("divergence", "loss_factor", 0.5),
        ("divergence", "norm_factor", -1.0),
        ("divergence", "collapse_share", 0.4),
        ("divergence", "rejected_share", 1.0),
        ("simulation", "on_divergence", "pause"),
    ],
)
def test_bad_divergence_settings_name_their_key(make_scenario, section, key, value):
    with pytest.raises(ConfigError, match=key):
        make_scenario(**{section: {key: value}})


# -- runs that diverge ---------------------------------------------------------------------------

# small_cnn from its initialisation at lr 50, BatchNorm frozen: the weights reach ~1e13 in round 1
EXPLODES = {"train": {"strategy": "full", "batch_size": 16, "max_steps": 3, "lr": 50.0, "bn_mode": "frozen"}}


def test_a_run_that_diverges_stops_with_status_diverged_and_exit_4(tmp_path, capsys):
    path = scenario_file(tmp_path, server={"rounds": 3}, **EXPLODES)
    code, out = run_cli(["run", path], capsys)
    run_dir = only_run_dir(tmp_path)
    status = read_status(run_dir)
    assert code == 4 and status["status"] == "diverged", out
    assert status["divergence"]["round"] == 1 and "norm" in status["divergence"]["reason"]
    rounds = pd.read_csv(run_dir / "rounds.csv", dtype={"divergence": "string"})
    assert list(rounds["round"]) == [0, 1]  # stopped after round 1, which is on disk
    assert rounds["divergence"].fillna("").tolist() == ["", status["divergence"]["reason"]]
    assert len(pd.read_csv(run_dir / "clients.csv")) == 4  # round 1's clients
    progress = [line for line in out.splitlines() if "round 1" in line]
    assert progress and "diverged" in progress[0]
    assert f"diverged in round 1: {status['divergence']['reason']}" in out  # the summary
    # a diverged run is finished: resuming it is refused
    code, out = run_cli(["run", "--resume", run_dir], capsys)
    assert code == 2 and "already finished (diverged)" in out


def test_a_run_told_to_continue_goes_to_the_end_and_still_ends_diverged(tmp_path, capsys):
    path = scenario_file(tmp_path, server={"rounds": 3}, simulation={"backend": "inprocess", "on_divergence": "continue"}, **EXPLODES)
    code, out = run_cli(["run", path], capsys)
    run_dir = only_run_dir(tmp_path)
    status = read_status(run_dir)
    assert code == 4 and status["status"] == "diverged", out
    assert status["divergence"]["round"] == 1
    assert list(pd.read_csv(run_dir / "rounds.csv")["round"]) == [0, 1, 2, 3]


def test_a_rejected_client_is_charged_and_the_round_waits_for_it(tmp_path, capsys, monkeypatch):
    """The slowest device (the STM32) sends NaN weights with a finite loss in every round: its row is
    'rejected', carries its device's time and energy, and the round lasts until its update arrives."""
    import fedelastic.fl.client as client

    real = client.train_local

    def nan_on_the_stm32(model, info, strategy, cost, *args, **kwargs):
        result = real(model, info, strategy, cost, *args, **kwargs)
        if cost.device.name == "stm32h743":
            result.trained = {k: np.full_like(v, np.nan) for k, v in result.trained.items()}
        return result

    monkeypatch.setattr(client, "train_local", nan_on_the_stm32)
    code, out = run_cli(["run", scenario_file(tmp_path)], capsys)
    run_dir = only_run_dir(tmp_path)
    status = read_status(run_dir)
    assert status["status"] == "completed_with_errors" and code == 3, out  # 1 of 4 rejected: not diverged
    assert (status["clients_rejected"], status["clients_failed"]) == (2, 0)
    clients = pd.read_csv(run_dir / "clients.csv")
    rounds = pd.read_csv(run_dir / "rounds.csv").set_index("round")
    bad = clients[clients.device == "stm32h743"]
    assert (bad.status == "rejected").all() and not bad.counted.any() and bad.fits.all()
    assert (bad.emulated_energy_j > 0).all() and (bad.emulated_train_time_s > 0).all()
    assert (bad.emulated_comm_time_s > 0).all() and bad.error.str.contains("non-finite update").all()
    assert (bad.wasted_energy_j == bad.emulated_energy_j).all()
    for rnd, g in clients.groupby("round"):
        r = rounds.loc[rnd]
        assert r.clients_rejected == 1 and r.clients_failed == 0 and r.clients_not_fitting == 0
        arrival = g.arrival_s - r.round_start_s
        stm = g[g.device == "stm32h743"].iloc[0]
        assert stm.arrival_s - r.round_start_s == arrival.max() > arrival[g.device != "stm32h743"].max()
        assert r.round_time_s == pytest.approx(arrival.max(), rel=1e-12)  # the round waited for it (wait_all)
        assert r.round_energy_j == pytest.approx((g.emulated_energy_j + g.emulated_idle_energy_j).sum(), rel=1e-12)
        assert r.wasted_energy_j == pytest.approx(stm.emulated_energy_j, rel=1e-12)
        assert r.mean_train_loss == pytest.approx(g[g.status == "counted"].train_loss.mean(), rel=1e-12)


def test_the_detector_goes_on_from_its_state_as_if_never_stopped():
    def feed(d, rounds):
        return [d.observe(r, train_loss=loss, norm=norm, predicted=p, actual=np.array([34, 33, 33])) for r, loss, norm, p in rounds]

    rounds = [
        (0, None, 8.0, np.array([40, 30, 30])),
        (1, 2.3, 9.0, np.array([40, 30, 30])),
        (2, 30.0, 9.5, np.array([98, 1, 1])),
        (3, 2.0, 900.0, np.array([40, 30, 30])),
    ]
    whole = Detector(classes=3)
    expected = feed(whole, rounds)
    assert [bool(r) for r in expected] == [False, False, True, True]
    first = Detector(classes=3)
    feed(first, rounds[:2])
    resumed = Detector()
    resumed.load_state(first.state())
    assert feed(resumed, rounds[2:]) == expected[2:] and resumed.first == whole.first
