import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tomli_w

from fedelastic.comparisons.comparison import expand, run_comparison
from fedelastic.errors import ConfigError
from tests.support import small_scenario_dict


def _raw(tmp_path, **compare):
    raw = small_scenario_dict(tmp_path)
    raw["compare"] = {
        "strategies": ["full", {"strategy": "last_layer", "label": "head"}],
        "fleets": {"sbc": {"raspberry_pi_4": 3}, "mcu": {"stm32h743": 3}},
        "seeds": [0, 1],
        **compare,
    }
    return raw


def test_expand_makes_every_combination(tmp_path):
    cfg, variants = expand(_raw(tmp_path), "cmp.toml")
    assert len(variants) == 2 * 2 * 2
    assert {(v.fleet, v.strategy, v.seed) for v in variants} == {
        (f, s, seed) for f in ("sbc", "mcu") for s in ("full", "head") for seed in (0, 1)
    }
    head = next(v for v in variants if v.strategy == "head")
    assert head.scenario.train.strategy == "last_layer" and head.scenario.fleet in (
        {"raspberry_pi_4": 3},
        {"stm32h743": 3},
    )


def test_expand_rejects_bad_entries(tmp_path):
    with pytest.raises(ConfigError) as info:
        expand(_raw(tmp_path, strategies=["full", "full"]), "cmp.toml")
    assert info.value.key == "compare.strategies"
    with pytest.raises(ConfigError) as info:
        expand(_raw(tmp_path, strategies=["nope"]), "cmp.toml")
    assert info.value.key == "train.strategy"
    with pytest.raises(ConfigError) as info:
        expand(_raw(tmp_path, sedes=[1]), "cmp.toml")
    assert info.value.key == "compare.sedes"


def test_comparison_writes_tables_and_figure(tmp_path):
    path = tmp_path / "cmp.toml"
    path.write_text(tomli_w.dumps(_raw(tmp_path, seeds=[0], target_accuracy=0.05)))
    out = run_comparison(path, output=tmp_path / "cmp")
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary) == 4 and summary.time_to_target_s.notna().all()
    assert all(str(out / "runs") in d for d in summary.run_dir)  # the runs live under the comparison
    by = pd.read_csv(out / "summary_by_strategy.csv")
    assert set(by.strategy) == {"full", "head"} and "final_accuracy_mean" in by and "final_accuracy_ci95" in by
    assert set(by.reached_target) == {"1/1"}
    assert (out / "comparison.png").stat().st_size > 0
    assert len(pd.read_csv(out / "runs.csv")) == 4 * 3  # rounds 0..2 of each run


def test_ci95_matches_hand_computed_t_interval():
    from fedelastic.comparisons.comparison import ci95

    # [1, 2, 3]: sd 1, t(0.975, df=2) = 4.302653 (tables) -> 4.302653 / sqrt(3)
    assert ci95(np.array([1.0, 2.0, 3.0])) == pytest.approx(4.302653 / 3**0.5, rel=1e-6)
    assert np.isnan(ci95(np.array([5.0])))


def test_time_to_target_is_censored_not_dropped():
    from fedelastic.comparisons.comparison import aggregate

    summary = pd.DataFrame(
        {
            "fleet": ["f"] * 3,
            "strategy": ["s"] * 3,
            "seed": [0, 1, 2],
            "run_dir": ["a", "b", "c"],
            "sim_time_s": [10.0, 20.0, 30.0],
            "energy_j": [1.0, 2.0, 3.0],
            "reached_target": [True, True, False],
            "time_to_target_s": [4.0, 8.0, np.nan],
            "energy_to_target_j": [0.5, 1.0, np.nan],
        }
    )
    row = aggregate(summary).iloc[0]
    assert row.reached_target == "2/3"
    # the unreached seed enters at its end time (30 s), so the mean is (4 + 8 + 30) / 3 and a lower bound
    assert row.time_to_target_s_mean == pytest.approx(14.0)
    assert row.energy_to_target_j_mean == pytest.approx((0.5 + 1.0 + 3.0) / 3)
    assert bool(row.time_to_target_s_is_lower_bound)
    assert row.sim_time_s_mean == pytest.approx(20.0)


def test_printed_table_spells_out_long_labels(tmp_path):
    from fedelastic.comparisons.comparison import mean_table

    pd.DataFrame(
        {
            "fleet": ["gpu", "gpu"],
            "strategy": ["full", "elastic_tensor_0.4"],
            "seeds": [3, 3],
            "final_accuracy_mean": [0.9, 0.8],
            "final_accuracy_ci95": [0.01, np.nan],
        }
    ).to_csv(tmp_path / "summary_by_strategy.csv", index=False)
    frame, legend = mean_table(tmp_path)
    assert list(frame.strategy) == ["full", "elastic_tensor_0.4"]  # whole, never abbreviated
    assert not any("elastic_tensor_0.4" in line for line in legend)
    assert list(frame["acc"]) == ["0.900 ± 0.010", "0.800"]


