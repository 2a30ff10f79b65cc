"""Divergence is a status: runs that diverge end to end, through the command line.

A run whose training breaks down stops after that round (or goes on with
``simulation.on_divergence = "continue"``), ends with status 'diverged' and the round and
reason in status.json, and `fedelastic run` exits 4. A client whose update is rejected
(non-finite) is charged what its device spent and the round waits for it. The detector itself
is checked on hand-built sequences in ``tests/unit/sim/test_divergence.py``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fedelastic.results.recorder import read_status
from tests.support import only_run_dir, run_cli, scenario_file

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
    # train_local is patched: the per-client path (vectorize = "auto" would batch the cohort)
    code, out = run_cli(["run", scenario_file(tmp_path, simulation={"vectorize": False})], capsys)
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


# the trust review's scenario B: barely trained after 3 rounds of 2 steps, predictions all one
# class in round 3, test loss falling every round (2.3047 -> 2.3017): sound, not diverged
SCENARIO_B = {
    "fleet": {"raspberry_pi_4": 2, "jetson_nano": 1},
    "seed": 0,
    "data": {"dataset": "digits", "partitioner": "iid"},
    "model": {"name": "small_cnn", "options": {}},
    "train": {"strategy": "full", "local_epochs": 1, "max_steps": 2},
    "server": {"rounds": 3},
}


def test_a_barely_trained_run_whose_predictions_collapse_is_not_diverged(tmp_path, capsys, monkeypatch):
    """Before, round 3 ended 'diverged: 100.0% of the test predictions are class 3' (exit 4) and
    ``compare`` dropped such slow learners; a collapse now counts only with a test loss that went up."""
    from fedelastic.sim import divergence

    seen = []
    real = divergence.Detector.observe
    monkeypatch.setattr(divergence.Detector, "observe", lambda self, rnd, **kw: seen.append((rnd, kw)) or real(self, rnd, **kw))
    code, out = run_cli(["run", scenario_file(tmp_path, **SCENARIO_B)], capsys)
    run_dir = only_run_dir(tmp_path)
    assert code == 0 and read_status(run_dir)["status"] == "completed", out
    rounds = pd.read_csv(run_dir / "rounds.csv")
    assert rounds["test_loss"].is_monotonic_decreasing  # sound: the loss falls every round
    # the detector saw the test loss of every evaluated round (before: only the initial model's)
    assert [r for r, kw in seen if kw.get("test_loss") is not None] == [0, 1, 2, 3]
    assert [kw["test_loss"] for _, kw in seen] == pytest.approx(rounds["test_loss"].tolist())


def test_a_diverged_run_names_the_setting_most_likely_at_fault(tmp_path, capsys):
    path = scenario_file(tmp_path, server={"rounds": 3}, **EXPLODES)
    code, out = run_cli(["run", path], capsys)
    status = read_status(only_run_dir(tmp_path))
    assert code == 4 and {"norm", "loss"} <= set(status["divergence"]["checks"])
    advice = 'lower train.lr (now 50) or set train.bn_mode = "train"'
    assert status["divergence"]["advice"].startswith(advice) and f"most likely at fault: {advice}" in out
