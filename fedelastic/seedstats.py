"""Statistics of a comparison's runs over seeds: one run's headline figures, and per (fleet,
strategy) the mean and 95% interval of each over the seeds that completed.

Only seeds whose run ``completed`` (:data:`USED`) enter a mean or an interval; interval bounds are
clipped at the metric's physical bounds (:func:`bounds`); time and energy to target are censored
at the run's end, never dropped (:func:`aggregate`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from .sim.columns import ClientCol as C
from .sim.columns import RoundCol as R


def summarise(rounds: pd.DataFrame, clients: pd.DataFrame, target: float) -> dict:
    """One run's headline figures.

    ``time_to_target_s`` is the simulated time of the first round at or above ``target``; a run
    that never gets there has NaN there and ``reached_target = False`` (censored at its end,
    ``sim_time_s``), never a made-up time. Only evaluated rounds count (``server.evaluate_every``
    skips some: their accuracy is NaN), and ``final_accuracy`` is the last evaluated round's.
    """
    trained = rounds[rounds[R.ROUND] > 0]
    evaluated = rounds[R.TEST_ACCURACY].dropna()
    row = {
        "final_accuracy": float(evaluated.iloc[-1]) if len(evaluated) else float("nan"),
        "sim_time_s": float(rounds[R.SIM_TIME_S].iloc[-1]),
        "energy_j": float(rounds[R.TOTAL_ENERGY_J].iloc[-1]),
        "peak_memory_bytes": float(clients[C.EMULATED_PEAK_MEMORY_BYTES].max()),
        "fits_fraction": float(clients[C.FITS].mean()),
        "mean_train_time_per_round_s": float(clients[C.EMULATED_TRAIN_TIME_S].mean()),
        "fraction_params_trained": float(clients[C.FRACTION_PARAMS_TRAINED].mean()),
        "host_wall_s": float(trained[R.HOST_WALL_S].sum()),
    }
    if target:
        hit = rounds[rounds[R.TEST_ACCURACY] >= target]
        row["reached_target"] = bool(len(hit))
        row["time_to_target_s"] = float(hit[R.SIM_TIME_S].iloc[0]) if len(hit) else float("nan")
        row["energy_to_target_j"] = float(hit[R.TOTAL_ENERGY_J].iloc[0]) if len(hit) else float("nan")
    return row


def ci95(values: np.ndarray) -> float:
    """Half-width of the 95% confidence interval of the mean (Student t); NaN for fewer than 2 values."""
    from scipy import stats

    values = np.asarray(values, float)
    n = len(values)
    if n < 2:
        return float("nan")
    return float(stats.t.ppf(0.975, n - 1) * values.std(ddof=1) / np.sqrt(n))


_TO_TARGET = ("time_to_target_s", "energy_to_target_j")
USED = "completed"  # the only run status whose seeds enter means and intervals
_NOT_METRICS = ("fleet", "strategy", "seed", "run_dir", "reached_target", "status", "error", "lr", "bn_mode")


def bounds(metric: str) -> tuple[float, float]:
    """The physical range of a summary metric: every one is a time, energy, memory, count or share
    (>= 0), and accuracies and fractions are also <= 1."""
    return 0.0, 1.0 if ("accuracy" in metric or "fraction" in metric) else math.inf


def interval(mean: float, ci: float, metric: str) -> tuple[float, float]:
    """``mean -+ ci`` clipped at ``metric``'s :func:`bounds` (NaN for a NaN half-width)."""
    lo, hi = bounds(metric)
    if math.isnan(ci) or math.isnan(mean):
        return float("nan"), float("nan")
    return max(mean - ci, lo), min(mean + ci, hi)


def interval_text(mean: float, ci: float, low: float, high: float, fmt: str) -> str:
    """``mean ± ci``; ``mean [low, high]`` where a bound clipped the interval; ``mean`` alone without one."""
    if math.isnan(mean):
        return "-"
    if math.isnan(ci):
        return fmt.format(mean)
    if low > mean - ci or high < mean + ci:
        return f"{fmt.format(mean)} [{fmt.format(low)}, {fmt.format(high)}]"
    return f"{fmt.format(mean)} ± {fmt.format(ci)}"