# -- seeds that did not complete, clipped intervals, exit codes ------------------------------------


def _summary(statuses, accuracy, time_s, energy_j, reached=None) -> pd.DataFrame:
    n = len(statuses)
    return pd.DataFrame(
        {
            "fleet": ["f"] * n,
            "strategy": ["s"] * n,
            "seed": list(range(n)),
            "status": statuses,
            "run_dir": ["x"] * n,
            "final_accuracy": accuracy,
            "sim_time_s": time_s,
            "energy_j": energy_j,
            **({"reached_target": reached, "time_to_target_s": time_s} if reached is not None else {}),
        }
    )


def test_a_diverged_seed_enters_no_mean_and_no_interval():
    from fedelastic.comparisons.comparison import aggregate

    # the diverged seed was recorded with zero time and energy: none of it may reach a mean
    summary = _summary(["completed", "diverged", "completed"], [0.8, 0.1, 0.9], [10.0, 0.0, 20.0], [1.0, 0.0, 3.0],
                       reached=[True, True, False])  # fmt: skip
    row = aggregate(summary).iloc[0]
    assert (row.seeds, row.used, row.failed, row.diverged, row.with_errors) == (3, "2/3", 0, 1, 0)
    assert row.final_accuracy_mean == pytest.approx(0.85)
    # [0.8, 0.9]: sd 0.0707107, t(0.975, df=1) = 12.706205 (tables) -> 12.706205 * 0.0707107 / sqrt(2)
    assert row.final_accuracy_ci95 == pytest.approx(12.706205 * 0.1 / 2, rel=1e-6)
    assert row.sim_time_s_mean == pytest.approx(15.0) and row.energy_j_mean == pytest.approx(2.0)
    assert row.reached_target == "1/2"  # of the seeds used


def test_failed_and_errored_seeds_are_counted_apart_and_left_out():
    from fedelastic.comparisons.comparison import aggregate

    nan = float("nan")
    summary = _summary(["failed", "completed_with_errors", "completed", "dead"], [nan, 0.2, 0.7, 0.3],
                       [nan, 1.0, 4.0, 0.5], [nan, 0.1, 2.0, 0.0])  # fmt: skip
    row = aggregate(summary).iloc[0]
    assert (row.used, row.failed, row.diverged, row.with_errors) == ("1/4", 2, 0, 1)  # 'dead': not completed
    assert row.final_accuracy_mean == pytest.approx(0.7) and np.isnan(row.final_accuracy_ci95)
    assert row.energy_j_mean == pytest.approx(2.0)
    none = aggregate(_summary(["failed", "diverged"], [nan, 0.1], [nan, 0.0], [nan, 0.0])).iloc[0]
    assert none.used == "0/2" and np.isnan(none.final_accuracy_mean) and np.isnan(none.sim_time_s_mean)


def test_intervals_are_clipped_at_physical_bounds():
    from fedelastic.comparisons.comparison import aggregate, interval_text

    summary = _summary(["completed"] * 3, [0.95, 0.99, 1.0], [0.1, 0.1, 5.0], [1.0, 2.0, 3.0])
    row = aggregate(summary).iloc[0]
    # times [0.1, 0.1, 5.0]: mean 1.7333, sd 2.82901, half-width 4.302653 * 2.82901 / sqrt(3) = 7.0277
    assert row.sim_time_s_ci95 == pytest.approx(7.0277, rel=1e-4)
    assert row.sim_time_s_low == 0.0  # not 1.7333 - 7.0277 = -5.29
    assert row.sim_time_s_high == pytest.approx(1.7333 + 7.0277, rel=1e-4)
    # accuracy [0.95, 0.99, 1.0]: mean 0.98, sd 0.026458, half-width 0.065726: the top is 1, not 1.0457
    assert row.final_accuracy_high == 1.0 and row.final_accuracy_low == pytest.approx(0.98 - 0.065726, rel=1e-4)
    # energy [1, 2, 3]: half-width 2.4841 reaches below 0 too
    assert row.energy_j_low == 0.0
    text = interval_text(row.sim_time_s_mean, row.sim_time_s_ci95, row.sim_time_s_low, row.sim_time_s_high, "{:.3g}")
    assert text == "1.73 [0, 8.76]"
    assert interval_text(2.0, 0.5, 1.5, 2.5, "{:.3g}") == "2 ± 0.5"  # not clipped: the symmetric form


