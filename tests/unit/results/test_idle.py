"""A device that trained nothing is named, with its share of client-rounds and why, in every summary:
the run's terminal table, its HTML page, and a comparison's table, printed table, page and verdict."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import tomli_w

from fedelastic.results import idle
from tests.support import small_scenario_dict

BUDGET = "rho 0.4 leaves a backward budget of 10.7 us on device 'jetson_tx2', below the 61.1 us needed"


def _clients() -> pd.DataFrame:
    """Two rounds of four clients built by hand: both TX2s select nothing every round, the Nano
    fits and trains in round 1 and fails in round 2, the Pi trains both rounds."""
    rows = []
    for rnd in (1, 2):
        for pid in (0, 1):
            rows.append(dict(round=rnd, partition_id=pid, device="jetson_tx2", steps=0, status="counted",
                             fits=True, fits_reason=BUDGET, error=""))  # fmt: skip
        nano = dict(steps=4, status="counted", error="") if rnd == 1 else dict(steps=np.nan, status="failed", error="boom")
        rows.append(dict(round=rnd, partition_id=2, device="jetson_nano", fits=rnd == 1, fits_reason="", **nano))
        rows.append(dict(round=rnd, partition_id=3, device="raspberry_pi_4", steps=4, status="counted", fits=True,
                         fits_reason="", error=""))  # fmt: skip
    return pd.DataFrame(rows)


def test_share_and_reason_per_device_by_hand():
    t = idle.by_device(_clients())
    assert t.client_rounds.to_dict() == {"jetson_nano": 2, "jetson_tx2": 4, "raspberry_pi_4": 2}
    assert t.trained_nothing.to_dict() == {"jetson_nano": 1, "jetson_tx2": 4, "raspberry_pi_4": 0}
    assert t.share.to_dict() == {"jetson_nano": 0.5, "jetson_tx2": 1.0, "raspberry_pi_4": 0.0}
    assert t.why["jetson_tx2"] == BUDGET and t.why["jetson_nano"] == "failed: boom" and t.why["raspberry_pi_4"] == ""
    assert idle.flagged(t) == ["jetson_tx2"]  # the Nano's 1 of 2 is half, not more
    assert idle.lines(t) == {
        "jetson_nano": "jetson_nano trained nothing in 1 of 2 client-rounds (50%): failed: boom",
        "jetson_tx2": f"jetson_tx2 trained nothing in 4 of 4 client-rounds (100%): {BUDGET}",
    }


def test_a_share_above_0_or_below_1_never_reads_0_or_100_percent():
    assert [idle.percent(s) for s in (0.0, 0.001, 0.25, 0.998, 1.0)] == ["0%", "<1%", "25%", ">99%", "100%"]


def test_reasons_by_status_and_a_count_of_the_others():
    clients = pd.DataFrame(
        {
            "device": ["mcu"] * 4,
            "steps": [0, 0, 0, 0],
            "status": ["not_fitting", "not_fitting", "too_slow", "counted"],
            "fits_reason": ["the selection needs 9 bytes; the device has 8", "the selection needs 9 bytes; the device has 8", "", ""],
            "error": ["", "", "", ""],
        }
    )  # fmt: skip
    why = idle.by_device(clients).why["mcu"]
    assert why == "did not fit in memory: the selection needs 9 bytes; the device has 8 (and 2 other reasons)"


def test_terminal_summary_and_run_page_name_the_idle_device(tmp_path, capsys):
    from fedelastic.comparisons.report import write_html
    from fedelastic.results.summary import report

    clients = _clients()
    for col in ("emulated_train_time_s", "emulated_energy_j", "emulated_idle_energy_j", "emulated_comm_time_s",
                "emulated_peak_memory_bytes", "device_memory_bytes", "fraction_params_trained"):  # fmt: skip
        clients[col] = 1.0
    clients["device_class"] = "edge"
    rounds = pd.DataFrame(
        {"round": [0, 1, 2], "sim_time_s": [0.0, 1.0, 2.0], "test_accuracy": [0.1, 0.2, 0.3],
         "total_energy_j": [0.0, 1.0, 2.0], "host_wall_s": [0.0, 0.1, 0.1]}
    )  # fmt: skip
    (tmp_path / "status.json").write_text(json.dumps({"status": "completed"}))
    rounds.to_parquet(tmp_path / "rounds.parquet")
    clients.to_parquet(tmp_path / "clients.parquet")
    report(tmp_path)
    out = " ".join(capsys.readouterr().out.split())  # the terminal may wrap a long line
    assert "100% (4)" in out and "50% (1)" in out
    assert f"jetson_tx2 trained nothing in 4 of 4 client-rounds (100%): {BUDGET}" in out
    page = write_html(tmp_path).read_text()
    assert "<b>Trained nothing</b> in most of its client-rounds: jetson_tx2 in 100%" in page
    assert '<li class="bad">jetson_tx2 trained nothing in 4 of 4 client-rounds (100%)' in page
    assert "<li>jetson_nano trained nothing in 1 of 2 client-rounds (50%): failed: boom</li>" in page


def test_per_cell_pools_the_seeds_by_hand():
    runs = pd.DataFrame(
        [
            dict(fleet="gpu", strategy="e", device="jetson_tx2", client_rounds=4, trained_nothing=4, why=BUDGET),
            dict(fleet="gpu", strategy="e", device="jetson_nano", client_rounds=4, trained_nothing=0, why=""),
            dict(fleet="gpu", strategy="e", device="jetson_tx2", client_rounds=4, trained_nothing=1, why=BUDGET),
            dict(fleet="gpu", strategy="e", device="jetson_nano", client_rounds=4, trained_nothing=1, why="failed: x"),
            dict(fleet="gpu", strategy="full", device="jetson_tx2", client_rounds=8, trained_nothing=0, why=""),
        ]
    )  # seed 0 then seed 1 of "e"; "full" trained everywhere
    t = idle.per_cell(runs).set_index("strategy")
    assert t.trained_nothing["e"] == "jetson_nano 12%, jetson_tx2 62%"  # 1/8 and 5/8
    assert t.idle_devices["e"] == "jetson_tx2" and t.idle_devices["full"] == ""
    assert t.trained_nothing_why["e"] == f"jetson_nano: failed: x; jetson_tx2: {BUDGET}"
    assert t.trained_nothing["full"] == "jetson_tx2 0%"
    (verdict,) = idle.verdicts(t.reset_index())
    assert verdict.startswith("gpu / e: jetson_tx2 trained nothing in more than half of its client-rounds")


def _hand_run(run_dir, clients: pd.DataFrame) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text(json.dumps({"status": "completed"}))
    pd.DataFrame(
        {"round": [0, 1, 2], "sim_time_s": [0.0, 1.0, 2.0], "test_accuracy": [0.1, 0.5, 0.6],
         "total_energy_j": [0.0, 1.0, 2.0], "host_wall_s": [0.0] * 3}
    ).to_parquet(run_dir / "rounds.parquet")  # fmt: skip
    clients.assign(emulated_peak_memory_bytes=1e6, emulated_train_time_s=0.5, fraction_params_trained=0.5).to_parquet(
        run_dir / "clients.parquet"
    )


def test_compare_flags_a_cell_whose_device_idled_in_its_tables_page_and_verdict(tmp_path, capsys):
    """A comparison folder built by hand (both seeds finished): 'elastic' idles the TX2s in every
    client-round, 'full' trains everywhere."""
    from fedelastic.cli import main
    from fedelastic.comparisons.report import write_html

    raw = small_scenario_dict(tmp_path)
    raw["compare"] = {
        "strategies": ["full", {"strategy": "elastic_tensor", "label": "elastic", "options": {"rho": 0.4}}],
        "fleets": {"gpu": {"jetson_tx2": 2, "jetson_nano": 1, "raspberry_pi_4": 1}},
        "seeds": [0, 1],
    }
    path = tmp_path / "cmp.toml"
    path.write_text(tomli_w.dumps(raw))
    trained = _clients().assign(steps=4, status="counted", fits=True, fits_reason="", error="")
    for seed in (0, 1):
        _hand_run(tmp_path / "cmp" / "runs" / "tiny-gpu-full" / f"s{seed}", trained)
        _hand_run(tmp_path / "cmp" / "runs" / "tiny-gpu-elastic" / f"s{seed}", _clients())
    capsys.readouterr()
    assert main(["compare", str(path), "--resume", str(tmp_path / "cmp")]) == 0
    log = " ".join(capsys.readouterr().out.split())
    assert "jetson_nano 50%, jetson_tx2 100%!" in log  # the printed table's cell: 2/4 and 8/8 over both seeds
    assert "! gpu / elastic: jetson_tx2 trained nothing in more than half of its client-rounds" in log
    table = pd.read_csv(tmp_path / "cmp" / "summary_by_strategy.csv").set_index("strategy")
    assert table.trained_nothing["elastic"] == "jetson_nano 50%, jetson_tx2 100%, raspberry_pi_4 0%"
    assert table.idle_devices["elastic"] == "jetson_tx2" and table.idle_devices.isna()["full"]  # "" reads back NaN
    assert table.trained_nothing_why["elastic"] == f"jetson_nano: failed: boom; jetson_tx2: {BUDGET}"
    page = write_html(tmp_path / "cmp").read_text()
    assert "<b>Idle devices.</b> gpu / elastic: jetson_tx2 trained nothing" in page
    assert "<th>trained nothing</th>" in page and "<th>fits_fraction</th>" in page
    assert "<td>jetson_nano 50%, jetson_tx2 100%, raspberry_pi_4 0%</td>" in page


@pytest.mark.parametrize("steps", [[0, 0], [3, 0]])
def test_a_table_without_steps_or_device_reads_as_nothing_idle(steps):
    assert not idle.trained_nothing(pd.DataFrame({"device": ["a", "a"]})).any()
    assert idle.by_device(pd.DataFrame({"steps": steps})).empty


def test_rounds_in_which_nobody_trained_are_marked_for_the_accuracy_figure(tmp_path):
    from fedelastic.results.plots import empty_rounds, plot_accuracy

    rounds = pd.DataFrame(
        {"round": [0, 1, 2, 3], "clients": [0, 2, 2, 2], "clients_failed": [0, 0, 0, 1],
         "clients_not_fitting": [0, 0, 1, 0], "clients_no_steps": [0, 1, 1, 0], "clients_rejected": [0, 0, 0, 1],
         "sim_time_s": [0.0, 1.0, 1.0, 1.0], "test_accuracy": [0.1, 0.4, 0.4, np.nan]}
    )  # fmt: skip
    # by hand: round 1 trained one client of two; in round 2 one did not fit and one took no step;
    # in round 3 one failed and one was rejected; round 0 is the initial model
    assert empty_rounds(rounds).tolist() == [False, False, True, True]
    assert not empty_rounds(rounds.drop(columns="clients")).any()  # a table without the counts: none known
    plot_accuracy(rounds, pd.DataFrame(), tmp_path / "a.png")  # draws them, an unevaluated one at 0
    assert (tmp_path / "a.png").stat().st_size > 0
