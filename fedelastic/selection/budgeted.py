"""Budgeted tensor selection for ElasticTrainer (pure numpy).

Conventions
-----------
Tensors are indexed in forward order: ``0`` is nearest the input, ``N - 1`` nearest the loss.

* ``t_dw[k] >= 0``: time to compute tensor ``k``'s own weight gradient.
* ``t_dx[k] >= 0``: time to pass the error gradient from the output of tensor ``k``'s layer
  to its input. In a layer with several tensors, only the first tensor (lowest index) carries
  the layer's ``t_dx``; the others carry 0.

The backward cost of a 0/1 mask ``m`` whose deepest selected index is ``k_min`` is::

    T_bp(m) = sum_k m[k] * t_dw[k] + sum_{k > k_min} t_dx[k]

The deepest selected tensor's own ``t_dx`` is not charged, matching autograd: no gradient is
needed below it. The empty mask costs 0. (The public ElasticTrainer artifact charges
``k >= k_min``; see :func:`select_artifact_dp`.)

Selectors maximise ``sum_k m[k] * importance[k]`` subject to ``T_bp(m) <= budget``.
Importance may be negative; a tensor with importance ``<= 0`` is never selected, since it adds
cost and does not raise the objective.

Time
----
:func:`select_exact` works on real costs (a Pareto-list knapsack): optimal, or within
``budget / resolution`` of the optimum's budget when its lists grow long. The artifact DP puts
time on an integer grid of ``resolution`` units spanning the budget (``unit = budget /
resolution``) and rounds costs **up** (:func:`to_grid`), so its mask never exceeds the budget.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "ARTIFACT_OPS_PER_CELL",
    "EXACT_OPS_PER_STATE",
    "EXACT_OPS_PER_UNIT",
    "backward_cost",
    "select_artifact_dp",
    "select_exact",
    "select_grid",
    "select_greedy_ratio",
    "to_grid",
]

# A cost within this relative distance of a grid point is snapped to it instead of rounded up,
# so that e.g. a cost equal to the budget is not pushed one unit over by float error.
_SNAP_RTOL = 1e-9


def _as_vector(values: object, name: str, n: int | None = None) -> np.ndarray:
    """Return ``values`` as a finite 1-D float64 array, checking its length against ``n``."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name}: expected length {n}, got {arr.shape[0]}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: expected finite values")
    return arr


