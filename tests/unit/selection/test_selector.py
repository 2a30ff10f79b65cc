"""Tests of the budgeted tensor selectors in :mod:`fedelastic.selection.budgeted`."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fedelastic.selection.budgeted import backward_cost, select_artifact_dp, select_exact, select_greedy_ratio, to_grid

RTOL = 1e-9  # relative slack for float comparisons of costs and objectives


def all_masks(n: int) -> np.ndarray:
    """Every 0/1 mask over ``n`` tensors, as a (2**n, n) bool array."""
    return np.array(list(itertools.product([False, True], repeat=n)), dtype=bool).reshape(-1, n)


def deepest(mask: np.ndarray) -> int:
    """Smallest selected index of a non-empty mask."""
    return int(np.flatnonzero(mask)[0])


def brute_force(importance, t_dw, t_dx, budget, resolution, eligible=None) -> tuple[float, float]:
    """Best objective (rounded-up integer costs, real costs), written independently of the DP."""
    if budget <= 0:
        return 0.0, 0.0  # by convention a non-positive budget selects nothing
    n = len(importance)
    # non-empty masks; the empty one (objective 0) is always feasible
    masks = all_masks(n)[1:]
    if eligible is not None:
        masks = masks[~np.any(masks & ~eligible, axis=1)]
    k_min = np.argmax(masks, axis=1)
    chain = np.array([t_dx[j + 1 :].sum() for j in range(n)])
    values = masks @ importance
    w_units = to_grid(t_dw, budget, resolution)
    chain_units = to_grid(chain, budget, resolution)
    rounded = masks @ w_units + chain_units[k_min]
    real = masks @ t_dw + chain[k_min]
    best_rounded = max(0.0, values[rounded <= resolution].max(initial=0.0))
    best_real = max(0.0, values[real <= budget].max(initial=0.0))
    return float(best_rounded), float(best_real)


def random_instance(rng: np.random.Generator):
    """A small random instance: mixed-sign importance, costs with zeros, random budget."""
    n = int(rng.integers(1, 11))
    importance = rng.normal(0.5, 1.0, n)
    if rng.random() < 0.25:
        # integer costs on a unit grid: rounding is exact, snapping is exercised
        t_dw = rng.integers(0, 6, n).astype(float)
        t_dx = rng.integers(0, 4, n).astype(float)
        budget = float(rng.integers(1, 20))
        resolution = int(budget)
    else:
        t_dw = rng.exponential(1.0, n) * (rng.random(n) > 0.2)
        t_dx = rng.exponential(0.5, n) * (rng.random(n) > 0.3)
        total = t_dw.sum() + t_dx.sum()
        budget = float(rng.uniform(-0.05, 0.9) * total)
        resolution = int(rng.choice([5, 17, 100, 1000]))
    return importance, t_dw, t_dx, budget, resolution


def objective(mask: np.ndarray, importance: np.ndarray) -> float:
    return float(np.asarray(importance)[mask].sum())


def assert_feasible(mask, t_dw, t_dx, budget) -> None:
    cost = backward_cost(mask, t_dw, t_dx)
    if mask.any():
        assert cost <= budget * (1 + RTOL) + 1e-12, (cost, budget)
    else:
        assert cost == 0.0


# --- cost model -------------------------------------------------------------------------------


def test_backward_cost_hand_computed():
    t_dw = np.array([1.0, 2.0, 4.0, 8.0])
    t_dx = np.array([10.0, 20.0, 40.0, 80.0])

    def cost(bits: list[int]) -> float:
        return backward_cost(np.array(bits, dtype=bool), t_dw, t_dx)

    assert cost([0, 0, 0, 0]) == 0.0
    assert cost([0, 0, 0, 1]) == 8.0  # deepest is the last: its own t_dx is not charged
    assert cost([0, 0, 1, 0]) == 4.0 + 80.0
    assert cost([0, 1, 0, 1]) == 2.0 + 8.0 + 40.0 + 80.0
    assert cost([1, 0, 0, 0]) == 1.0 + 20.0 + 40.0 + 80.0
    assert cost([1, 1, 1, 1]) == 15.0 + 140.0


def test_backward_cost_monotone_in_deepest():
    rng = np.random.default_rng(7)
    for _ in range(100):
        n = int(rng.integers(3, 12))
        t_dw = rng.exponential(1.0, n) * (rng.random(n) > 0.2)
        t_dx = rng.exponential(1.0, n) * (rng.random(n) > 0.2)
        top = int(rng.integers(1, n))
        above = np.zeros(n, dtype=bool)
        above[top:] = rng.random(n - top) < 0.5
        above[top] = True  # fixed set above, its deepest at `top`
        costs = []
        # move the extra, deepest tensor toward the input
        for j in range(top - 1, -1, -1):
            m = above.copy()
            m[j] = True
            costs.append(backward_cost(m, t_dw, t_dx) - t_dw[j])
        assert np.all(np.diff(costs) >= -1e-12)


def test_to_grid_rounds_up_and_snaps():
    units = to_grid(
        np.array([0.0, 0.1, 1.0, 1.0000000000001, 2.5, 99.0]),
        budget=10.0,
        resolution=10,
    )
    assert units.tolist() == [0, 1, 1, 1, 3, 11]  # 99 is clipped to resolution + 1


# --- exact selector ---------------------------------------------------------------------------


def test_exact_matches_brute_force():
    rng = np.random.default_rng(2024)
    for _ in range(1000):  # about 670 reach the brute-force comparison
        importance, t_dw, t_dx, budget, resolution = random_instance(rng)
        eligible = rng.random(len(importance)) < 0.8 if rng.random() < 0.3 else None
        mask = select_exact(importance, t_dw, t_dx, budget, resolution=resolution, eligible=eligible)
        assert mask.dtype == bool and mask.shape == importance.shape
        assert_feasible(mask, t_dw, t_dx, budget)
        assert not np.any(mask & (importance <= 0))
        if eligible is not None:
            assert not np.any(mask & ~eligible)
        value = objective(mask, importance)
        best_rounded, best_real = brute_force(importance, t_dw, t_dx, budget, resolution, eligible)
        positive = importance > 0 if eligible is None else (importance > 0) & eligible
        if budget > 0 and backward_cost(positive, t_dw, t_dx) <= budget:
            # everything worth taking fits the real budget: returned as is, no rounding loss
            assert np.array_equal(mask, positive)
        else:  # small lists are never trimmed: optimal on real costs, at least the grid's optimum
            assert value == pytest.approx(best_real, rel=RTOL, abs=1e-12)
            assert value >= best_rounded - 1e-9


@pytest.mark.parametrize("budget", [0.0, -1.0])
def test_exact_nonpositive_budget_is_empty(budget):
    mask = select_exact(np.ones(3), np.zeros(3), np.zeros(3), budget)
    assert not mask.any()


def test_exact_edge_cases():
    assert select_exact(np.array([]), np.array([]), np.array([]), 1.0).shape == (0,)
    assert not select_exact(-np.ones(4), np.ones(4), np.ones(4), 100.0).any()
    # zero-cost tensors are free: all of them are taken, within any positive budget
    mask = select_exact(np.array([1.0, 2.0, 3.0]), np.zeros(3), np.zeros(3), 1e-6)
    assert mask.all()
    # an infinite budget takes every positive tensor
    mask = select_exact(np.array([1.0, -2.0, 3.0]), np.ones(3), np.ones(3), np.inf)
    assert mask.tolist() == [True, False, True]
    # a single tensor that costs exactly the budget is selected despite float rounding
    mask = select_exact(np.array([0.0, 1.0]), np.array([0.0, 0.3]), np.array([0.0, 0.0]), 0.3)
    assert mask.tolist() == [False, True]


def test_exact_prefers_chain_aware_choice():
    # tensor 0 is the most important alone, but reaching it costs the whole dx chain
    importance = np.array([10.0, 4.0, 4.0, 4.0])
    t_dw = np.ones(4)
    t_dx = np.array([0.0, 5.0, 1.0, 1.0])
    mask = select_exact(importance, t_dw, t_dx, budget=7.0)
    assert mask.tolist() == [False, True, True, True]
    assert select_exact(importance, t_dw, t_dx, budget=11.0).all()


def test_exact_respects_eligible():
    importance = np.array([1.0, 5.0, 2.0, 3.0])
    t_dw = np.ones(4)
    t_dx = np.ones(4)
    eligible = np.array([True, False, True, True])
    mask = select_exact(importance, t_dw, t_dx, budget=4.0, eligible=eligible)
    # tensor 1 is not selectable, but the chain to tensor 0 still pays its t_dx
    assert mask.tolist() == [False, False, True, True]
    mask = select_exact(importance, t_dw, t_dx, budget=100.0, eligible=eligible)
    assert mask.tolist() == [True, False, True, True]
    with pytest.raises(ValueError):
        select_exact(importance, t_dw, t_dx, 1.0, eligible=np.ones(3, dtype=bool))


def test_exact_rejects_bad_inputs():
    with pytest.raises(ValueError):
        select_exact(np.ones(2), np.array([1.0, -1.0]), np.ones(2), 1.0)
    with pytest.raises(ValueError):
        select_exact(np.ones(2), np.ones(3), np.ones(2), 1.0)
    with pytest.raises(ValueError):
        select_exact(np.array([1.0, np.nan]), np.ones(2), np.ones(2), 1.0)
    with pytest.raises(ValueError):
        select_exact(np.ones(2), np.ones(2), np.ones(2), 1.0, resolution=0)


# --- the artifact's DP ------------------------------------------------------------------------
# Known quirks (ALGORITHMS.md section 1, see select_artifact_dp's docstring):
# * it keeps one solution per DP state, so it is not always optimal;
# * an off-by-one in its row count means the tensor nearest the input (index 0) is never
#   eligible;
# * it charges the deepest selected tensor's own t_dx (k >= k_min), one term more than
#   backward_cost, so its masks stay feasible for our cost model.


def test_artifact_feasible_never_tensor0_and_not_better_than_exact():
    rng = np.random.default_rng(99)
    for _ in range(400):
        importance, t_dw, t_dx, budget, resolution = random_instance(rng)
        mask = select_artifact_dp(importance, t_dw, t_dx, budget, resolution=resolution)
        assert mask.dtype == bool and mask.shape == importance.shape
        assert_feasible(mask, t_dw, t_dx, budget)
        assert not mask[0]
        exact = select_exact(importance, t_dw, t_dx, budget, resolution=resolution)
        assert objective(exact, importance) >= objective(mask, importance) - 1e-9


def test_artifact_off_by_one_excludes_tensor0():
    importance = np.array([10.0, 1.0])
    t_dw = np.ones(2)
    t_dx = np.zeros(2)
    assert select_exact(importance, t_dw, t_dx, 1.0).tolist() == [True, False]
    assert select_artifact_dp(importance, t_dw, t_dx, 1.0).tolist() == [False, True]


def test_artifact_one_solution_per_state_is_suboptimal():
    # On the unit grid (budget == resolution) with the artifact's own cost model, {1, 2}
    # costs 0 + t_dx[1..3] = 2 for importance 10. The DP keeps only {3} (importance 8) at
    # the state where tensor 2 would have to chain, and loses {1, 2}.
    importance = np.array([3.0, 5.0, 5.0, 8.0])
    t_dw = np.array([1.0, 0.0, 0.0, 1.0])
    t_dx = np.array([1.0, 0.0, 1.0, 1.0])
    mask = select_artifact_dp(importance, t_dw, t_dx, 2.0, resolution=2)
    assert mask.tolist() == [False, False, False, True]
    exact = select_exact(importance, t_dw, t_dx, 2.0, resolution=2)
    assert objective(exact, importance) >= 10.0


def test_artifact_reference_example():
    # The artifact's own small example (given loss-side first): t_dy = [0, 2, 1, 4, 0],
    # t_dw = [5, 1, 7, 3, 1], I = [1, 3, 10, 5, 3], rho = 0.6 -> capacity int(0.6 * 24) = 14.
    # Running the artifact gives importance 13 with loss-side layers 1 and 2 selected.
    importance = np.array([1.0, 3.0, 10.0, 5.0, 3.0])[::-1]
    t_dw = np.array([5.0, 1.0, 7.0, 3.0, 1.0])[::-1]
    t_dx = np.array([0.0, 2.0, 1.0, 4.0, 0.0])[::-1]
    mask = select_artifact_dp(importance, t_dw, t_dx, 14.0, resolution=14)
    assert mask[::-1].tolist() == [False, True, True, False, False]


def test_artifact_grid_option_and_edges():
    importance = np.array([1.0, 2.0, 3.0])
    t_dw = np.array([1.0, 1.0, 1.0])
    t_dx = np.array([1.0, 1.0, 1.0])
    mask = select_artifact_dp(importance, t_dw, t_dx, 3.0, artifact_grid=True)
    assert mask.tolist() == [False, False, True]
    mask = select_artifact_dp(importance, t_dw, t_dx, np.inf, artifact_grid=True)
    assert mask.tolist() == [False, True, True]
    zero = np.zeros(3)
    mask = select_artifact_dp(importance, zero, zero, 1.0, artifact_grid=True)
    assert mask.tolist() == [False, True, True]
    assert not select_artifact_dp(importance, t_dw, t_dx, 0.0).any()
    none = np.array([])
    assert select_artifact_dp(none, none, none, 1.0).shape == (0,)


# --- greedy ------------------------------------------------------------------------------------


def test_greedy_feasible_and_respects_eligible():
    rng = np.random.default_rng(5)
    for _ in range(300):
        importance, t_dw, t_dx, budget, _ = random_instance(rng)
        eligible = rng.random(len(importance)) < 0.7
        mask = select_greedy_ratio(importance, t_dw, t_dx, budget, eligible=eligible)
        assert_feasible(mask, t_dw, t_dx, budget)
        assert not np.any(mask & ~eligible)
        assert not np.any(mask & (importance <= 0))


def grid_reference(importance, t_dw, t_dx, budget, resolution) -> float:
    """Best objective with costs rounded up to ``resolution`` units of the budget (a feasible lower bound)."""
    n = len(importance)
    w = to_grid(t_dw, budget, resolution)
    chain = to_grid(np.array([t_dx[j + 1 :].sum() for j in range(n)]), budget, resolution)
    dp = np.zeros(resolution + 1)  # knapsack over the tensors above the current deepest
    best = 0.0
    for j in range(n - 1, -1, -1):
        if j + 1 < n and importance[j + 1] > 0 and w[j + 1] <= resolution:
            wi = w[j + 1]
            dp[wi:] = np.maximum(dp[wi:], dp[: resolution + 1 - wi] + importance[j + 1])
        room = resolution - w[j] - chain[j]
        if importance[j] > 0 and room >= 0:
            best = max(best, importance[j] + dp[room])
    return float(best)


@pytest.mark.parametrize("n", [200, 300])
def test_exact_against_a_high_resolution_reference(n):
    rng = np.random.default_rng(n)
    t_dw = rng.exponential(1.0, n) * (rng.random(n) < 0.7) + 0.01
    t_dx = rng.exponential(1.0, n)
    importance = np.abs(rng.normal(size=n)) * rng.exponential(1.0, n)
    budget = 0.4 * (t_dw.sum() + t_dx.sum())
    mask = select_exact(importance, t_dw, t_dx, budget)
    assert_feasible(mask, t_dw, t_dx, budget)
    value = objective(mask, importance)
    fine = grid_reference(importance, t_dw, t_dx, budget, 100_000)
    coarse = grid_reference(importance, t_dw, t_dx, budget, 1000)  # what the 1000-unit grid found
    assert value >= fine - 1e-9 and fine > coarse  # rounding on the coarse grid leaves value behind
    assert value <= fine * 1.001  # the fine grid is within a hair of the optimum


def test_trimmed_lists_stay_within_the_budget_resolution(monkeypatch):
    import fedelastic.selection.budgeted as selector

    rng = np.random.default_rng(7)
    n = 120
    t_dw = rng.exponential(1.0, n) + 0.01
    t_dx = rng.exponential(0.5, n)
    importance = rng.exponential(1.0, n)
    budget = 0.3 * (t_dw.sum() + t_dx.sum())
    exact_low = objective(select_exact(importance, t_dw, t_dx, budget * (1 - 1 / 100)), importance)
    monkeypatch.setattr(selector, "_TRIM_ABOVE", 16)  # force trimming at every step
    mask = select_exact(importance, t_dw, t_dx, budget, resolution=100)
    assert_feasible(mask, t_dw, t_dx, budget)
    assert objective(mask, importance) >= exact_low - 1e-9  # at least the optimum for budget * (1 - 1/resolution)


def test_grid_solver_is_optimal_for_rounded_up_costs():
    from fedelastic.selection.budgeted import select_grid

    rng = np.random.default_rng(11)
    for _ in range(300):
        importance, t_dw, t_dx, budget, resolution = random_instance(rng)
        mask = select_grid(importance, t_dw, t_dx, budget, resolution=resolution)
        assert_feasible(mask, t_dw, t_dx, budget)
        best_rounded, best_real = brute_force(importance, t_dw, t_dx, budget, resolution)
        positive = importance > 0
        if budget > 0 and backward_cost(positive, t_dw, t_dx) <= budget:
            assert np.array_equal(mask, positive)
        else:
            assert objective(mask, importance) == pytest.approx(best_rounded, rel=RTOL, abs=1e-12)
        assert objective(mask, importance) <= best_real + 1e-9


def _pareto(items, dw, room):
    """Brute force: the non-dominated (cost, value) states of the subsets of ``items`` costing at most ``room``."""
    states = []
    for r in range(len(items) + 1):
        for subset in itertools.combinations(items, r):
            cost = sum(dw[k] for k in subset)
            if cost <= room:
                states.append((cost, subset))
    return states


def test_the_exact_selector_is_charged_the_operations_it_performs():
    from fedelastic.selection.budgeted import EXACT_OPS_PER_STATE, EXACT_OPS_PER_UNIT

    rng = np.random.default_rng(5)
    n = 7
    importance, t_dw, t_dx = rng.uniform(0.1, 1, n), rng.uniform(0.5, 2, n), rng.uniform(0.1, 0.5, n)
    budget = 0.45 * (t_dw.sum() + t_dx[1:].sum())
    ops: list[float] = []
    mask = select_exact(importance, t_dw, t_dx, budget, resolution=1000, ops=ops)
    assert mask.any() and len(ops) == 1
    # by brute force: each list is the Pareto front of the subsets of the items added so far that fit
    # the room the cheapest deeper tensor leaves (costs are distinct reals: no ties)
    fixed = np.array([t_dw[j] + t_dx[j + 1 :].sum() for j in range(n)])
    cheapest = np.minimum.accumulate(fixed)
    limit = budget * (1 + 1e-9)

    def front(items, room):
        best, out = -np.inf, []
        for cost, subset in sorted(_pareto(items, t_dw, room)):
            value = sum(importance[k] for k in subset)
            if value > best:
                best = value
                out.append(cost)
        return out

    expected = EXACT_OPS_PER_UNIT * n
    size = 1  # the empty state
    for j in range(n - 1, -1, -1):
        i = j + 1
        if i < n:
            room = limit - cheapest[i - 1]
            old = front(list(range(i + 1, n)), limit - cheapest[i]) if i + 1 < n else [0.0]
            assert len(old) == size
            fit = sum(c + t_dw[i] <= room for c in old)
            expected += EXACT_OPS_PER_STATE * (size + fit) + (fit + 1) * math.ceil(math.log2(size + 1))
            size = len(front(list(range(i, n)), room))
        if fixed[j] <= limit:
            expected += math.ceil(math.log2(size + 1))
    assert ops[0] == expected
    # short lists: far below the grid's 4 N (resolution + 1) that used to be charged for it
    assert ops[0] < 4 * n * 1001 / 10
