"""A comparison's statistics over seeds: paired differences, Holm's correction, the detectable
difference, the learning-rate grid's edge. Checked against hand computations and scipy."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from fedelastic.results.seedstats import detectable_difference, differences, holm


def test_holm_by_hand():
    # m = 3 finite p: 0.01 * 3 = 0.03; 0.03 * 2 = 0.06; 0.04 * 1 = 0.04 -> max(0.06, 0.04) = 0.06
    got = holm(np.array([0.01, 0.04, 0.03, np.nan]))
    assert got[:3] == pytest.approx([0.03, 0.06, 0.06]) and np.isnan(got[3])
    assert holm(np.array([0.5, 0.9])) == pytest.approx([1.0, 1.0])  # capped at 1


def test_detectable_difference_has_the_stated_power():
    sd, n, alpha = 0.04, 5, 0.05 / 6
    delta = detectable_difference(sd, n, alpha)
    crit = stats.t.ppf(1 - alpha / 2, n - 1)
    nc = delta * math.sqrt(n) / sd
    assert stats.nct.sf(crit, n - 1, nc) + stats.nct.sf(crit, n - 1, -nc) == pytest.approx(0.8, abs=1e-6)
    # many pairs: the normal approximation (z 0.975 + z 0.8) * sd / sqrt(n) = 2.801585 * sd / sqrt(n)
    assert detectable_difference(1.0, 2000, 0.05) == pytest.approx(2.801585 / math.sqrt(2000), rel=2e-3)
    assert math.isnan(detectable_difference(0.1, 1, 0.05)) and detectable_difference(0.0, 3, 0.05) == 0.0


def _summary():
    acc = {  # fleet -> strategy -> accuracy per seed 0, 1, 2
        "gpu": {"full": [0.95, 0.95, 0.95], "head": [0.84, 0.80, 0.88], "bias": [0.83, 0.81, 0.86]},
        "mcu": {"full": [0.96, 0.94, 0.97], "head": [0.85, 0.86, 0.84], "bias": [0.80, 0.90, 0.10]},
    }
    rows = [
        {"fleet": f, "strategy": s, "seed": seed, "status": "completed", "final_accuracy": v}
        for f, by in acc.items() for s, vals in by.items() for seed, v in enumerate(vals)
    ]  # fmt: skip
    rows[-1]["status"] = "diverged"  # mcu / bias / seed 2 enters no pair
    return pd.DataFrame(rows)


def test_differences_are_paired_by_seed_and_holm_corrected():
    out = differences(_summary())
    assert len(out) == 6 and out.attrs["tests"] == 6
    gpu = out[(out.fleet == "gpu") & (out.a == "full") & (out.b == "head")].iloc[0]
    # d = [0.11, 0.15, 0.07]: mean 0.11, sd 0.04, t = 0.11 / (0.04 / sqrt 3) = 4.763140; with 2 degrees of
    # freedom the t distribution's cdf is 1/2 + t / (2 sqrt(t^2 + 2)), so p = 1 - t / sqrt(t^2 + 2) = 0.041362
    assert gpu.seeds == 3 and gpu.mean_diff == pytest.approx(0.11) and gpu.sd_diff == pytest.approx(0.04)
    t = 0.11 / (0.04 / math.sqrt(3))
    assert gpu.p == pytest.approx(1 - t / math.sqrt(t**2 + 2), rel=1e-9)
    assert gpu.p == pytest.approx(0.041362, abs=1e-6)
    mcu = out[(out.fleet == "mcu") & (out.a == "full") & (out.b == "bias")].iloc[0]
    assert mcu.seeds == 2 and mcu.mean_diff == pytest.approx(((0.96 - 0.80) + (0.94 - 0.90)) / 2)
    assert mcu.p == pytest.approx(stats.ttest_rel([0.96, 0.94], [0.80, 0.90]).pvalue)
    assert out.p_holm.to_numpy() == pytest.approx(holm(out.p.to_numpy()))  # one family over both fleets
    assert not gpu.significant  # 0.041 is below 0.05 alone, not after 6 comparisons
    assert gpu.detectable == pytest.approx(detectable_difference(0.04, 3, 0.05 / 6))


def test_equal_seeds_are_a_tie_not_an_error():
    s = pd.DataFrame({"fleet": "f", "strategy": ["a", "a", "b", "b"], "seed": [0, 1, 0, 1], "final_accuracy": 0.9})
    row = differences(s).iloc[0]
    assert row.mean_diff == 0 and row.p == 1.0 and not row.significant


def _tune(tmp_path, monkeypatch, best_lr: float, widen: int, lr=(0.03, 0.1, 0.3)):
    """Tune one cell whose validation accuracy peaks at ``best_lr`` (no training: the scores are made up)."""
    from fedelastic.comparisons.comparison import _Cells, expand, expand_tuning
    from tests.support import small_scenario_dict

    raw = small_scenario_dict(tmp_path)
    raw["compare"] = {"strategies": ["full"], "tune": {"lr": list(lr), "widen": widen}}
    cfg, _ = expand(raw, "cmp.toml")

    def fake(self, cell, added=False):
        score = 1 - abs(math.log(cell.lr / best_lr))
        self.tuning.append({"fleet": cell.fleet, "strategy": cell.strategy, "lr": cell.lr, "bn_mode": cell.bn_mode,
                            "status": "completed", "val_accuracy": score, "val_loss": 1.0, "chosen": False,
                            "edge": "", "added": added, "run_dir": cell.scenario.name})  # fmt: skip

    monkeypatch.setattr(_Cells, "_tune_one", fake)
    (tmp_path / "cmp").mkdir(parents=True)
    cells = _Cells(tmp_path / "cmp", None, None, cfg, total=0)
    chosen = cells.tune(expand_tuning(raw, "cmp.toml"))
    return chosen, pd.read_csv(tmp_path / "cmp" / "tuning.csv"), tmp_path / "cmp"


def test_a_pick_at_the_top_widens_the_grid_geometrically_until_inside(tmp_path, monkeypatch):
    chosen, t, _ = _tune(tmp_path, monkeypatch, best_lr=1.0, widen=3)
    # top ratio 0.3 / 0.1 = 3: 0.9 (best so far, at the top), then 2.7 (worse): 0.9 is inside the grid
    assert t.lr.tolist() == pytest.approx([0.03, 0.1, 0.3, 0.9, 2.7])
    assert t.added.tolist() == [False, False, False, True, True]
    assert chosen.lr == pytest.approx(0.9) and chosen.scenario.train.lr == pytest.approx(0.9)
    assert chosen.scenario.name.endswith("-tune-lr0.9-" + chosen.bn_mode)
    assert t.chosen.tolist() == [False, False, False, True, False] and t.edge.isna().all()


def test_a_binding_limit_is_recorded_and_warned(tmp_path, monkeypatch, capsys):
    from fedelastic.comparisons.comparison import edge_warnings

    chosen, t, out = _tune(tmp_path, monkeypatch, best_lr=5.0, widen=1)
    assert t.lr.tolist() == pytest.approx([0.03, 0.1, 0.3, 0.9]) and chosen.lr == pytest.approx(0.9)
    assert t.edge[t.chosen].tolist() == ["top"]
    (line,) = edge_warnings(out)
    assert "lr 0.9 is at the top of the grid [0.03, 0.1, 0.3, 0.9] after 1 rate(s) added" in line
    assert "warning: " + line in capsys.readouterr().out


def test_a_pick_at_the_bottom_without_widening_only_warns(tmp_path, monkeypatch):
    from fedelastic.comparisons.comparison import edge_warnings

    chosen, t, out = _tune(tmp_path, monkeypatch, best_lr=0.001, widen=0)
    assert len(t) == 3 and chosen.lr == 0.03 and t.edge[t.chosen].tolist() == ["bottom"]
    assert "compare.tune.widen = N extends the grid" in edge_warnings(out)[0]
    chosen, t, _ = _tune(tmp_path / "w", monkeypatch, best_lr=0.001, widen=1)
    assert t.lr.tolist()[-1] == pytest.approx(0.009)  # bottom ratio 0.03 / 0.1 = 0.3


def test_a_single_rate_has_no_edge(tmp_path, monkeypatch):
    chosen, t, _ = _tune(tmp_path, monkeypatch, best_lr=5.0, widen=2, lr=(0.1,))
    assert len(t) == 1 and chosen.lr == 0.1 and t.edge.isna().all()


def test_seed_table_and_differences_table_read_the_comparison_folder(tmp_path):
    from fedelastic.comparisons.comparison import differences_table, seed_table

    s = _summary()
    s.to_csv(tmp_path / "summary.csv", index=False)
    differences(s).to_csv(tmp_path / "differences.csv", index=False)
    seeds = seed_table(tmp_path)
    assert seeds.columns.tolist() == ["fleet", "strategy", "seed 0", "seed 1", "seed 2"]
    assert seeds.iloc[0].tolist() == ["gpu", "full", "0.950", "0.950", "0.950"]  # every seed shown, not only a mean
    assert seeds.iloc[-1].tolist() == ["mcu", "bias", "0.800", "0.900", "diverged"]
    frame, legend = differences_table(tmp_path)
    p_holm = f"{differences(s).p_holm[0]:.3g}"
    assert frame.iloc[0].tolist()[:7] == ["gpu", "full − head", 3, "+0.110", "0.0414", p_holm, "no"]
    assert "Holm-Bonferroni over the 6 pairs" in legend[0] and "0.05/6" in legend[1]


def test_tune_lr_widens_a_fake_objective_along_a_hand_worked_sequence():
    from fedelastic.comparisons.comparison import tune_lr

    tried = []

    def score(lr):  # peaks at lr 1.0; diverges (NaN) above 5
        tried.append(lr)
        return float("nan") if lr > 5 else -abs(math.log10(lr))

    # [0.01, 0.03, 0.1]: 0.1 is best and at the top; the top ratio 0.1 / 0.03 = 3.333: 0.333333, then
    # 1.11111 (best, top), then 3.7037 (worse): 1.11111 is interior after 3 rates added
    s = tune_lr(score, (0.01, 0.03, 0.1), max_widen=5)
    assert tried == pytest.approx([0.01, 0.03, 0.1, 0.333333, 1.11111, 3.7037])
    assert s.chosen == pytest.approx(1.11111) and s.edge == "" and s.added == 3
    # the limit binds: after 1 rate added the choice is still at the top, and says so
    s = tune_lr(score, (0.01, 0.03, 0.1), max_widen=1)
    assert list(s.scores) == pytest.approx([0.01, 0.03, 0.1, 0.333333]) and s.chosen == pytest.approx(0.333333)
    assert s.edge == "top" and s.added == 1
    # a diverged rate above the best bounds it: the choice is interior, nothing added
    s = tune_lr(score, (0.3, 3.0, 30.0), max_widen=3)
    assert s.chosen == 3.0 and s.edge == "" and s.added == 0
    # at the bottom: the ratio 0.3 / 3 = 0.1 per step; ties go to the smaller rate
    s = tune_lr(lambda lr: float(lr <= 30), (30.0, 300.0), max_widen=2)
    assert list(s.scores) == pytest.approx([30.0, 300.0, 3.0, 0.3]) and s.chosen == 0.3 and s.edge == "bottom"
    # nothing usable: no choice
    assert tune_lr(lambda lr: float("nan"), (0.1, 1.0), max_widen=2).chosen is None