def _check_inputs(
    importance: object, t_dw: object, t_dx: object, budget: float, resolution: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and convert the common selector arguments."""
    imp = _as_vector(importance, "importance")
    n = imp.shape[0]
    dw = _as_vector(t_dw, "t_dw", n)
    dx = _as_vector(t_dx, "t_dx", n)
    if np.any(dw < 0) or np.any(dx < 0):
        raise ValueError("t_dw and t_dx: expected non-negative times")
    if np.isnan(budget):
        raise ValueError("budget: expected a number, got nan")
    if int(resolution) != resolution or resolution < 1:
        raise ValueError(f"resolution: expected a positive integer, got {resolution!r}")
    return imp, dw, dx


def _candidates(imp: np.ndarray, eligible: np.ndarray | None) -> np.ndarray:
    """Tensors worth selecting: positive importance, and eligible if a mask is given."""
    candidate = imp > 0
    if eligible is not None:
        elig = np.asarray(eligible, dtype=bool)
        if elig.shape != imp.shape:
            raise ValueError(f"eligible: expected shape {imp.shape}, got {elig.shape}")
        candidate &= elig
    return candidate


def _chain_dx(t_dx: np.ndarray) -> np.ndarray:
    """``chain[j] = sum_{i > j} t_dx[i]``: error-gradient cost to reach the output of tensor j."""
    chain = np.zeros_like(t_dx)
    if t_dx.shape[0] > 1:
        chain[:-1] = np.cumsum(t_dx[::-1])[::-1][1:]
    return chain


def backward_cost(mask: np.ndarray, t_dw: np.ndarray, t_dx: np.ndarray) -> float:
    """Backward time of a selection: ``sum m*t_dw + sum_{k > k_min} t_dx``.

    Parameters
    ----------
    mask : np.ndarray
        0/1 or bool selection, forward order.
    t_dw, t_dx : np.ndarray
        Per-tensor weight-gradient and error-gradient times (see module docstring).

    Returns
    -------
    float
        The backward time; 0.0 for the empty mask.
    """
    m = np.asarray(mask).astype(bool)
    dw = _as_vector(t_dw, "t_dw", m.shape[0])
    dx = _as_vector(t_dx, "t_dx", m.shape[0])
    if m.ndim != 1:
        raise ValueError(f"mask: expected a 1-D array, got shape {m.shape}")
    selected = np.flatnonzero(m)
    if selected.size == 0:
        return 0.0
    k_min = selected[0]
    return float(dw[m].sum() + dx[k_min + 1 :].sum())


def to_grid(costs: np.ndarray, budget: float, resolution: int) -> np.ndarray:
    """Convert times to integer grid units, rounding up.

    One unit is ``budget / resolution``. Values within a relative ``1e-9`` of a grid point are
    snapped to it; everything else is rounded up, so a set of costs that fits the grid capacity
    ``resolution`` fits the real budget. Values above the capacity are clipped to
    ``resolution + 1`` (infeasible either way).

    Parameters
    ----------
    costs : np.ndarray
        Non-negative times.
    budget : float
        Positive time budget (may be ``inf``: every cost is then 0 units).
    resolution : int
        Number of grid units spanning the budget.

    Returns
    -------
    np.ndarray
        int64 costs in units.
    """
    x = np.asarray(costs, dtype=np.float64) * resolution / budget
    nearest = np.round(x)
    snapped = np.abs(x - nearest) <= _SNAP_RTOL * np.maximum(1.0, nearest)
    units = np.where(snapped, nearest, np.ceil(x))
    return np.minimum(units, resolution + 1).astype(np.int64)


# Pareto lists longer than this are trimmed (states within budget / (resolution * N) merged)
_TRIM_ABOVE = 4096
#: element operations :func:`select_exact` performs per state of a merge (the old list plus the new
#: states): counted from its code, one per element of each vector pass (the shift, the masks, the
#: index scatters and gathers of cost, value, parent and took, the budget, Pareto and equal-cost
#: filters with their compressions); each new state's insertion point is one binary search more
EXACT_OPS_PER_STATE = 32
#: element operations per unit outside the merges: the inputs' checks, the chain and fixed costs,
#: the running minimum, the candidate test and the backtrack
EXACT_OPS_PER_UNIT = 12
#: element operations :func:`select_artifact_dp` performs per capacity cell of one ``(row, predecessor)``
#: update: the gain (add), the test (two compares and an and) and the masked writes of value and
#: both back-pointers
ARTIFACT_OPS_PER_CELL = 7


def _prepare(
    importance: np.ndarray,
    t_dw: np.ndarray,
    t_dx: np.ndarray,
    budget: float,
    resolution: int,
    eligible: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Checked inputs, the candidate mask, and the answer when no search is needed (else None).

    No search is needed with no tensors, no budget, no candidate, or when every candidate fits
    the budget together (then that set is optimal).
    """
    imp, dw, dx = _check_inputs(importance, t_dw, t_dx, budget, resolution)
    empty = np.zeros(imp.shape[0], dtype=bool)
    if imp.shape[0] == 0 or budget <= 0:
        return imp, dw, dx, empty, empty
    candidate = _candidates(imp, eligible)
    if not candidate.any():
        return imp, dw, dx, candidate, empty
    if backward_cost(candidate, dw, dx) <= budget:
        return imp, dw, dx, candidate, candidate
    return imp, dw, dx, candidate, None


def select_exact(
    importance: np.ndarray,
    t_dw: np.ndarray,
    t_dx: np.ndarray,
    budget: float,
    *,
    resolution: int = 1000,
    eligible: np.ndarray | None = None,
    ops: list[float] | None = None,
) -> np.ndarray:
    """Select tensors maximising total importance within a backward-time budget, on real costs.

    For every candidate deepest tensor ``j`` (from the loss side down), the fixed cost
    ``t_dw[j] + sum_{i > j} t_dx[i]`` is paid and the rest of the budget is filled by a 0/1
    knapsack over ``t_dw`` of the tensors above ``j``. The knapsack is kept as its Pareto list
    (every non-dominated ``(cost, importance)`` pair, real costs, no grid) and grown by one item
    as ``j`` moves down; each ``j`` is one binary search in it. While the list stays at most
    4,096 long the result is exactly optimal. Longer lists are trimmed: of the states whose costs
    fall in one cell of width ``budget / (resolution * N)`` only the best is kept, so a state
    costs at most ``budget / resolution`` more than the set it stands for, and the result is at
    least as good as the exact optimum for ``budget * (1 - 1/resolution)`` (0.1% of the budget
    at the default ``resolution = 1000``). The returned mask never exceeds the real budget. If
    every eligible tensor with positive importance fits the budget together, that set is returned.

    Parameters
    ----------
    importance : np.ndarray
        Per-tensor importance ``I[k]``, forward order; may be negative.
    t_dw, t_dx : np.ndarray
        Per-tensor times (see module docstring).
    budget : float
        Backward-time budget, in the units of ``t_dw``. ``budget <= 0`` gives the empty mask.
    resolution : int, optional
        The guarantee when trimming: within ``budget / resolution`` of the optimum's budget.
    eligible : np.ndarray, optional
        Bool mask of tensors that may be selected. Ineligible tensors are never selected but
        are still charged ``t_dx`` when the chain passes them.
    ops : list of float, optional
        If given, the element operations this call performed are appended (what the device is
        charged): :data:`EXACT_OPS_PER_UNIT` per unit, :data:`EXACT_OPS_PER_STATE` per state of
        each merge plus a binary search (``ceil(log2(size + 1))``) per new state and per candidate.
        They follow the Pareto lists' real lengths, not a grid's ``resolution + 1``.

    Returns
    -------
    np.ndarray
        Bool mask, forward order.
    """
    imp, dw, dx, candidate, settled = _prepare(importance, t_dw, t_dx, budget, resolution, eligible)
    n = imp.shape[0]
    count = 4.0 * n  # the inputs' checks and the candidate test (all a settled call does)
    if settled is not None:
        if ops is not None:
            ops.append(count)
        return settled
    count += (EXACT_OPS_PER_UNIT - 4.0) * n
    empty = np.zeros(n, dtype=bool)

    limit = budget * (1 + _SNAP_RTOL)
    chain = _chain_dx(dx)
    fixed = dw + chain
    # cheapest deepest tensor at or below each index: states costing more than what it leaves are useless
    cheapest = np.minimum.accumulate(np.where(candidate, fixed, np.inf))
    width = budget / (resolution * n)
    cost, value = np.zeros(1), np.zeros(1)
    steps: list[tuple[np.ndarray, np.ndarray] | None] = [None] * n  # (parent state, took item) per list
    best_value, best_j, best_state = 0.0, -1, -1
    for j in range(n - 1, -1, -1):
        i = j + 1  # add the tensor just above j to the knapsack
        if i < n and candidate[i]:
            room = limit - cheapest[i - 1]
            size = len(cost)
            shifted = cost + dw[i]
            fit = int(np.searchsorted(shifted, room, side="right"))
            count += EXACT_OPS_PER_STATE * (size + fit) + (fit + 1) * math.ceil(math.log2(size + 1))
            # merge the two sorted lists (without and with item i): O(size), no sort
            where = np.searchsorted(cost, shifted[:fit], side="left") + np.arange(fit)
            took = np.zeros(size + fit, bool)
            took[where] = True
            parent = np.empty(size + fit, np.int64)
            parent[where] = np.arange(fit)
            parent[~took] = np.arange(size)
            all_cost = np.empty(size + fit)
            all_cost[where], all_cost[~took] = shifted[:fit], cost
            all_value = np.empty(size + fit)
            all_value[where], all_value[~took] = value[:fit] + imp[i], value
            inside = all_cost <= room
            all_cost, all_value, parent, took = all_cost[inside], all_value[inside], parent[inside], took[inside]
            # Pareto: keep a state only if it beats every cheaper one
            keep = np.ones(len(all_cost), bool)
            keep[1:] = all_value[1:] > np.maximum.accumulate(all_value)[:-1]
            all_cost, all_value, parent, took = all_cost[keep], all_value[keep], parent[keep], took[keep]
            keep = np.ones(len(all_cost), bool)  # equal costs: the last kept state has the best value
            keep[:-1] = all_cost[:-1] < all_cost[1:]
            all_cost, all_value, parent, took = all_cost[keep], all_value[keep], parent[keep], took[keep]
            if len(all_cost) > _TRIM_ABOVE:  # keep the last (best) state of each cost cell
                cell = np.floor(all_cost / width)
                last = np.ones(len(cell), bool)
                last[:-1] = cell[1:] != cell[:-1]
                all_cost, all_value, parent, took = all_cost[last], all_value[last], parent[last], took[last]
            cost, value = all_cost, all_value
            steps[i] = (parent, took)
        if candidate[j] and fixed[j] <= limit:
            count += math.ceil(math.log2(len(cost) + 1))
            state = int(np.searchsorted(cost, limit - fixed[j], side="right")) - 1
            total = imp[j] + value[state]
            if total > best_value:
                best_value, best_j, best_state = total, j, state
    if ops is not None:
        ops.append(count)
    if best_j < 0:
        return empty

    # The list at best_j holds items best_j+1..n-1, added in the order n-1, ..., best_j+1: undo from the last.
    mask = empty.copy()
    mask[best_j] = True
    state = best_state
    for i in range(best_j + 1, n):
        step = steps[i]
        if step is None:
            continue
        parent, took = step
        mask[i] = bool(took[state])
        state = int(parent[state])
    return mask


def select_grid(
    importance: np.ndarray,
    t_dw: np.ndarray,
    t_dx: np.ndarray,
    budget: float,
    *,
    resolution: int = 1000,
    eligible: np.ndarray | None = None,
) -> np.ndarray:
    """The former exact selector: optimal for costs rounded up to a grid (fast, not exact on real costs).

    Kept as ``solver = "grid"``: on real models it leaves 1-11% of the importance behind (each
    selected tensor's cost rounded up by up to one unit), but it takes about a millisecond at 300
    tensors where :func:`select_exact` takes tens to hundreds (see benchmarks/studies/selection.md).

    For every candidate deepest tensor ``j`` (from the loss side down), the fixed cost
    ``t_dw[j] + sum_{i > j} t_dx[i]`` is paid and the rest of the budget is filled by a 0/1
    knapsack over ``t_dw`` of the tensors above ``j``. The knapsack is grown by one item as
    ``j`` moves down, so the whole search is ``O(N * resolution)``, one vectorised update per
    tensor. A ``take[item, capacity]`` table records the decisions for reconstruction.

    Costs are put on the grid of :func:`to_grid`: ``t_dw[k]`` and the chain
    ``sum_{i > j} t_dx[i]`` (as one sum) are each rounded up to whole units. The result is
    optimal for those rounded costs and never exceeds the real budget. If every eligible
    tensor with positive importance fits the real budget together, that set is returned
    directly (optimal without rounding loss).

    Parameters
    ----------
    importance : np.ndarray
        Per-tensor importance ``I[k]``, forward order; may be negative.
    t_dw, t_dx : np.ndarray
        Per-tensor times (see module docstring).
    budget : float
        Backward-time budget, in the units of ``t_dw``. ``budget <= 0`` gives the empty mask.
    resolution : int, optional
        Grid units spanning the budget.
    eligible : np.ndarray, optional
        Bool mask of tensors that may be selected. Ineligible tensors are never selected but
        are still charged ``t_dx`` when the chain passes them.

    Returns
    -------
    np.ndarray
        Bool mask, forward order.
    """
    imp, dw, dx, candidate, settled = _prepare(importance, t_dw, t_dx, budget, resolution, eligible)
    if settled is not None:
        return settled
    n = imp.shape[0]
    empty = np.zeros(n, dtype=bool)

    cap = int(resolution)
    w = to_grid(dw, budget, cap)
    fixed = w + to_grid(_chain_dx(dx), budget, cap)

    # dp[c]: best importance of the items added so far with weight <= c;
    # take[i, c]: item i was taken at capacity c when it was added
    dp = np.zeros(cap + 1)
    take = np.zeros((n, cap + 1), dtype=bool)
    best_value, best_j = 0.0, -1
    for j in range(n - 1, -1, -1):
        i = j + 1  # add the tensor just above j to the knapsack
        if i < n and candidate[i] and w[i] <= cap:
            wi = w[i]
            gain = dp[: cap + 1 - wi] + imp[i]
            better = gain > dp[wi:]
            take[i, wi:] = better
            dp[wi:] = np.where(better, gain, dp[wi:])
        if candidate[j] and fixed[j] <= cap:
            value = imp[j] + dp[cap - fixed[j]]
            if value > best_value:
                best_value, best_j = value, j
    if best_j < 0:
        return empty

    # Knapsack items j+1..n-1 were added in the order n-1, ..., j+1: undo from the last.
    mask = empty.copy()
    mask[best_j] = True
    c = cap - fixed[best_j]
    for i in range(best_j + 1, n):
        if take[i, c]:
            mask[i] = True
            c -= w[i]
    return mask


def select_artifact_dp(
    importance: np.ndarray,
    t_dw: np.ndarray,
    t_dx: np.ndarray,
    budget: float,
    *,
    resolution: int = 1000,
    artifact_grid: bool = False,
    ops: list[float] | None = None,
) -> np.ndarray:
    """Reproduce the DP of the public ElasticTrainer artifact, quirks included.

    Written from the artifact's recurrence (``selection_DP``), not copied. With ``r`` the
    reversed index (``r = 0`` nearest the loss), integer costs ``w[r]``, ``d[r]`` and
    capacity ``C``, the table ``V[k, c]`` (``k`` = number of loss-side tensors considered)
    is::

        V[0, c] = 0,  S[0, c] = True
        V[k, c] = max(V[k-1, c],
                      max_{p = k-1..0} V[p, c - w[k-1] - sum(d[p..k-1])] + I[k-1]
                          over p where that capacity is >= 0 and S[p, .] is True)
        S[k, c] = "tensor k-1 was selected in V[k, c]"

    The answer is the first maximum of ``V[1:, :]`` in row-major order.

    Known quirks, reproduced on purpose:

    * **One solution per state.** ``V[k, c]`` keeps one solution, and a selection can only
      chain from a state whose kept solution selected its last tensor (``S``). If skipping
      won at ``(p, c')``, the option "select tensor p-1 there" is lost, so the DP is not
      always optimal.
    * **Off-by-one: the tensor nearest the input is never eligible.** The number of rows is
      the first ``r`` whose loss-side cumulative ``d[0..r]`` exceeds ``C``, but if none does it
      is ``N - 1``, so row ``N`` (forward tensor 0) is never computed.
    * **The deepest tensor's own ``t_dx`` is charged** (``k >= k_min``), one term more than
      :func:`backward_cost`; the mask is therefore still feasible for it.
    * A tensor is selected only if that is strictly better than skipping it; ties go to the
      largest ``p`` (the artifact scans ``p`` downwards with a strict ``>``).

    Differences from the artifact: values are float64 (the artifact stores float32), and
    back-pointers replace its ``(rows, C, N)`` table of full solutions (same result). By
    default costs use the grid of :func:`to_grid` (each ``t_dw`` and ``t_dx`` rounded up,
    ``resolution`` units spanning the budget), so the mask never exceeds the budget and
    compares directly with :func:`select_exact`. ``artifact_grid=True`` uses the artifact's
    own grid instead: ``resolution`` units spanning the total backward time, costs rounded
    **down**, capacity ``floor(budget * scale)``; the mask may then exceed the real budget.
    (The artifact's ``main`` also multiplies ``rho`` by its rounding factor twice; that
    call-site slip is not reproduced.)

    Parameters
    ----------
    importance, t_dw, t_dx, budget, resolution
        As for :func:`select_exact`.
    artifact_grid : bool, optional
        Use the artifact's round-down grid over the total backward time.
    ops : list of float, optional
        If given, the element operations this call performed are appended: 4 per unit (the inputs
        and the grid) and :data:`ARTIFACT_OPS_PER_CELL` per capacity cell of every ``(row,
        predecessor)`` update it runs (each update covers the cells its offset leaves).

    Returns
    -------
    np.ndarray
        Bool mask, forward order. Tensor 0 is never selected.
    """
    imp, dw, dx = _check_inputs(importance, t_dw, t_dx, budget, resolution)
    n = imp.shape[0]
    empty = np.zeros(n, dtype=bool)
    count = 4.0 * n
    if n == 0 or budget <= 0:
        if ops is not None:
            ops.append(count)
        return empty
    if artifact_grid:
        total = float(dw.sum() + dx.sum())
        scale = resolution / total if total > 0 else 0.0
        w = np.floor(dw * scale).astype(np.int64)
        d = np.floor(dx * scale).astype(np.int64)
        cap = int(w.sum() + d.sum()) if budget >= total else int(budget * scale)
    else:
        cap = int(resolution)
        w = to_grid(dw, budget, cap)
        d = to_grid(dx, budget, cap)
    # reversed order: r = 0 nearest the loss
    w, d, val = w[::-1], d[::-1], imp[::-1]

    over = np.flatnonzero(np.cumsum(d) > cap)
    rows = int(over[0]) if over.size else n - 1  # the off-by-one quirk
    if rows == 0:
        if ops is not None:
            ops.append(count)
        return empty

    V = np.zeros((rows + 1, cap + 1))
    S = np.zeros((rows + 1, cap + 1), dtype=bool)
    S[0] = True
    from_row = np.full((rows + 1, cap + 1), -1, dtype=np.int64)
    from_cap = np.zeros((rows + 1, cap + 1), dtype=np.int64)
    caps = np.arange(cap + 1)
    for k in range(1, rows + 1):
        best = V[k - 1].copy()
        offset = int(w[k - 1])
        for p in range(k - 1, -1, -1):
            offset += int(d[p])
            if offset > cap:
                break
            prev = slice(0, cap + 1 - offset)
            count += ARTIFACT_OPS_PER_CELL * (cap + 1 - offset)
            gain = V[p, prev] + val[k - 1]
            better = S[p, prev] & (gain > best[offset:])
            best[offset:][better] = gain[better]
            from_row[k, offset:][better] = p
            from_cap[k, offset:][better] = caps[prev][better]
        V[k] = best
        S[k] = from_row[k] >= 0

    count += 2.0 * (rows + 1) * (cap + 1)  # the row copies and the final argmax
    if ops is not None:
        ops.append(count)
    k, c = divmod(int(np.argmax(V[1:])), cap + 1)
    k += 1
    chosen = np.zeros(n, dtype=bool)
    while k > 0:
        p = from_row[k, c]
        if p < 0:
            k -= 1
        else:
            chosen[k - 1] = True
            k, c = int(p), int(from_cap[k, c])
    return chosen[::-1].copy()


def select_greedy_ratio(
    importance: np.ndarray,
    t_dw: np.ndarray,
    t_dx: np.ndarray,
    budget: float,
    *,
    eligible: np.ndarray | None = None,
) -> np.ndarray:
    """Greedy by importance per marginal backward time, for ablations.

    Repeatedly adds the eligible, positive-importance tensor with the largest
    ``importance / marginal cost`` among those that still fit, where the marginal cost of
    tensor ``k`` is ``t_dw[k]`` plus any extension of the ``t_dx`` chain it causes (when it
    lies below the current deepest selected tensor). Uses real (unrounded) times; a zero
    marginal cost ranks first. Not optimal.

    Parameters
    ----------
    importance, t_dw, t_dx, budget, eligible
        As for :func:`select_exact`.

    Returns
    -------
    np.ndarray
        Bool mask, forward order.
    """
    imp, dw, dx = _check_inputs(importance, t_dw, t_dx, budget, 1)
    n = imp.shape[0]
    mask = np.zeros(n, dtype=bool)
    if n == 0 or budget <= 0:
        return mask
    open_ = _candidates(imp, eligible)
    chain = _chain_dx(dx)
    spent = 0.0  # backward time used so far
    reached = 0.0  # t_dx chain cost down to the deepest selected tensor
    while open_.any():
        marginal = dw + np.maximum(chain - reached, 0.0)
        fits = open_ & (spent + marginal <= budget)
        if not fits.any():
            break
        with np.errstate(divide="ignore"):
            ratio = np.where(marginal > 0, imp / marginal, np.inf)
        k = int(np.argmax(np.where(fits, ratio, -np.inf)))
        mask[k] = True
        open_[k] = False
        spent += marginal[k]
        reached = max(reached, chain[k])
    return mask
