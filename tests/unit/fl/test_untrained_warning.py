"""A strategy that trains part of an untrained model warns at start-up, with the share it trains."""

from __future__ import annotations

import warnings

from fedelastic.fl.runner import run_scenario
from fedelastic.fl.untrained import UntrainedModelWarning

# small_cnn at width 8 on 8x8 digits, ten classes: parameters by tensor, counted by hand
CONVS = 1 * 8 * 9 + 8 * 16 * 9 + 16 * 32 * 9  # three bias-free 3x3 convs
NORMS = 2 * (8 + 16 + 32)  # gamma and beta of three BatchNorms
HEAD = 32 * 10 + 10
TOTAL = CONVS + NORMS + HEAD  # 6,482


def _run(make_scenario, run_id, **overrides):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_scenario(make_scenario(server={"rounds": 1}, **overrides), run_id=run_id)
    return [w for w in seen if issubclass(w.category, UntrainedModelWarning)]


def test_last_layer_from_scratch_warns_with_the_head_share(make_scenario):
    seen = _run(make_scenario, "head", train={"strategy": "last_layer"})
    assert len(seen) == 1
    share = f"{HEAD / TOTAL:.0%}"  # 5%
    assert share == "5%"
    message = str(seen[0].message)
    assert message.startswith(f"last_layer trains {share} of the parameters of an untrained model")
    assert "expect accuracy near chance (0.10)" in message


def test_bias_and_norm_strategy_from_scratch_warns(make_scenario):
    seen = _run(make_scenario, "bnb", train={"strategy": "bn_bias"})
    assert len(seen) == 1
    # every gamma and beta, and the whole head: 112 + 330 of 6,482 parameters
    assert str(seen[0].message).startswith(f"bn_bias trains {(NORMS + HEAD) / TOTAL:.0%} of the parameters")


def test_a_strategy_that_trains_most_of_the_model_does_not_warn(make_scenario):
    from fedelastic.environment import RunEnvironment
    from fedelastic.fl.untrained import trained_shares
    from fedelastic.train.pretrain import initial_state

    train = {"strategy": "elastic_tensor", "options": {"rho": 0.9}, "numerics": "fp32"}
    env = RunEnvironment(make_scenario(train=train))
    assert min(trained_shares(env, initial_state(env)).values()) > 0.5  # most tensors fit rho 0.9 on every device
    assert _run(make_scenario, "most", train=train) == []


def test_full_training_and_pretrained_partial_runs_do_not_warn(make_scenario):
    assert _run(make_scenario, "full", train={"strategy": "full"}) == []
    pretrained = {"name": "small_cnn", "options": {"width": 8}, "pretrain": {"classes": [0, 1, 2, 3, 4], "epochs": 1}}
    assert _run(make_scenario, "pre", train={"strategy": "last_layer"}, model=pretrained) == []
