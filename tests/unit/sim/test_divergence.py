"""The divergence detector on hand-built sequences, and its settings' errors.

Runs that diverge end to end (status 'diverged', exit 4, rejected clients) are in
``tests/integration/test_diverged_runs.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedelastic.errors import ConfigError
from fedelastic.sim.divergence import Detector, collapse_share, weight_norm

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


def test_a_collapse_whose_test_loss_falls_is_not_divergence():
    """The trust review's scenario B: every prediction class 3 in round 3, yet the test loss fell
    every round (2.3047 -> 2.3017): barely trained, not broken."""
    d = Detector(classes=10)
    balanced = np.full(10, 36)
    spread, collapsed = np.array([50, 30, 40, 60, 20, 30, 40, 30, 30, 30]), np.eye(10, dtype=int)[3] * 360
    assert d.observe(0, test_loss=2.3047, predicted=spread, actual=balanced) == ""
    assert d.observe(1, test_loss=2.3036, predicted=collapsed, actual=balanced) == ""
    assert d.observe(2, test_loss=2.3028, predicted=collapsed, actual=balanced) == ""
    assert d.observe(3, test_loss=2.3017, predicted=collapsed, actual=balanced) == "" and d.first is None


def test_a_model_that_trains_nothing_keeps_its_loss_and_does_not_diverge():
    d = Detector(classes=10)
    balanced, collapsed = np.full(10, 36), np.eye(10, dtype=int)[0] * 360
    for rnd in range(6):  # an untrained model whose clients all idle: the same evaluation every round
        assert d.observe(rnd, test_loss=2.3026, predicted=collapsed, actual=balanced) == ""


def test_a_collapse_with_a_worse_loss_must_last_collapse_rounds_evaluations():
    """A pretrained model meeting new classes on skewed clients (shipped deadline_elastic, seed 1):
    collapsed for one round with its loss 12% up, then recovered. Two evaluations in a row are a
    breakdown (lr 0.5, frozen statistics: best 2.1558, then 2.3228 and 2.3116, all class 0)."""
    balanced, collapsed = np.array([34, 33, 33]), np.array([100, 0, 0])
    transient = Detector(collapse_margin=0.05, collapse_rounds=2)
    assert transient.observe(0, test_loss=4.2329, predicted=np.array([45, 30, 25]), actual=balanced) == ""
    assert transient.observe(1, test_loss=4.7493, predicted=np.array([96, 2, 2]), actual=balanced) == ""
    assert transient.observe(2, test_loss=2.2896, predicted=np.array([47, 30, 23]), actual=balanced) == ""
    assert transient.observe(3, test_loss=4.9, predicted=collapsed, actual=balanced) == ""  # the streak restarts
    assert transient.first is None
    broken = Detector(collapse_margin=0.05, collapse_rounds=2)
    assert broken.observe(10, test_loss=2.1558, predicted=np.array([36, 32, 32]), actual=balanced) == ""
    assert broken.observe(11, test_loss=2.3228, predicted=collapsed, actual=balanced) == ""  # one: not yet
    assert broken.observe(12, test_loss=2.2600, predicted=collapsed, actual=balanced) == ""  # 2.26 <= 1.05 x 2.1558
    assert broken.observe(13, test_loss=2.3116, predicted=collapsed, actual=balanced) == ""  # the streak restarted
    reason = broken.observe(14, test_loss=2.3097, predicted=collapsed, actual=balanced)
    assert reason == (
        "100.0% of the test predictions are class 0 and the test loss 2.31 is above 1.05 x the best before "
        "(2.156), 2 evaluations running"
    )
    assert broken.first.round == 14 and broken.first.checks == ("collapse",)
    once = Detector(collapse_rounds=1)
    once.observe(0, test_loss=2.0, predicted=np.array([40, 30, 30]), actual=balanced)
    assert once.observe(1, test_loss=2.2, predicted=collapsed, actual=balanced) != ""  # 2.2 > 2.1


def test_rounds_not_evaluated_do_not_break_a_collapse_streak():
    d = Detector(collapse_rounds=2)
    balanced, collapsed = np.array([34, 33, 33]), np.array([0, 100, 0])
    d.observe(0, test_loss=1.0, predicted=np.array([40, 30, 30]), actual=balanced)
    assert d.observe(1, test_loss=3.0, predicted=collapsed, actual=balanced) == ""
    assert d.observe(2) == ""  # server.evaluate_every: no evaluation this round
    assert "class 1" in d.observe(3, test_loss=3.1, predicted=collapsed, actual=balanced)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_test_loss_diverges(bad):
    """The asynchronous fault run: a NaN test loss for four rounds, then back to 0.73. It diverged."""
    d = Detector(classes=10)
    d.observe(0, test_loss=2.3)
    assert d.observe(3, test_loss=bad) == f"the test loss is {bad:g}" and d.first.checks == ("test_loss",)
    assert Detector().observe(1) == "" and Detector().observe(1, test_loss=None) == ""  # not evaluated


def test_advice_names_the_setting_most_likely_at_fault():
    from fedelastic.sim.divergence import advice

    first_round_nan = {"round": 1, "reason": "the mean train loss is nan", "checks": ["loss"]}
    assert "check the data for NaN/inf" in advice(first_round_nan, lr=0.05, bn_mode="train", pretrained=False)
    rejected = {"round": 1, "reason": "3 of 4 clients that trained sent non-finite updates", "checks": ["rejected"]}
    assert "data" in advice(rejected, lr=0.05, bn_mode="train", pretrained=False)
    norm = {"round": 4, "reason": "the global weights' norm 900 is above 100 x the initial 8", "checks": ["norm"]}
    assert advice(norm, lr=0.5, bn_mode="train", pretrained=False) == "lower train.lr (now 0.5)"
    frozen = advice(norm, lr=0.5, bn_mode="frozen", pretrained=False)
    assert frozen.startswith("lower train.lr (now 0.5) or set train.bn_mode") and "frozen" in frozen
    assert "bn_mode" in advice(norm, lr=0.5, bn_mode="auto", pretrained=True)  # auto: frozen when pretrained
    assert "bn_mode" not in advice(norm, lr=0.5, bn_mode="auto", pretrained=False)


def test_collapse_needs_three_classes_and_a_test_set_that_is_not_one_class():
    two = Detector(collapse_rounds=1)
    two.observe(0, test_loss=1.0, predicted=np.array([50, 50]), actual=np.array([50, 50]))
    assert two.observe(1, test_loss=9.0, predicted=np.array([100, 0]), actual=np.array([50, 50])) == ""
    skewed = Detector(collapse_rounds=1)
    skewed.observe(0, test_loss=1.0, predicted=np.array([50, 25, 25]), actual=np.array([96, 2, 2]))
    assert skewed.observe(1, test_loss=9.0, predicted=np.array([100, 0, 0]), actual=np.array([96, 2, 2])) == ""
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
        ("divergence", "collapse_margin", -0.1),
        ("divergence", "collapse_rounds", 0),
        ("simulation", "on_divergence", "pause"),
    ],
)
def test_bad_divergence_settings_name_their_key(make_scenario, section, key, value):
    with pytest.raises(ConfigError, match=key):
        make_scenario(**{section: {key: value}})


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