def _counts(status: pd.Series) -> dict[str, Any]:
    used = int((status == USED).sum())
    diverged = int((status == "diverged").sum())
    with_errors = int((status == "completed_with_errors").sum())
    return {
        "used": f"{used}/{len(status)}",
        "failed": len(status) - used - diverged - with_errors,
        "diverged": diverged,
        "with_errors": with_errors,
    }


def _values(column: pd.Series) -> str:
    """The distinct values of a column as one cell (``0.01`` or ``0.01, 0.1``)."""
    return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in dict.fromkeys(column.dropna()))


def aggregate(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (fleet, strategy): mean and 95% interval of every metric over the seeds that completed.

    A seed whose ``status`` is anything but ``completed`` (failed, diverged, completed with
    client errors, or a run that raised) enters no mean and no interval; ``used`` says how many
    did (``2/3``), ``failed``, ``diverged`` and ``with_errors`` count the others. A table without
    a ``status`` column is taken as all completed. ``*_low``/``*_high`` are the interval's bounds,
    clipped at the metric's :func:`bounds`.

    Time and energy to target are censored, not dropped: a seed that never reached the target
    enters at its end-of-run time and energy, so the mean is a lower bound whenever
    ``reached`` (e.g. ``2/3``) is below all seeds, and ``*_is_lower_bound`` says so.
    """
    metrics = [c for c in summary.columns if c not in _NOT_METRICS]
    rows = []
    for (fleet, strategy), g in summary.groupby(["fleet", "strategy"], sort=False):
        status = g["status"].fillna("failed") if "status" in g else pd.Series(USED, index=g.index)
        row: dict[str, Any] = {"fleet": fleet, "strategy": strategy, "seeds": len(g), **_counts(status)}
        for key in ("lr", "bn_mode"):
            if key in g:
                row[key] = _values(g[key])
        u = g[status == USED]
        for m in metrics:
            values = u[m].to_numpy(float)
            if m in _TO_TARGET:
                censored = ~u["reached_target"].to_numpy(bool)
                end = u["sim_time_s" if m == "time_to_target_s" else "energy_j"].to_numpy(float)
                values = np.where(censored, end, values)
                row[f"{m}_is_lower_bound"] = bool(censored.any())
            mean = float(values.mean()) if len(values) else float("nan")
            ci = ci95(values)
            row[f"{m}_mean"], row[f"{m}_ci95"] = mean, ci
            row[f"{m}_low"], row[f"{m}_high"] = interval(mean, ci, m)
        if "reached_target" in g:
            row["reached_target"] = f"{int(u.reached_target.astype(bool).sum())}/{len(u)}"
        rows.append(row)
    return pd.DataFrame(rows)


def exit_code(summary: pd.DataFrame) -> int:
    """What ``fedelastic compare`` exits with: 4 if any seed diverged, else 3 if any seed did not
    complete (failed, raised, or completed with client errors), else 0."""
    status = summary["status"].fillna("failed") if "status" in summary else pd.Series([], dtype=object)
    if (status == "diverged").any():
        return 4
    return 3 if (status != USED).any() else 0


def curves(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (fleet, strategy, round): mean simulated time and mean accuracy with its 95% interval over seeds.

    Rounds without an accuracy (skipped by ``server.evaluate_every``) are left out, and so are
    the runs whose ``status`` (where the table has one) is not ``completed``.
    """
    if "status" in runs:
        runs = runs[runs.status == USED]
    runs = runs[runs[R.TEST_ACCURACY].notna()]  # runs.csv: the runs' rounds tables, with fleet and strategy
    g = runs.groupby(["fleet", "strategy", R.ROUND], sort=False)
    out = g.agg(sim_time_s=(R.SIM_TIME_S, "mean"), accuracy=(R.TEST_ACCURACY, "mean")).reset_index()
    out["accuracy_ci95"] = g[R.TEST_ACCURACY].apply(lambda v: ci95(v.to_numpy())).to_numpy()
    return out