def test_pareto_error_bars_never_reach_below_zero():
    from fedelastic.comparisons.comparison import aggregate
    from fedelastic.comparisons.report import _errors

    table = aggregate(_summary(["completed"] * 3, [0.5, 0.6, 0.7], [0.1, 0.1, 5.0], [40.0, 1.0, 1.0]))
    for stem in ("sim_time_s", "energy_j"):
        mean, err = _errors(table, stem)
        assert mean[0] - err[0, 0] == pytest.approx(0.0)  # the lower bar ends at 0
        assert err[1, 0] == pytest.approx(table[f"{stem}_ci95"].iloc[0])  # the upper one is the whole half-width


def test_exit_code_of_hand_built_tables():
    from fedelastic.comparisons.comparison import exit_code

    def code(*statuses):
        return exit_code(pd.DataFrame({"status": list(statuses)}))

    assert code("completed", "completed") == 0
    assert code("completed", "failed") == 3
    assert code("completed", "completed_with_errors") == 3
    assert code("failed", "diverged", "completed") == 4


def _hand_run(run_dir, status: dict, accuracy: list[float], time_s: list[float], energy_j: list[float]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text(json.dumps(status))
    pd.DataFrame(
        {
            "round": range(len(accuracy)),
            "sim_time_s": time_s,
            "test_accuracy": accuracy,
            "total_energy_j": energy_j,
            "host_wall_s": [0.0] * len(accuracy),
        }
    ).to_parquet(run_dir / "rounds.parquet")
    pd.DataFrame(
        {
            "round": [1, 1],
            "emulated_peak_memory_bytes": [1e6, 2e6],
            "fits": [True, True],
            "emulated_train_time_s": [0.5, 0.7],
            "fraction_params_trained": [1.0, 1.0],
        }
    ).to_parquet(run_dir / "clients.parquet")


def test_compare_exits_4_on_a_diverged_cell_and_keeps_going_past_a_raising_one(tmp_path, capsys):
    """A comparison folder built by hand: seed 0 completed, seed 1 diverged (with zero time and
    energy), seed 2's run raises when resumed (a checkpoint without a run folder's config)."""
    from fedelastic.cli import main
    from fedelastic.comparisons.report import write_html

    raw = small_scenario_dict(tmp_path)
    raw["compare"] = {"strategies": ["full"], "fleets": {"sbc": {"raspberry_pi_4": 3}}, "seeds": [0, 1, 2]}
    path = tmp_path / "cmp.toml"
    path.write_text(tomli_w.dumps(raw))
    cells = tmp_path / "cmp" / "runs" / "tiny-sbc-full"
    _hand_run(cells / "s0", {"status": "completed"}, [0.1, 0.6], [0.0, 2.0], [0.0, 5.0])
    diverged = {"status": "diverged", "divergence": {"round": 1, "reason": "training loss is NaN"}}
    _hand_run(cells / "s1", diverged, [0.1, 0.1], [0.0, 0.0], [0.0, 0.0])
    (cells / "s2").mkdir()
    (cells / "s2" / "status.json").write_text(json.dumps({"status": "failed", "error": "killed"}))
    (cells / "s2" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    capsys.readouterr()
    assert main(["compare", str(path), "--resume", str(tmp_path / "cmp")]) == 4
    log = capsys.readouterr().out
    assert "diverged: sbc / full / seed 1 (diverged in round 1: training loss is NaN)" in log
    assert "failed: sbc / full / seed 2" in log
    assert "1/3 (1 fail, 1 div)" in log  # the printed table's seeds used, with those left out counted
    summary = pd.read_csv(tmp_path / "cmp" / "summary.csv")
    assert summary.status.tolist() == ["completed", "diverged", "failed"]  # every seed keeps its row
    row = pd.read_csv(tmp_path / "cmp" / "summary_by_strategy.csv").iloc[0]
    assert (row.used, row.failed, row.diverged) == ("1/3", 1, 1)
    assert row.final_accuracy_mean == pytest.approx(0.6) and row.sim_time_s_mean == pytest.approx(2.0)
    assert row.energy_j_mean == pytest.approx(5.0)
    assert (tmp_path / "cmp" / "comparison.png").stat().st_size > 0
    page = write_html(tmp_path / "cmp").read_text()
    assert "Seeds left out of the means" in page and "<td>1/3</td>" in page
    assert "diverged: sbc / full / seed 1" in page


# -- fair learning rates ---------------------------------------------------------------------------


def test_tuning_picks_the_best_completed_grid_point():
    from fedelastic.comparisons.comparison import pick

    scores = pd.DataFrame(
        {
            "lr": [0.01, 0.03, 0.1, 0.3],
            "status": ["completed", "completed", "diverged", "completed_with_errors"],
            "val_accuracy": [0.70, 0.90, 0.95, 0.99],  # the two best did not complete
            "val_loss": [1.0, 0.5, 0.1, 0.05],
        }
    )
    assert pick(scores) == 1
    tie = pd.DataFrame(
        {"lr": [0.1, 0.01, 0.03], "status": ["completed"] * 3, "val_accuracy": [0.8] * 3, "val_loss": [0.4, 0.6, 0.4]}
    )
    assert pick(tie) == 2  # equal accuracy: the lower loss (0.4), then the smaller lr (0.03 over 0.1)
    assert pick(tie.assign(status="failed")) is None
    blown = pd.DataFrame(
        {"lr": [0.01, 0.1], "status": ["completed"] * 2, "val_accuracy": [0.3, 0.5], "val_loss": [1.2, float("nan")]}
    )
    assert pick(blown) == 0  # a completed run whose validation loss is NaN blew up: never chosen
    assert pick(scores.set_axis([10, 11, 12, 13])) == 11  # the index label, whatever the index


def test_validation_carve_is_disjoint_and_deterministic():
    from fedelastic.data import carve_validation

    parts = [np.array([0, 3, 5, 7, 9, 11, 13, 15, 17, 19]), np.array([1, 2, 4]), np.array([6])]
    kept, held = carve_validation(parts, 0.3, seed=5)
    for before, after in zip(parts, kept):
        assert set(after) <= set(before) and len(after) >= 1
    assert [len(k) for k in kept] == [7, 2, 1]  # round(0.3 * 10) = 3, round(0.9) = 1, a single sample stays
    assert len(held) == 4 and not set(held) & set(np.concatenate(kept))
    assert set(held) | set(np.concatenate(kept)) == set(np.concatenate(parts))
    again_kept, again = carve_validation(parts, 0.3, seed=5)
    assert np.array_equal(held, again) and all(np.array_equal(a, b) for a, b in zip(kept, again_kept))
    other = [carve_validation(parts, 0.3, seed=s)[1] for s in range(6, 12)]
    assert any(not np.array_equal(held, o) for o in other)  # the draw depends on the seed


def test_the_validation_split_comes_from_the_clients_training_data(make_scenario):
    from fedelastic.data import load_dataset, train_test_split
    from fedelastic.environment import RunEnvironment

    plain = RunEnvironment(make_scenario()).data
    env = RunEnvironment(make_scenario(data={"validation": 0.25}))
    data = env.data
    kept = np.concatenate(data.partitions)
    assert len(data.validation) > 0 and not set(data.validation) & set(kept)  # no client trains on it
    assert set(data.validation) | set(kept) == set(np.concatenate(plain.partitions))  # carved from the partitions
    # the indices point into the training split: recomputed by hand, none of its samples is a test sample
    ds = load_dataset("digits")
    train_idx, test_idx = train_test_split(ds.y, env.scenario.data.test_fraction, env.scenario.seed)
    assert not set(train_idx) & set(test_idx)
    held = data.validation_set
    assert np.array_equal(held.x, ds.x[train_idx[data.validation]]) and np.array_equal(
        held.y, ds.y[train_idx[data.validation]]
    )
    assert np.array_equal(RunEnvironment(make_scenario(data={"validation": 0.25})).data.validation, data.validation)


def test_validation_and_tune_keys_are_checked(tmp_path):
    from fedelastic.scenario import parse_scenario

    with pytest.raises(ConfigError) as info:
        parse_scenario(small_scenario_dict(tmp_path, data={"validation": 1.0}), "s.toml")
    assert info.value.key == "data.validation"
    for tune, key in (({"lr": [0.1, -1.0]}, "compare.tune.lr"),
                      ({"lr": [0.1], "bn_mode": ["sometimes"]}, "compare.tune.bn_mode[0]"),
                      ({"lr": [0.1], "validation": 0.0}, "compare.tune.validation")):  # fmt: skip
        with pytest.raises(ConfigError) as info:
            expand(_raw(tmp_path, tune=tune), "cmp.toml")
        assert info.value.key == key


def test_a_tuned_comparison_runs_the_seeds_with_the_chosen_values_and_resumes(tmp_path, capsys):
    from fedelastic.cli import main
    from fedelastic.comparisons.comparison import mean_table

    raw = small_scenario_dict(tmp_path, server={"rounds": 1})
    raw["compare"] = {
        "strategies": ["full", {"strategy": "last_layer", "label": "head"}],
        "fleets": {"sbc": {"raspberry_pi_4": 2}},
        "seeds": [0, 1],
        "tune": {"lr": [0.01, 0.1], "bn_mode": ["train"], "validation": 0.2, "widen": 1},
    }
    path = tmp_path / "cmp.toml"
    path.write_text(tomli_w.dumps(raw))
    out = tmp_path / "cmp"
    assert main(["compare", str(path), "--output", str(out)]) == 0
    tuning = pd.read_csv(out / "tuning.csv")
    # a two-rate grid's pick is at an edge: widen = 1 adds one rate a factor 10 beyond it (by hand)
    assert len(tuning) == 6 and (tuning.status == "completed").all() and tuning.val_accuracy.notna().all()
    summary = pd.read_csv(out / "summary.csv")
    table, _ = mean_table(out)
    for strategy, g in tuning.groupby("strategy"):
        first = g.iloc[:2].sort_values(["val_accuracy", "val_loss", "lr"], ascending=[False, True, True]).lr.iloc[0]
        assert g.lr.tolist() == pytest.approx([0.01, 0.1, 1.0 if first == 0.1 else 0.001])
        assert g.added.tolist() == [False, False, True]
        assert g.chosen.sum() == 1
        chosen = g[g.chosen].iloc[0]
        edge = "top" if chosen.lr == g.lr.max() else "bottom" if chosen.lr == g.lr.min() else ""
        assert (chosen.edge if isinstance(chosen.edge, str) else "") == edge
        shown = table[table.strategy == strategy].lr.iloc[0]
        assert shown.endswith(f"({edge} edge)") == bool(edge)
        best = g.sort_values(["val_accuracy", "val_loss", "lr"], ascending=[False, True, True]).iloc[0]
        assert bool(best.chosen)  # the argmax of the grid's own scores
        seeds = summary[summary.strategy == strategy]
        assert (seeds.lr == best.lr).all() and (seeds.bn_mode == "train").all()
    for run_dir in tuning.run_dir:  # scored on the held-out share: the tuning runs' rounds carry val_accuracy
        assert "val_accuracy" in pd.read_parquet(Path(run_dir) / "rounds.parquet")
    assert "val_accuracy" not in pd.read_parquet(Path(summary.run_dir[0]) / "rounds.parquet")  # seeds: all data
    by = pd.read_csv(out / "summary_by_strategy.csv")
    assert by.used.tolist() == ["2/2", "2/2"] and set(by.lr) == set(tuning[tuning.chosen].lr)
    capsys.readouterr()
    assert main(["compare", str(path), "--resume", str(out)]) == 0  # every cell, tuning included, read back
    assert capsys.readouterr().out.count("finished earlier") == 10
    assert pd.read_csv(out / "tuning.csv").equals(tuning)


def test_the_server_scores_val_accuracy_on_the_held_out_share(make_scenario):
    from fedelastic.data import load_dataset, train_test_split
    from fedelastic.environment import RunEnvironment
    from fedelastic.fl.runner import run_scenario
    from fedelastic.train.trainer import evaluate_model

    sc = make_scenario(data={"validation": 0.3}, server={"rounds": 1})
    rounds = pd.read_parquet(run_scenario(sc, run_id="val") / "rounds.parquet")
    assert rounds.val_accuracy.notna().all() and rounds.val_loss.notna().all()
    # round 0 is the initial model: scored by hand on the training-split samples the carve held out
    env = RunEnvironment(sc)
    ds = load_dataset("digits")
    train_idx, _ = train_test_split(ds.y, sc.data.test_fraction, sc.seed)
    held = train_idx[env.data.validation]
    accuracy, loss = evaluate_model(env.new_model(), ds.x[held], ds.y[held])
    assert rounds.val_accuracy.iloc[0] == pytest.approx(accuracy) and rounds.val_loss.iloc[0] == pytest.approx(loss)


def test_a_bad_option_of_a_compared_strategy_names_its_entry(tmp_path):
    bad = {"strategy": "elastic_tensor", "label": "et", "options": {"rho": -1}}
    with pytest.raises(ConfigError) as info:
        expand(_raw(tmp_path, strategies=["full", bad]), "cmp.toml")
    assert info.value.key == "compare.strategies[1].options.rho"
    raw = _raw(tmp_path)
    raw["compare"].pop("strategies")
    raw["train"] = {**raw["train"], "strategy": "elastic_tensor", "options": {"rho": -1}}
    with pytest.raises(ConfigError) as info:  # the scenario's own strategy: its own key
        expand(raw, "cmp.toml")
    assert info.value.key == "train.options.rho"
