"""elastic_artifact: ElasticTrainer on its artifact's own prior, and the artifact DP's counted work, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from fedelastic.errors import ConfigError
from fedelastic.selection.budgeted import select_artifact_dp
from fedelastic.selection.strategy import SelectionContext, make_strategy
from fedelastic.strategies.elastic_artifact import artifact_budget
from fedelastic.testing import _setup


def test_artifact_budget_is_the_1_to_2_split_of_the_whole_backward():
    # (rho - 1/3) * 3/2 of sum(t_dw + t_dx) = (0.5 - 1/3) * 1.5 * 10 = 2.5; rho 1/3 leaves nothing
    assert artifact_budget(0.5, np.array([1.0, 2.0]), np.array([3.0, 4.0])) == pytest.approx(2.5)
    assert artifact_budget(1 / 3, np.array([1.0]), np.array([1.0])) == pytest.approx(0.0)
    assert artifact_budget(1.0, np.array([1.0, 2.0]), np.array([3.0, 4.0])) == pytest.approx(10.0)


def test_artifact_dp_counts_its_cells():
    # unit grid (budget 3 over 3 units): w = d = [1, 1, 1], cap 3, rows 2 (the off-by-one quirk).
    # Updates: row 1 from p 0 at offset 2 (2 cells); row 2 from p 1 at offset 2 (2 cells) and p 0 at
    # offset 3 (1 cell): 5 cells x 7 = 35; inputs 4 x 3 = 12; row copies and argmax 2 x 3 rows x 4 = 24.
    ops: list[float] = []
    select_artifact_dp(np.ones(3), np.ones(3), np.ones(3), 3.0, resolution=3, ops=ops)
    assert ops == [71.0]


def test_elastic_artifact_selects_on_its_prior_not_the_cost_model():
    """The mask is the artifact DP's on (t_dw, t_dx) without the optimizer, budget by the 1:2 split."""
    _, info, cost = _setup("small_cnn", "jetson_nano")
    importance = np.random.default_rng(3).lognormal(0.0, 1.0, info.num_tensors)
    dw, dx = cost.t_dw, cost.t_dx
    for rho in (0.4, 0.6, 0.9):
        ctx = SelectionContext(info, cost, 0, np.random.default_rng(0))
        ctx.importance = importance
        sel = make_strategy("elastic_artifact", {"rho": rho}).select(ctx)
        budget = (rho - 1 / 3) * 1.5 * float(dw.sum() + dx.sum())  # by hand
        expected = select_artifact_dp(importance, dw, dx, budget, resolution=1000, artifact_grid=True)
        np.testing.assert_array_equal(sel.mask, expected)
        assert ctx.ops > 0  # the DP's counted work is charged


def test_elastic_artifact_below_its_forward_share():
    """rho 0.3 is below the prior's 1/3: nothing trains, or a ConfigError naming rho when asked."""
    _, info, cost = _setup("small_cnn", "jetson_nano")
    ctx = SelectionContext(info, cost, 0, np.random.default_rng(0))
    ctx.importance = np.ones(info.num_tensors)
    assert not make_strategy("elastic_artifact", {"rho": 0.3}).select(ctx).mask.any()
    with pytest.raises(ConfigError, match="rho"):
        make_strategy("elastic_artifact", {"rho": 0.3, "infeasible": "error"}).select(ctx)
