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
    by = pd.read_csv(out / "summary_by_strategy.csv")
    assert set(by.strategy) == {"full", "head"} and "final_accuracy_mean" in by
    assert (out / "comparison.png").stat().st_size > 0
    assert len(pd.read_csv(out / "runs.csv")) == 4 * 3  # rounds 0..2 of each run
