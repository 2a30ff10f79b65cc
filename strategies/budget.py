"""Public base and helpers of the time-budgeted strategies (elastic_tensor, elastic_layer, random_budget, ...).

Import as ``fedelastic.strategies.budget``: subclass :class:`BudgetedStrategy` (options: a
:class:`BudgetConfig` or :class:`ElasticConfig` subclass) and register it with
``fedelastic.register_strategy``.

Conventions
-----------
* **Budget.** ``rho`` is the wanted step time as a fraction of full training's on the device;
  the backward budget is :meth:`CostModel.backward_budget_s` ``(rho)`` =
  ``rho * (T_fwd + T_bp_full) - T_fwd``, from the device's modelled or measured times (no fixed
  forward:backward ratio).
* **Costs.** A trained tensor costs ``t_dw + t_opt`` (its gradient and its optimizer update);
  the error-gradient chain costs ``t_dx`` of every tensor above the deepest selected one, the
  deepest tensor's own ``t_dx`` excluded. This is exactly :meth:`CostModel.backward_time_s` of a
  0/1 selection, except when the deepest tensor lies on a projection shortcut: the cost model
  then drops the main branch's dx it does not need and the solvers, which still charge it,
  over-estimate. Either way a selection within the budget has
  ``step_time_s(ratios) <= rho * full_step_time_s()``.
* **No budget.** When ``rho`` is at or below the device's forward share of a step
  (``backward_budget_s(rho) <= 0``), option ``infeasible`` decides: ``"skip"`` (default) selects
  nothing, so that client trains nothing and reports zero steps; ``"error"`` raises a
  :class:`~fedelastic.errors.ConfigError` naming ``rho``. Skipping is the default because one
  ``rho`` is shared by a whole heterogeneous fleet, and an MCU's forward share (about 1/3) is
  larger than a GPU's.
* **Memory.** The time-optimal selection is priced with :meth:`CostModel.peak_memory_bytes`
  (and, as a guard, with :meth:`CostModel.backward_time_s`). If it exceeds
  ``ctx.memory_budget_bytes`` (or the time budget) the *floor* is raised: the deepest selected unit and
  everything below it become ineligible and the selector runs again on the units above (the
  saved activations of every weightless op above the deepest trained layer are what dominates
  training memory, so raising the floor is what frees most). This repeats until the selection
  fits or is empty. Each re-solve is optimal for its floor, not jointly optimal for time and
  memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedelastic.config import check, field
from fedelastic.cost.costmodel import CostModel
from fedelastic.errors import ConfigError
from fedelastic.selection.budgeted import select_artifact_dp, select_exact, select_greedy_ratio, select_grid
from fedelastic.selection.strategy import Selection, SelectionContext, SelectionStrategy

SOLVERS = ("exact", "grid", "artifact_dp", "greedy")
_TIME_RTOL = 1e-9
Solver = Literal["exact", "grid", "artifact_dp", "greedy"]


@dataclass(frozen=True)
class BudgetConfig:
    """Options of a time-budgeted selection that is made once (see :mod:`fedelastic.strategies.budget`)."""

    rho: float = field(
        0.5,
        help="target step time as a fraction of full training's step time on the device, in (0, 1]; "
        "must exceed the device's forward share of a step to leave any backward time",
    )
    solver: Solver = field(
        "exact",
        help="'exact' (optimal on real costs; within budget/resolution when its lists are trimmed), 'grid' "
        "(optimal for costs rounded up to `resolution` units: much faster on large models, leaves a few percent), "
        "'artifact_dp' (the public ElasticTrainer DP, quirks included) or 'greedy' (importance per marginal time)",
    )
    resolution: int = field(1000, help="time-grid units spanning the backward budget in the DP solvers, >= 1")
    infeasible: Literal["skip", "error"] = field(
        "skip",
        help="when rho leaves no backward time on a device: 'skip' selects nothing (the client trains "
        "nothing), 'error' raises a ConfigError naming rho",
    )

    def __post_init__(self) -> None:
        check(0 < self.rho <= 1, "rho", "a number in (0, 1]")
        check(self.solver in SOLVERS, "solver", f"one of {list(SOLVERS)}")
        check(
            isinstance(self.resolution, int) and 1 <= self.resolution <= 1_000_000,
            "resolution",
            "an integer in [1, 1000000]",
        )
        check(self.infeasible in ("skip", "error"), "infeasible", "one of ['skip', 'error']")


@dataclass(frozen=True)
class ElasticConfig(BudgetConfig):
    """Options of an elastic (periodically re-selecting) time-budgeted selection."""

    interval: int = field(
        4,
        help="re-probe and re-select every `interval` epochs (or steps, see interval_unit), >= 1; "
        "dropped tensors can return. The ElasticTrainer artifact's is 4 epochs",
    )
    interval_unit: Literal["epochs", "steps"] = field(
        "epochs", help="what `interval` counts: 'epochs' of local training (the artifact's) or 'steps'"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check(isinstance(self.interval, int) and self.interval >= 1, "interval", "an integer >= 1")
        check(self.interval_unit in ("epochs", "steps"), "interval_unit", "one of ['epochs', 'steps']")


def backward_budget(cost: CostModel, config: BudgetConfig, strategy: str) -> float:
    """The backward-time budget of ``config.rho`` on ``cost``'s device; ``<= 0`` means none.

    Raises
    ------
    ConfigError
        If there is no backward time left and ``config.infeasible == "error"``.
    """
    budget = cost.backward_budget_s(config.rho)
    if budget <= 0 and config.infeasible == "error":
        share = cost.forward_time_s / cost.full_step_time_s()
        raise ConfigError(
            f"<strategy {strategy}>",
            "train.options.rho",
            f"more than the forward share {share:.3f} of a step on device {cost.device.name!r} "
            "(no backward time is left to train anything)",
            config.rho,
        )
    return budget


def solve(
    importance: np.ndarray,
    t_dw: np.ndarray,
    t_dx: np.ndarray,
    budget: float,
    solver: str,
    resolution: int,
    floor: int = -1,
    ops: list[float] | None = None,
    artifact_grid: bool = False,
) -> np.ndarray:
    """Run ``solver`` on the units above ``floor`` (indices ``> floor``); bool mask over all units.

    The sub-problem above a floor has the same costs as the full problem restricted to it (the
    chain of a unit only counts units above it), so slicing is exact for every solver. ``ops``,
    if given, gets the solve's element operations appended (:func:`solver_ops`; the exact
    solver's are counted as it runs).
    """
    n = len(importance)
    mask = np.zeros(n, dtype=bool)
    lo = floor + 1
    if budget <= 0 or lo >= n:
        return mask
    args = (importance[lo:], t_dw[lo:], t_dx[lo:], budget)
    if solver == "exact":
        sub = select_exact(*args, resolution=resolution, ops=ops)
        ops = None  # counted
    elif solver == "grid":
        sub = select_grid(*args, resolution=resolution)
    elif solver == "artifact_dp":
        sub = select_artifact_dp(*args, resolution=resolution, artifact_grid=artifact_grid, ops=ops)
        ops = None  # counted
    elif solver == "greedy":
        sub = select_greedy_ratio(*args)
    else:
        raise ValueError(f"unknown solver {solver!r}")
    mask[lo:] = sub
    if ops is not None:
        ops.append(solver_ops(n - lo, solver, resolution))
    return mask


def solver_ops(n: int, solver: str, resolution: int) -> float:
    """Elementary operations of one solve over ``n`` units (priced on the device as selector work).

    'exact' and 'artifact_dp' are not priced here: :func:`~fedelastic.selection.budgeted.select_exact` and
    :func:`~fedelastic.selection.budgeted.select_artifact_dp` count what they perform.
    """
    if solver in ("exact", "artifact_dp"):
        raise ValueError(f"the {solver} solver's operations are counted as it runs (its ops argument)")
    if solver == "grid":  # one vectorised knapsack update (add, compare, select, record) per unit and cell
        return 4.0 * n * (resolution + 1)
    return 6.0 * n * n  # greedy: one pass over the units per pick


def shrink_to_memory(
    select: Callable[[int], np.ndarray], fits: Callable[[np.ndarray], bool], start_floor: int = -1
) -> np.ndarray:
    """Raise the floor until the selection fits in memory (or is empty).

    Parameters
    ----------
    select : callable
        ``select(floor)`` returns a bool mask over units with every selected index ``> floor``.
    fits : callable
        Whether a unit mask fits the memory budget.
    start_floor : int
        The first floor to try; units at or below it are known not to fit.

    Returns
    -------
    np.ndarray
        A fitting mask from the lowest floor found to fit (exactly the lowest when memory falls
        monotonically as the floor rises); the empty mask if none does.
    """
    mask = select(start_floor)
    if not mask.any() or fits(mask):
        return mask
    # Gallop upward from the deepest selected unit, then bisect back to the lowest floor that
    # fits: O(log N) solves instead of one per floor (memory falls as the floor rises).
    lo, step = int(np.flatnonzero(mask)[0]) - 1, 1  # floors below the deepest unit give this same mask
    while True:
        hi = lo + step
        candidate = select(hi)
        if not candidate.any() or fits(candidate):
            break
        lo, step = hi, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        trial = select(mid)
        if not trial.any() or fits(trial):
            hi, candidate = mid, trial
        else:
            lo = mid
    return candidate


def tensor_times(cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Per-tensor ``(t_dw + t_opt, t_dx)``: a trained tensor's cost and its chain cost."""
    return cost.t_dw + cost.t_opt, cost.t_dx.copy()


