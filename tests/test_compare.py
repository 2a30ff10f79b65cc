import numpy as np
import pandas as pd
import pytest
import tomli_w

from fedelastic.compare import expand, run_comparison
from fedelastic.errors import ConfigError

from .conftest import small_scenario_dict


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
    from fedelastic.compare import ci95

    # [1, 2, 3]: sd 1, t(0.975, df=2) = 4.302653 (tables) -> 4.302653 / sqrt(3)
    assert ci95(np.array([1.0, 2.0, 3.0])) == pytest.approx(4.302653 / 3**0.5, rel=1e-6)
    assert np.isnan(ci95(np.array([5.0])))


def test_time_to_target_is_censored_not_dropped():
    from fedelastic.compare import aggregate

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
    from fedelastic.compare import mean_table

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
    assert list(frame.strategy) == ["full", "S2"] and "S2 = elastic_tensor_0.4" in legend
    assert list(frame["acc"]) == ["0.900 ± 0.010", "0.800"]
