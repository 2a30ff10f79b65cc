"""The comparison's controls do what the docs say: an empty tune.lr means the scenario's lr,
`fedelastic compare` takes KEY=VALUE overrides, and an lr that no tuning run chose is not shown as chosen."""

from __future__ import annotations

import json

import pandas as pd
import tomli_w

from fedelastic.comparisons.comparison import expand_tuning
from tests.support import small_scenario_dict


def _raw(tmp_path, **compare) -> dict:
    raw = small_scenario_dict(tmp_path)  # train.lr 0.05, seed 3
    raw["compare"] = {"strategies": ["full"], "fleets": {"sbc": {"raspberry_pi_4": 3}}, **compare}
    return raw


def test_an_empty_lr_grid_tunes_at_the_scenarios_lr(tmp_path):
    cells = expand_tuning(_raw(tmp_path, tune={"lr": [], "bn_mode": ["frozen", "train"]}), "cmp.toml")
    assert [(c.lr, c.bn_mode) for c in cells] == [(0.05, "frozen"), (0.05, "train")]
    assert expand_tuning(_raw(tmp_path, tune={"lr": []}), "cmp.toml") == []  # nothing to choose: no tuning runs
    assert expand_tuning(_raw(tmp_path, tune={}), "cmp.toml") == []


def _hand_run(run_dir, status: str, val: bool = False) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text(json.dumps({"status": status}))
    rounds = {"round": [0, 1], "sim_time_s": [0.0, 1.0], "test_accuracy": [0.1, 0.5], "total_energy_j": [0.0, 2.0],
              "host_wall_s": [0.0, 0.1]}  # fmt: skip
    if val:
        rounds |= {"val_accuracy": [0.1, float("nan")], "val_loss": [2.3, float("nan")]}
    pd.DataFrame(rounds).to_parquet(run_dir / "rounds.parquet")
    pd.DataFrame(
        {"round": [1], "device": ["raspberry_pi_4"], "steps": [3], "emulated_peak_memory_bytes": [1e6],
         "fits": [True], "emulated_train_time_s": [0.5], "fraction_params_trained": [1.0]}
    ).to_parquet(run_dir / "clients.parquet")  # fmt: skip


def test_compare_takes_overrides_and_an_untuned_lr_is_not_shown_as_chosen(tmp_path, capsys):
    """A comparison folder built by hand: both tuning runs diverged, so seed 7 (set on the command
    line) ran with the scenario's lr, 0.05, which no validation score chose."""
    from fedelastic.cli import main
    from fedelastic.comparisons.report import write_html

    path = tmp_path / "cmp.toml"
    path.write_text(tomli_w.dumps(_raw(tmp_path, tune={"lr": [0.1, 0.3], "rounds": 1})))
    out = tmp_path / "cmp"
    for lr in ("0.1", "0.3"):
        _hand_run(out / "tuning" / f"tiny-sbc-full-tune-lr{lr}-train" / "s0", "diverged", val=True)
    _hand_run(out / "runs" / "tiny-sbc-full" / "s7", "completed")
    capsys.readouterr()
    assert main(["compare", str(path), "compare.seeds=[7]", "--resume", str(out)]) == 0
    log = " ".join(capsys.readouterr().out.split())
    assert "train.lr (0.05) is used only where no tuning run completes" in log
    assert "0.05 (untuned)" in log and "(untuned): no tuning run of that cell completed" in log
    assert pd.read_csv(out / "summary.csv").seed.tolist() == [7]  # the override's seed, not the file's 3
    page = write_html(out).read_text()
    assert "No tuning run of sbc / full completed: its seeds ran with the scenario's own lr" in page