class BudgetedStrategy(SelectionStrategy):
    """Base of the strategies that maximise a per-unit score within ElasticTrainer's time budget.

    Subclasses give the per-tensor score (:meth:`scores`) and may group tensors into units
    (:meth:`units`); this class prices the units, runs the solver, raises the floor until the
    selection fits in memory and expands it to a tensor :class:`Selection`.
    """

    config_cls = ElasticConfig
    respects_memory = True  # shrinks its selection to ctx.memory_budget_bytes (contract tests)
    respects_time = True  # its selections keep rho x full on the cost model (contract tests)
    score_name = "score"  # what :meth:`scores` measures, as the reasons name it
    artifact_grid = False  # the 'artifact_dp' solver on the artifact's own grid (see select_artifact_dp)

    def prior(self, ctx: SelectionContext) -> tuple[float, np.ndarray, np.ndarray, float]:
        """What the solver believes a selection costs: ``(budget, t_dw + t_opt, t_dx, fixed)``.

        The backward budget of ``rho``, each tensor's cost and chain cost, and the backward time
        every non-empty selection pays besides (a measured table's loss gradient). By default the
        device's cost model, the one that charges the time.
        """
        budget = backward_budget(ctx.cost, self.config, self.name)
        dw, dx = tensor_times(ctx.cost)
        return budget, dw, dx, float(getattr(ctx.cost, "t_bwd_fixed", 0.0))

    def should_reselect(self, step: int, steps_per_epoch: int = 0) -> bool:
        interval = getattr(self.config, "interval", 0)
        if getattr(self.config, "interval_unit", "steps") == "epochs":
            interval *= steps_per_epoch
        return bool(interval) and step > 0 and step % interval == 0

    def carries_selection(self) -> bool:
        """An interval carries over between local trainings (rounds), as the artifact's over epochs."""
        return getattr(self.config, "interval", 0) > 0

    def probe_scope(self, ctx: SelectionContext) -> np.ndarray:
        """The tensors that can be selected at all: none when no unit can be trained (then
        ``ctx.note`` says why, with the figures), else those of the units at or above the deepest
        unit whose training fits memory alone (memory grows as units are added, so a unit that
        does not fit alone is never selected)."""
        n = ctx.info.num_tensors
        prior = self.prior(ctx)
        unit = self.units(ctx)
        lowest = self._lowest_fitting_unit(ctx, unit) if prior[0] > 0 else 0
        ctx.note = self._nothing_trains(ctx, prior, unit, lowest)
        if ctx.note:
            return np.zeros(n, dtype=bool)
        return unit >= lowest

    def _nothing_trains(
        self, ctx: SelectionContext, prior: tuple[float, np.ndarray, np.ndarray, float], unit: np.ndarray, lowest: int
    ) -> str:
        """Why no unit can be trained on this device, with the figures; "" when one can.

        ``prior``: :meth:`prior`; ``lowest``: :meth:`_lowest_fitting_unit`. A unit trained
        alone costs its ``t_dw + t_opt`` plus the ``t_dx`` of every unit above it (the solvers'
        cost); a budget below the cheapest such unit (after the backward time no tensor owns)
        selects nothing, whatever the scores.
        """
        cost, cfg, device = ctx.cost, self.config, ctx.cost.device.name
        budget, dw, dx, fixed = prior
        what = "tensor" if np.array_equal(unit, np.arange(ctx.info.num_tensors)) else "unit"
        if budget <= 0:
            share = cost.forward_time_s / cost.full_step_time_s()
            return (
                f"rho {cfg.rho:g} is at or below the forward share {share:.3f} of a step on device {device!r}: "
                "its budget leaves no room beyond the forward pass"
            )
        num_units = int(unit.max()) + 1 if unit.size else 0
        if not num_units:
            return "the model has no trainable tensor"
        if lowest >= num_units:  # no unit fits memory, even alone
            memory = ctx.memory_budget_bytes
            forward = cost.peak_memory_bytes(np.zeros(ctx.info.num_tensors))
            if forward > memory:
                return f"the forward pass alone needs {forward:.0f} bytes on device {device!r}; it has {memory:.0f}"
            need = min(cost.peak_memory_bytes((unit == u).astype(float)) for u in range(num_units))
            return f"training the smallest {what} alone needs {need:.0f} bytes on device {device!r}; it has {memory:.0f}"
        unit_dw = np.bincount(unit, weights=dw, minlength=num_units)
        unit_dx = np.bincount(unit, weights=dx, minlength=num_units)
        chain_above = np.concatenate([np.cumsum(unit_dx[::-1])[::-1][1:], [0.0]])
        cheapest = float((unit_dw + chain_above)[lowest:].min())  # of the units that fit memory
        left = budget - fixed
        if left <= 0 or cheapest > left * (1 + _TIME_RTOL):
            return (
                f"rho {cfg.rho:g} leaves a backward budget of {_time(budget)} on device {device!r}, below the "
                f"{_time(cheapest + fixed)} the cheapest trainable {what} needs ({_time(cheapest)}, plus "
                f"{_time(fixed)} any training step pays)"
            )
        return ""

    @staticmethod
    def _lowest_fitting_unit(ctx: SelectionContext, unit: np.ndarray) -> int:
        """The deepest unit whose training alone fits memory; the number of units if none does."""
        n = ctx.info.num_tensors
        num_units = int(unit.max()) + 1 if n else 0
        if ctx.cost.peak_memory_bytes(np.zeros(n)) <= ctx.memory_budget_bytes:
            for u in range(num_units):
                if ctx.cost.peak_memory_bytes((unit == u).astype(float)) <= ctx.memory_budget_bytes:
                    return u
        return num_units

    def scores(self, ctx: SelectionContext) -> np.ndarray:
        """Per-tensor score to maximise, forward order."""
        raise NotImplementedError

    def units(self, ctx: SelectionContext) -> np.ndarray:
        """Unit index of every tensor (non-decreasing in forward order); default: one per tensor."""
        return np.arange(ctx.info.num_tensors)

    def select(self, ctx: SelectionContext) -> Selection:
        cfg = self.config
        n = ctx.info.num_tensors
        score = np.asarray(self.scores(ctx), dtype=float)
        if score.shape != (n,):
            raise ValueError(f"{self.name}: expected {n} tensor scores, got shape {score.shape}")
        prior = self.prior(ctx)
        budget, dw, dx, fixed = prior
        unit = self.units(ctx)
        num_units = int(unit.max()) + 1 if n else 0
        # Memory only grows as units are added, so a unit that does not fit alone never fits: start
        # the floor just below the deepest unit that fits alone (one solve instead of one per floor).
        lowest = self._lowest_fitting_unit(ctx, unit) if budget > 0 else 0
        ctx.note = self._nothing_trains(ctx, prior, unit, lowest)
        self.empty_note = ""
        if ctx.note:  # nothing can be trained: no solve runs
            return Selection.from_mask(np.zeros(n))
        unit_score = np.bincount(unit, weights=score, minlength=num_units)
        unit_dw = np.bincount(unit, weights=dw, minlength=num_units)
        unit_dx = np.bincount(unit, weights=dx, minlength=num_units)
        memory_budget = ctx.memory_budget_bytes

        def to_tensors(unit_mask: np.ndarray) -> np.ndarray:
            return unit_mask[unit].astype(float)

        # backward time no tensor owns (e.g. a measured table's loss gradient) is paid by any
        # non-empty selection: the units share what is left of the budget
        unit_budget = budget - fixed

        def pick(floor: int) -> np.ndarray:
            done: list[float] = []
            mask = solve(
                unit_score, unit_dw, unit_dx, unit_budget, cfg.solver, cfg.resolution, floor, done, self.artifact_grid
            )
            ctx.ops += sum(done)
            return mask

        def fits(unit_mask: np.ndarray) -> bool:
            ratios = to_tensors(unit_mask)
            # the time check is a guard: the solvers already keep the grid-rounded cost in budget
            in_time = not self.respects_time or ctx.cost.backward_time_s(ratios) <= budget * (1 + _TIME_RTOL)
            return in_time and ctx.cost.peak_memory_bytes(ratios) <= memory_budget

        mask = shrink_to_memory(pick, fits, lowest - 1)
        if not mask.any():
            self.empty_note = self._nothing_scores(
                ctx, budget, unit_score, unit_dw, unit_dx, lowest, what_unit(ctx, unit)
            )
        return Selection.from_mask(to_tensors(mask))

    def _nothing_scores(
        self, ctx: SelectionContext, budget: float, score: np.ndarray, dw: np.ndarray, dx: np.ndarray, lowest: int,
        what: str,
    ) -> str:  # fmt: skip
        """Why the solve picked nothing although some unit fits the budget and memory: with the figures.

        ``score``, ``dw``, ``dx``: per unit. The solvers only take units of positive score (a unit
        of score <= 0 lowers the total), so none of the units the budget affords alone scores above 0
        (or those that do only fit memory together with nothing).
        """
        fixed = float(getattr(ctx.cost, "t_bwd_fixed", 0.0))
        chain_above = np.concatenate([np.cumsum(dx[::-1])[::-1][1:], [0.0]])
        alone = dw + chain_above  # a unit trained alone: its own cost and the chain above it
        afford = (np.arange(len(score)) >= lowest) & (alone <= (budget - fixed) * (1 + _TIME_RTOL))
        positive = score > 0
        name, device = self.score_name, ctx.cost.device.name
        if (afford & positive).any():
            return (
                f"the {what}s of positive {name} within the backward budget of {_time(budget)} do not fit the "
                f"{ctx.memory_budget_bytes:.0f} bytes device {device!r} has for training"
            )
        text = (
            f"no {what} that the backward budget of {_time(budget)} on device {device!r} affords has a positive "
            f"{name}: the {int(afford.sum())} it affords score {score[afford].min():.3g} to {score[afford].max():.3g}"
        )
        if positive.any():
            text += (
                f"; the {int(positive.sum())} of positive {name} (of {len(score)}) cost at least "
                f"{_time(float(alone[positive].min()) + fixed)} alone"
            )
        else:
            text += f"; none of the {len(score)} {what}s scores above 0"
        if name == "importance":
            text += (
                " (importance = -g . dw of the probe's one optimizer step: negative where that step, at the "
                "training learning rate, raised the loss)"
            )
        return text


def what_unit(ctx: SelectionContext, unit: np.ndarray) -> str:
    """'tensor' when every unit is one tensor, else 'unit' (how the reasons name a unit)."""
    return "tensor" if np.array_equal(unit, np.arange(ctx.info.num_tensors)) else "unit"


def _time(seconds: float) -> str:
    """``seconds`` in us, ms or s, three significant figures."""
    if abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    return f"{seconds * 1e3:.3g} ms" if abs(seconds) < 1 else f"{seconds:.3g} s"


def require_importance(ctx: SelectionContext, name: str) -> np.ndarray:
    if ctx.importance is None:
        raise ValueError(f"strategy {name!r} needs ctx.importance from the 'importance' probe")
    return np.asarray(ctx.importance, dtype=float)
