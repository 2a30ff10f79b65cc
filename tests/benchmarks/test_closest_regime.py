"""The closest-regime script's learning-rate widening and paired summary, against hand computations."""

import math

import pytest

from tests.support import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "reproduce" / "closest_regime" / "run.py"


@pytest.fixture(scope="module")
def run():
    return load_script(SCRIPT, "closest_regime_run")


def _runs(scores: dict[float, float | None]) -> list[dict]:
    """Validation runs: None marks a diverged run."""
    return [{"lr": lr, "accuracy": a or 0.0, "diverged": a is None} for lr, a in scores.items()]


def test_a_pick_at_an_edge_widens_one_ladder_step_and_stops_when_interior(run):
    assert run.widen(_runs({3e-3: 0.5, 1e-2: 0.6, 3e-2: 0.7})) == (3e-2, [0.1], "edge")
    assert run.widen(_runs({3e-3: 0.7, 1e-2: 0.6, 3e-2: 0.5})) == (3e-3, [1e-3], "edge")
    assert run.widen(_runs({3e-3: 0.5, 1e-2: 0.6, 3e-2: 0.7, 0.1: 0.65})) == (3e-2, [], "interior")
    # a diverged neighbour counts as worse: the pick is interior
    assert run.widen(_runs({3e-3: 0.5, 1e-2: 0.6, 3e-2: None})) == (1e-2, [], "interior")
    # the ladder's end: nothing further to try, and it says the limit binds
    best, more, status = run.widen(_runs({1e-4: 0.7, 3e-4: 0.6, 1e-3: 0.5}))
    assert (best, more) == (1e-4, []) and "limit binds" in status
    # a tie goes to an interior rate, then to the smaller: a flat score does not walk to the ladder's end
    assert run.widen(_runs({1e-3: 0.5, 3e-3: 0.6, 1e-2: 0.6, 3e-2: 0.4}))[:2] == (3e-3, [])
    assert run.widen(_runs({3e-3: 0.1, 1e-2: 0.1, 3e-2: 0.1})) == (1e-2, [], "interior")
    assert run.widen(_runs({3e-3: 0.6, 1e-2: 0.5, 3e-2: 0.6})) == (3e-3, [1e-3], "edge")


def test_the_summary_pairs_seeds_with_full(run):
    def r(arm, seed, acc, diverged=False):
        return {"arm": arm, "strategy": arm, "lr": 0.01, "seed": seed, "accuracy": acc, "diverged": diverged,
                "fraction_trained": 0.5, "first_trained_depth": 0.2, "emulated_train_s": 1.0}  # fmt: skip

    doc = {
        "runs": [
            r("full", 0, 0.80),
            r("full", 1, 0.82),
            r("x", 0, 0.85),
            r("x", 1, 0.83),
            r("y", 0, 0.9, True),
            r("y", 1, 0.7),
        ],
        "picks": {a: {"lr": 0.01, "status": "interior"} for a in ("full", "x", "y")},
    }
    rows = {row["arm"]: row for row in run.summary(doc)}
    assert rows["x"]["vs_full_points"] == pytest.approx(3.0)  # differences 5 and 1 points
    # t(0.975, 1) = 12.7062 times sd(5, 1) = 2.8284 over sqrt(2)
    assert rows["x"]["vs_full_ci95"] == pytest.approx(12.7062 * 2.8284 / math.sqrt(2), rel=1e-4)
    assert rows["x"]["mean"] == pytest.approx(0.84)
    # a diverged seed is never averaged: y keeps seed 1 only (70 - 82 = -12 points, no interval from one pair)
    assert rows["y"]["diverged"] == 1 and rows["y"]["mean"] == pytest.approx(0.7)
    assert rows["y"]["vs_full_points"] == pytest.approx(-12.0) and math.isnan(rows["y"]["vs_full_ci95"])
