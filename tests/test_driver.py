"""The ServerApp driver: ``server.evaluate_every``, and results written byte for byte as before."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedelastic.compare import curves, summarise
from fedelastic.errors import ConfigError
from fedelastic.fl.runner import resume_run, run_scenario
from fedelastic.report import write_html
from fedelastic.results import plot_accuracy
from fedelastic.scenario import parse_scenario

from .conftest import small_scenario_dict


def _no_host(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=[c for c in frame.columns if c.startswith("host_")])


def test_evaluate_every_evaluates_multiples_the_start_and_the_last_round(make_scenario):
    every = run_scenario(make_scenario(server={"rounds": 7, "evaluate_every": 3}), run_id="every3")
    plain = run_scenario(make_scenario(server={"rounds": 7}), run_id="plain")
    rounds = pd.read_parquet(every / "rounds.parquet")
    # by hand: 0 (initial), 3 and 6 (multiples of 3), 7 (the last)
    assert list(rounds["round"]) == list(range(8))
    assert list(rounds.loc[rounds.test_accuracy.notna(), "round"]) == [0, 3, 6, 7]
    assert list(rounds.loc[rounds.test_loss.notna(), "round"]) == [0, 3, 6, 7]
    # skipping an evaluation changes nothing else: the default run's accuracy on those rounds,
    # and the same client rows and round figures everywhere
    base = pd.read_parquet(plain / "rounds.parquet")
    assert base.test_accuracy.notna().all()
    shown = rounds.test_accuracy.notna()
    assert np.array_equal(rounds.test_accuracy[shown], base.test_accuracy[shown])
    assert np.array_equal(rounds.test_loss[shown], base.test_loss[shown])
    figures = [c for c in base.columns if c not in ("test_accuracy", "test_loss", "host_wall_s")]
    pd.testing.assert_frame_equal(rounds[figures], base[figures])
    pd.testing.assert_frame_equal(
        _no_host(pd.read_parquet(every / "clients.parquet")), _no_host(pd.read_parquet(plain / "clients.parquet"))
    )
    # the CSV says the same (NaN is an empty field)
    csv = pd.read_csv(every / "rounds.csv")
    assert list(csv.loc[csv.test_accuracy.notna(), "round"]) == [0, 3, 6, 7]
    # downstream: a summary takes the last evaluated accuracy; plots and the report draw
    summary = summarise(rounds, pd.read_parquet(every / "clients.parquet"), target=0.0)
    assert summary["final_accuracy"] == base.test_accuracy.iloc[-1]
    plot_accuracy(rounds, pd.read_parquet(every / "clients.parquet"), every / "plot.png")
    assert (every / "plot.png").stat().st_size > 0
    assert write_html(every).exists()


def test_evaluate_every_default_is_every_round(make_scenario):
    sc = make_scenario(server={"rounds": 3})
    assert sc.server.evaluate_every == 1
    rounds = pd.read_parquet(run_scenario(sc, run_id="d") / "rounds.parquet")
    assert rounds.test_accuracy.notna().all() and list(rounds["round"]) == [0, 1, 2, 3]


def test_async_aggregations_follow_evaluate_every(make_scenario):
    sc = make_scenario(server={"rounds": 5, "policy": "async", "concurrency": 2, "buffer_size": 1, "evaluate_every": 2})
    rounds = pd.read_parquet(run_scenario(sc, run_id="a") / "rounds.parquet")
    assert list(rounds.loc[rounds.test_accuracy.notna(), "round"]) == [0, 2, 4, 5]
    assert rounds.loc[rounds.test_accuracy.isna(), "round"].tolist() == [1, 3]


def test_a_resumed_run_evaluates_the_same_rounds(make_scenario, monkeypatch):
    import fedelastic.fl.server as server

    sc = make_scenario(server={"rounds": 5, "evaluate_every": 2})
    whole = run_scenario(sc, run_id="whole")
    original = server.PartialFedAvg.aggregate_train

    def crash_in_round_4(self, rnd, replies):
        if rnd == 4:
            raise KeyboardInterrupt("killed")
        return original(self, rnd, replies)

    monkeypatch.setattr(server.PartialFedAvg, "aggregate_train", crash_in_round_4)
    with pytest.raises(KeyboardInterrupt):
        run_scenario(sc, run_id="killed")
    monkeypatch.setattr(server.PartialFedAvg, "aggregate_train", original)
    killed = Path(sc.output_dir) / "tiny" / "killed"
    assert list(pd.read_parquet(killed / "rounds.parquet")["round"]) == [0, 1, 2, 3]
    resume_run(killed)
    a, b = pd.read_parquet(killed / "rounds.parquet"), pd.read_parquet(whole / "rounds.parquet")
    assert list(a.loc[a.test_accuracy.notna(), "round"]) == [0, 2, 4, 5]
    pd.testing.assert_frame_equal(_no_host(a), _no_host(b))


@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_bad_evaluate_every_is_a_config_error(tmp_path, value):
    raw = small_scenario_dict(tmp_path, server={"evaluate_every": value})
    with pytest.raises(ConfigError, match=r"server\.evaluate_every"):
        parse_scenario(raw, src="bad.toml")


def test_a_continual_stream_needs_every_round(tmp_path):
    raw = small_scenario_dict(tmp_path, server={"evaluate_every": 2}, stream={"tasks": [[0, 1], [2, 3]]})
    with pytest.raises(ConfigError, match=r"server\.evaluate_every.*continual"):
        parse_scenario(raw, src="stream.toml")


def test_summaries_and_curves_skip_rounds_without_accuracy():
    nan = math.nan
    rounds = pd.DataFrame(
        {
            "round": [0, 1, 2, 3, 4],
            "test_accuracy": [0.1, nan, 0.6, nan, 0.5],
            "sim_time_s": [0.0, 1.0, 2.0, 3.0, 4.0],
            "total_energy_j": [0.0, 10.0, 20.0, 30.0, 40.0],
            "host_wall_s": [0.0, 1.0, 1.0, 1.0, 1.0],
        }
    )
    clients = pd.DataFrame(
        {
            "emulated_peak_memory_bytes": [1.0],
            "fits": [True],
            "emulated_train_time_s": [1.0],
            "fraction_params_trained": [1.0],
        }
    )
    # target 0.55: first reached at round 2 (t = 2 s, 20 J); the NaN round 1 is not a hit
    row = summarise(rounds, clients, target=0.55)
    assert row["final_accuracy"] == 0.5 and row["reached_target"]
    assert row["time_to_target_s"] == 2.0 and row["energy_to_target_j"] == 20.0
    # a run stopped on a skipped round: its final accuracy is the last evaluated one
    assert summarise(rounds.iloc[:4], clients, target=0.0)["final_accuracy"] == 0.6
    runs = rounds.assign(fleet="f", strategy="s")
    assert curves(runs)["round"].tolist() == [0, 2, 4]


def test_the_command_line_shows_skipped_rounds_and_reports_the_last_accuracy(tmp_path, capsys):
    import tomli_w

    from fedelastic.cli import main

    path = tmp_path / "every.toml"
    path.write_text(tomli_w.dumps(small_scenario_dict(tmp_path, server={"rounds": 3, "evaluate_every": 2})))
    assert main(["run", str(path), "--run-id", "cli"]) == 0
    out = capsys.readouterr().out
    lines = {line.split("accuracy")[0].strip(): line for line in out.splitlines() if "  accuracy " in line}
    assert "accuracy   -    simulated" in lines["round 1"]
    assert "accuracy   -  " not in lines["round 2"] and "accuracy   -  " not in lines["round 3"]
    assert "nan" not in out.split("final accuracy")[1].split(",")[0]
